"""Would the accounted private choice rank the baselines' candidates right if it scored the
training records too? (issue 37: "a selection rule that can say no"; the deployable rows.)

The baselines study (experiments/baselines.py) chooses each deployable row's candidate by the
release of select_by=private_validation: each candidate's clipped mean per-unit loss on the
validation split plus Gaussian noise of sd z·C/n. At the studies' n (250 validation reviews on
builtin Yelp, 100 on SmolLM2 Yelp) and selection ε 0.2 that sd is 1-2 nats, against candidates
0.1-0.5 nats apart: a coin toss. The same release over the training records as well (one more
reader of them, composed like any other; the ledger already composes the selection sequentially)
has n 20x larger and a noise sd 20x smaller, at the same ε. What it may lose: a candidate's loss on
records it trained on can read low, so a candidate that fits its training records more closely
could look better than it is on new ones. DP bounds that effect and does not remove it.

For every finished repeat of the rows named (each candidate a run of its own), this rebuilds the
run root's splits (from its split key, as the harness does), computes each candidate student's
exact clipped mean on the validation split and on the training split, and prints beside the
candidates' test perplexity (windowed, the tables' figure):
- which candidate each exact score ranks first, and the test split's best;
- at the selection ε (`--epsilon`), the probability that the noisy release keeps the test-best
  candidate and the expected regret in test perplexity, by simulation (200,000 draws), for the
  validation units alone (what the study ran) and for training and validation units together.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/selection_split.py --config configs/reference.yaml \\
        --results docs/results/baselines_reference.jsonl --rows dpsgddep,dpsgd,dpkddep,dpkd

The exact scores are study figures computed from the private training and validation splits of a
benchmark corpus, printed like the test perplexities (README, "Not protected"); no run publishes
them. Each run's data is read again from its config (../shared/data beside the checkout).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.baselines import _stage_output  # noqa: E402
from experiments.private_selection import exact_score  # noqa: E402
from experiments.shared import read_results, require_data  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.models.base import load_causal_lm, load_tokenizer  # noqa: E402
from pipeline.privacy import private_selection  # noqa: E402
from pipeline.privacy.ledger import read_ledger  # noqa: E402
from pipeline.records import split_key  # noqa: E402
from pipeline.stages.data import prepare_data  # noqa: E402

DRAWS = 200_000


def keeps_best(scores: dict[str, float], sd: float, test: dict[str, float], rng) -> tuple[float, float]:
    """P(the noisy argmin is the test-best candidate) and the expected regret in test perplexity."""
    names = list(scores)
    noisy = np.array([scores[n] for n in names])[None, :] + rng.normal(0.0, sd, (DRAWS, len(names)))
    kept = np.array([test[n] for n in names])[noisy.argmin(1)]
    best = min(test.values())
    return float((kept == best).mean()), float((kept - best).mean())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--results", type=Path, required=True, help="the baselines study's jsonl")
    p.add_argument("--rows", default="dpsgddep,dpkddep", help="rows whose candidates are runs, comma-separated")
    p.add_argument("--epsilon", type=float, default=0.2, help="the selection ε over the K scores")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    require_data(cfg, "experiments/selection_split.py", args.config)
    runs = [r for r in read_results(args.results, cfg.name) if r.get("kind") == "run"]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        if r["row"] in args.rows.split(","):
            groups.setdefault((r["row"], r["repeat"]), []).append(r)
    rng = np.random.default_rng(0)  # the simulation's draws: an analysis, not a release
    clip = cfg.distill.selection_clip
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(cfg.data, Path(tmp), cfg.control_codes.domain,
                            split_key(Path(cfg.run_root).resolve(), create=False))
        for (row, repeat), group in sorted(groups.items()):
            if len(group) < 2:
                continue
            delta = read_ledger(Path(group[0]["run_dir"]) / "ledger.json").total.accountant_delta()
            models = {r["candidate"]: _stage_output(Path(r["run_dir"]), "dp-student") / "model" for r in group}
            tok = load_tokenizer(str(next(iter(models.values()))))
            scorers = {}
            for split, path in (("validation", data.validation), ("train", data.train)):
                spec = private_selection.PrivateValidation(path=Path(path), delta=delta, accountant=cfg.teacher.accountant,
                                                           max_length=cfg.teacher.max_length)
                scorers[split] = private_selection.setup(spec, tok, candidates=len(models), epsilon=args.epsilon,
                                                         clip=clip, limit=None)
            score = {split: {} for split in scorers}
            for name, path in models.items():
                student = load_causal_lm(str(path)).eval()
                for split, scorer in scorers.items():
                    score[split][name] = exact_score(student, scorer)
            test = {r["candidate"]: r["student"] for r in group}
            n_val, n_train = scorers["validation"].n, scorers["train"].n
            both = {c: (n_val * score["validation"][c] + n_train * score["train"][c]) / (n_val + n_train) for c in test}
            z = scorers["validation"].z
            print(f"{row} r{repeat}: test (windowed) {', '.join(f'{c} {v:.1f}' for c, v in test.items())}; "
                  f"best on test {min(test, key=test.get)}", flush=True)
            for label, scores, n in (("validation", score["validation"], n_val), ("train", score["train"], None),
                                     ("train+validation", both, n_val + n_train)):
                line = (f"  {label:>16}: exact {', '.join(f'{v:.4f}' for v in scores.values())}; "
                        f"ranks first {min(scores, key=scores.get)}")
                if n is not None:
                    sd = z * clip / n
                    p_best, regret = keeps_best(scores, sd, test, rng)
                    line += f"; at ε {args.epsilon} (n {n}, noise sd {sd:.4f}): P(keeps test-best) {p_best:.3f}, " \
                            f"expected regret {regret:.1f}"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
