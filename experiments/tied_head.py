"""What keeping the output head tied to the input embedding does to the DP teacher (issue 35):
the test perplexity of DP teachers trained with `teacher.untie_lm_head=true` (the default: the head
untied, +V·d noised coordinates) and `false` (one shared weight, clipped over both of its uses).

Give finished teacher stages of runs of one config under one run root (the same secret split key,
so the same training records), made e.g. by

    dpdistill run --config configs/smollm2_yelp.yaml run_root=runs/timing/yelp
    dpdistill run --config configs/smollm2_yelp.yaml run_root=runs/timing/yelp teacher.untie_lm_head=false

(the second may be stopped once its teacher stage is done), then

    OMP_NUM_THREADS=2 .venv/bin/python experiments/tied_head.py runs/timing/yelp/smollm2-yelp-*/

Each teacher is scored by the evaluation stage's own `perplexity` on the config's test split, which
this script rebuilds from the config (the data stage's own `prepare_data`, as
experiments/private_selection.py does; with `data.test_path` the test split is that file's first
records whatever the split key, so a dummy key serves): windowed, per-record token-weighted, and
the windowed figure on the text alone. A config without `data.test_path` is refused (its test
split is drawn by the run root's secret key). Test-split figures of a benchmark corpus, like the
studies' (README, "Not protected"). The SmolLM2 configs read ../shared/data beside the checkout
(not shipped); without it, one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.shared import require_data  # noqa: E402  the data in ../shared
from pipeline.config import load_config  # noqa: E402
from pipeline.stages.data import prepare_data  # noqa: E402
from pipeline.stages.evaluate import evaluate_models  # noqa: E402


def score(run: Path) -> dict:
    cfg = load_config(str(run / "config.yaml"))
    require_data(cfg, "experiments/tied_head.py", str(run / "config.yaml"))
    if cfg.data.test_path is None:
        raise SystemExit(f"{run}: data.test_path is not set, so its test split is private; not scored here")
    stages = json.loads((run / "stages.json").read_text())
    teacher = stages.get("teacher", {})
    if teacher.get("status") not in ("ran", "forced", "cached"):
        raise SystemExit(f"{run}: its teacher stage is not finished ({teacher.get('status')}); nothing to score")
    manifest = json.loads((Path(teacher["output"]) / "manifest.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        # the key splits train from validation only: with data.test_path the test split is that file's records
        data = prepare_data(cfg.data, Path(tmp) / "data", cfg.control_codes.domain, key=bytes(32))
        metrics = evaluate_models(cfg.evaluate, models={"dp_teacher": str(Path(teacher["output"]) / "model")},
                                  test_path=data.test, out_dir=Path(tmp) / "evaluation", seed=cfg.seed)
    ppl = metrics["perplexity"]["dp_teacher"]
    return {"run": run.name, "untie_lm_head": cfg.teacher.untie_lm_head, "epsilon": teacher["epsilon"],
            "seconds": teacher["seconds"], "untied_parameters": manifest["ledger"].get("untied_parameters", 0),
            "windowed": ppl["windowed"], "token_weighted": ppl["per_record_token_weighted"],
            "text_windowed": ppl["text_only"]["windowed"], "test_records": metrics["test_records"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories whose teacher stage finished")
    args = p.parse_args()
    rows = [score(run) for run in args.runs]
    print("| run | head | teacher ε | teacher s | windowed | per record, token-weighted | text alone, windowed |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        head = ("tied, clipped over both uses" if not r["untie_lm_head"] else
                "untied (+{:,} parameters)".format(r["untied_parameters"]) if r["untied_parameters"] else
                "not tied in the model")
        print(f"| {r['run']} | {head} | {r['epsilon']:.3f} | {r['seconds']:.0f} | {r['windowed']:.2f} | "
              f"{r['token_weighted']:.2f} | {r['text_windowed']:.2f} |")
    for r in rows:
        print(f"tied_head run={r['run']} untie_lm_head={str(r['untie_lm_head']).lower()} windowed={r['windowed']:.2f} "
              f"token_weighted={r['token_weighted']:.2f} text_windowed={r['text_windowed']:.2f}")


if __name__ == "__main__":
    main()
