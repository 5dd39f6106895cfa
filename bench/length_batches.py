"""Batches cut shortest first (issue 22) against the order records come in, side by side:
the DP teacher's physical batches, and evaluation's scoring batches.

Teacher: for each config (the demo's Yelp reviews, record-level; the airline tweets,
user-level, read from ../shared/data beside the checkout: skipped with a line saying so when it
is absent, unless `--configs airline` asks for it alone), the data stage runs once, then `train_teacher` trains
the builtin teacher on it for `--epochs` epochs at the config's batch sizes. The reference
replaces `teacher.shortest_first` by "as drawn"; nothing else differs. DP noise and sampling
come from the test-only fixed seed (pipeline/privacy/noise.py), so that both recipes draw the
same Poisson batches and the same noise: the batches differ only in how they are cut into
physical ones. Printed per run: the stage's seconds, and the tokens its physical batches
padded to (rows x the batch's longest) against the real tokens in them.

Evaluation: the builtin teacher's windowed and per-record perplexity (evaluate.perplexity) on
the shipped 500 test reviews, batch 16, window 128; the reference batches in the order the
windows come (`scoring.by_length` replaced). Printed: seconds and the perplexities (equal).

Each run in a fresh process of its own, alternating in rounds so that background load hits
both alike.

    OMP_NUM_THREADS=1 .venv/bin/python bench/length_batches.py      # ~20 min on 2 cores

Last line: `demo_x=D airline_x=A evaluation_x=E` (reference seconds over new, summed over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from public import has_airline, shared_data  # noqa: E402  bench/public.py: ../shared/data

CONFIGS = {"demo": ROOT / "configs" / "demo.yaml", "airline": ROOT / "configs" / "airline.yaml"}


def child(name: str, recipe: str, epochs: int, data: Path, out: Path) -> dict:
    """Train the teacher once in this process; its seconds and padded/real tokens."""
    from pipeline.config import load_config
    from pipeline.devices import Runtime
    from pipeline.models.base import shipped_path
    from pipeline.privacy.noise import TEST_SEED_ENV
    from pipeline.stages.teacher import recipe as teacher

    os.environ[TEST_SEED_ENV] = "1234"  # the same draws in both recipes (NOT private)
    if recipe == "reference":
        teacher.shortest_first = lambda lengths, users=None: None  # each Poisson batch as drawn
    cfg = load_config(CONFIGS[name], [f"teacher.epochs={epochs}"])
    Runtime.from_config(cfg).apply_threads()
    padded = real = 0
    step = teacher._step

    def counting(run, ids, lengths):
        nonlocal padded, real
        padded, real = padded + ids.numel(), real + int(lengths.sum())
        step(run, ids, lengths)

    teacher._step = counting
    t0 = time.perf_counter()
    teacher.train_teacher(cfg.teacher, train_path=data / "train.parquet", validation_path=data / "validation.parquet",
                          base_model=shipped_path(cfg.teacher.model), out_dir=out, seed=0)
    return {"seconds": time.perf_counter() - t0, "padded": padded, "real": real}


def evaluation_child(recipe: str) -> dict:
    """The builtin teacher's perplexity on the shipped test split in this process, and its seconds."""
    import pyarrow.csv as pcsv

    from pipeline.devices import Runtime
    from pipeline.models import scoring
    from pipeline.models.base import load_causal_lm, load_tokenizer
    from pipeline.stages import evaluate
    from pipeline.records import CODE_JOINER

    if recipe == "reference":  # batches in the order the windows come
        scoring.by_length = lambda data, b: [list(range(i, min(i + b, len(data)))) for i in range(0, len(data), b)]
    Runtime().apply_threads()
    teacher = ROOT / "pipeline" / "models" / "builtin" / "teacher"
    model, tok = load_causal_lm(str(teacher)).eval(), load_tokenizer(str(teacher))
    table = pcsv.read_csv(ROOT / "data" / "yelp_sample" / "test.csv").to_pydict()
    codes = [CODE_JOINER.join(pair) for pair in zip(table["label1"], table["label2"])]
    t0 = time.perf_counter()
    ppl = evaluate.perplexity(model, tok, codes, table["text"], 128, 16)
    return {"seconds": time.perf_counter() - t0, "windowed": ppl.windowed, "per_record": ppl.per_record_mean}


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(re.search(r"^RESULT (.*)$", out.stdout, re.M).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=("teacher", "evaluation"), default=["teacher", "evaluation"])
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="the teacher part's")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # name recipe data_dir out_dir
    ap.add_argument("--evaluation-child", help=argparse.SUPPRESS)  # recipe
    a = ap.parse_args()
    if a.child:
        name, recipe, data, out = a.child
        print("RESULT " + json.dumps(child(name, recipe, a.epochs, Path(data), Path(out))))
        return
    if a.evaluation_child:
        print("RESULT " + json.dumps(evaluation_child(a.evaluation_child)))
        return
    from pipeline.config import load_config
    from pipeline.stages.data import prepare_data

    names = list(a.configs)
    if "teacher" in a.parts and "airline" in names and not has_airline():
        if names == ["airline"]:
            shared_data("airline-tweets", "the airline tweets")  # one line, exit 2
        print("airline skipped: the tweets are not in ../shared/data beside the checkout", flush=True)
        names.remove("airline")
    ratios = {}
    if "teacher" in a.parts:
        print("| config | round | recipe | seconds | padded tokens | real tokens | padding | load |\n"
              "|---|---|---|---:|---:|---:|---:|---|")
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                data = prepare_data(load_config(CONFIGS[name]).data, Path(tmp) / name / "data")  # once: the same splits
                seconds = {"reference": 0.0, "new": 0.0}
                for r in range(a.rounds):
                    for recipe in ("reference", "new"):
                        got = _run("--epochs", str(a.epochs), "--child", name, recipe, str(data.train.parent),
                                   str(Path(tmp) / f"{name}-{recipe}-{r}"))
                        seconds[recipe] += got["seconds"]
                        print(f"| {name} | {r} | {recipe} | {got['seconds']:.1f} | {got['padded']:,} | {got['real']:,} "
                              f"| {1 - got['real'] / got['padded']:.1%} | {os.getloadavg()[0]:.2f} |", flush=True)
                ratios[name] = seconds["reference"] / seconds["new"]
    if "evaluation" in a.parts:
        print("\n| round | recipe | seconds | windowed perplexity | per-record mean | load |\n|---|---|---:|---:|---:|---|")
        seconds = {"reference": 0.0, "new": 0.0}
        for r in range(a.rounds):
            for recipe in ("reference", "new"):
                got = _run("--evaluation-child", recipe)
                seconds[recipe] += got["seconds"]
                print(f"| {r} | {recipe} | {got['seconds']:.1f} | {got['windowed']:.4f} | {got['per_record']:.4f} | "
                      f"{os.getloadavg()[0]:.2f} |", flush=True)
        ratios["evaluation"] = seconds["reference"] / seconds["new"]
    print(" ".join(f"{name}_x={ratios.get(name, float('nan')):.2f}" for name in (*CONFIGS, "evaluation")))


if __name__ == "__main__":
    main()
