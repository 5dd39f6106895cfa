"""What glibc's malloc costs the stages (issue 22): each stage's work with the C allocator as
glibc sets it ("system": blocks over 32 MB mmap'd fresh and unmapped when freed, so every large
tensor page-faults its memory in anew) against `pipeline.devices.reuse_freed_memory` ("reuse":
freed memory kept for the next allocation; what every stage sets since 2026-11-24, through
`Runtime.apply_threads`).

Every measurement runs in a fresh process of its own (the allocator's setting is per process
and one-way), one torch thread, alternating system and reuse in rounds so that background load
hits both alike:

  distillation  the demo's two candidates (α = 0.4, 1) stepped together on 256 synthetic samples
                of the builtin teacher (1 epoch, batch 16): training seconds
  evaluation    the builtin teacher's windowed and per-record perplexity on the first 200 shipped
                test reviews (data/yelp_sample/test.csv)
  generation    128 samples of the builtin teacher with the fast engine (batch 64, ≤ 128 tokens)
  teacher       bench/teacher_modes.py at the demo teacher's shape (4 × 256, vocabulary 8,192,
                32 × 128 tokens): the median bk step and the non-private step, and their ratio

Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python bench/allocator.py        # ~12 min on 2 cores

The last line reads `distillation_x=D evaluation_x=E generation_x=G teacher_bk_x=T
teacher_ratio_system=R1 teacher_ratio_reuse=R2` (x: system seconds over reuse seconds, medians).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEACHER = ROOT / "pipeline" / "models" / "builtin" / "teacher"
STUDENT = ROOT / "pipeline" / "models" / "builtin" / "student"
CODES = {f"Business Category: {c}\tReview Stars: {s}.0": 1 for c in ("Restaurants", "Bars", "Shopping") for s in (1, 3, 5)}
PARTS = ("distillation", "evaluation", "generation")


def child(part: str, allocator: str, tmp: Path) -> float:
    """Seconds of one part's work in this process, with the allocator as asked."""
    import pipeline.devices as devices

    if allocator == "system":
        devices.reuse_freed_memory = lambda: False  # apply_threads then leaves glibc as it is
    devices.Runtime().apply_threads()
    from pipeline.config import DistillConfig, GenerateConfig
    from pipeline.stages.generate import generate_synthetic

    if part == "generation":
        t0 = time.perf_counter()
        generate_synthetic(GenerateConfig(num_samples=128, batch_size=64, max_length=128, validation_fraction=0.1),
                           teacher_dir=TEACHER, control_codes_path=tmp / "codes.json", ledger=[],
                           out_dir=tmp / f"gen-{allocator}-{time.time_ns()}", seed=0)
        return time.perf_counter() - t0
    if part == "distillation":
        from pipeline.stages.distill import distill

        out = tmp / f"distill-{allocator}-{time.time_ns()}"
        distill(DistillConfig(candidates=[{"alpha": 0.4}, {"alpha": 1.0}], epochs=1, batch_size=16, learning_rate=3e-3,
                              eval_every=10_000, log_every=10_000, selection_samples=8),
                synthetic_path=tmp / "synthetic", teacher_dir=TEACHER, student_model=str(STUDENT), out_dir=out, seed=0)
        return json.loads((out / "training_log.json").read_text())["seconds"]
    import pyarrow.csv as pcsv
    import torch

    from pipeline.models.base import load_causal_lm, load_tokenizer
    from pipeline.records import CODE_JOINER
    from pipeline.stages.evaluate import perplexity

    table = pcsv.read_csv(ROOT / "data" / "yelp_sample" / "test.csv").slice(0, 200)
    codes = [CODE_JOINER.join(p) for p in zip(table["label1"].to_pylist(), table["label2"].to_pylist())]
    model, tok = load_causal_lm(str(TEACHER), dtype=torch.float32).eval(), load_tokenizer(str(TEACHER))
    t0 = time.perf_counter()
    with torch.inference_mode():
        perplexity(model, tok, codes, table["text"].to_pylist(), 128, 16)
    return time.perf_counter() - t0


def _run_child(part: str, allocator: str, tmp: Path) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", part, "--allocator", allocator, "--tmp", str(tmp)],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"SECONDS ([0-9.]+)", out).group(1))


def _teacher(allocator: str) -> tuple[float, float]:
    """(bk step, non-private step) medians from bench/teacher_modes.py at the demo teacher's shape (its JSON line)."""
    shape = ["--layers", "4", "--width", "256", "--heads", "8", "--vocab", "8192", "--seq", "128", "--batch", "32"]
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "teacher_modes.py"), *shape, "--steps", "6",
                          "--modes", "nonprivate", "full-bk", "--allocator", allocator],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = {r["mode"]: r for r in json.loads(re.search(r"^JSON (.*)$", out, re.M).group(1))}
    return rows["full-bk"]["step_s"], rows["nonprivate"]["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", nargs="+", choices=(*PARTS, "teacher"), default=[*PARTS, "teacher"])
    ap.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--allocator", choices=("system", "reuse"), help=argparse.SUPPRESS)
    ap.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(f"SECONDS {child(args.child, args.allocator, args.tmp):.4f}")
        return
    got: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "codes.json").write_text(json.dumps({"counts": CODES}))
        if "distillation" in args.parts:
            from pipeline.config import GenerateConfig
            from pipeline.stages.generate import generate_synthetic

            generate_synthetic(GenerateConfig(num_samples=284, batch_size=64, max_length=128, validation_fraction=0.1),
                               teacher_dir=TEACHER, control_codes_path=tmp / "codes.json", ledger=[],
                               out_dir=tmp / "synthetic", seed=0)
        print("| round | part | allocator | seconds |\n|---|---|---|---:|", flush=True)
        for r in range(args.rounds):
            for part in args.parts:
                for allocator in ("system", "reuse") if r % 2 == 0 else ("reuse", "system"):
                    if part == "teacher":
                        bk, plain = _teacher(allocator)
                        got.setdefault("teacher_bk", {}).setdefault(allocator, []).append(bk)
                        got.setdefault("teacher_plain", {}).setdefault(allocator, []).append(plain)
                        print(f"| {r} | teacher bk step | {allocator} | {bk:.3f} |\n"
                              f"| {r} | teacher non-private step | {allocator} | {plain:.3f} |", flush=True)
                        continue
                    seconds = _run_child(part, allocator, tmp)
                    got.setdefault(part, {}).setdefault(allocator, []).append(seconds)
                    print(f"| {r} | {part} | {allocator} | {seconds:.2f} |", flush=True)
    med = {k: {a: statistics.median(v) for a, v in d.items()} for k, d in got.items()}
    x = {k: d["system"] / d["reuse"] for k, d in med.items()}
    nan = float("nan")
    ratio = {a: med["teacher_bk"][a] / med["teacher_plain"][a] for a in ("system", "reuse")} if "teacher_bk" in med else {}
    print(f"distillation_x={x.get('distillation', nan):.2f} evaluation_x={x.get('evaluation', nan):.2f} "
          f"generation_x={x.get('generation', nan):.2f} teacher_bk_x={x.get('teacher_bk', nan):.2f} "
          f"teacher_ratio_system={ratio.get('system', nan):.2f} teacher_ratio_reuse={ratio.get('reuse', nan):.2f}")


if __name__ == "__main__":
    main()
