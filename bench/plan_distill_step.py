"""The plan's distillation step against the stage's own, on one run's synthetic samples.

`dpdistill plan` prices distillation with `StepTimer.distill_step` on a typical batch of the
samples' expected lengths (pipeline/timing.py). This bench takes a finished run, builds that
typical batch from the run's *real* synthetic train lengths, and times, in one process, one
thread, alternating so that the machine's drift hits both alike:

  plan    `StepTimer.distill_step` on the full typical batch (no probe scaling), 10 calls
  stage   `distill()` itself on the run's shards (one candidate, α of the config's first),
          the seconds between its progress records, `--steps` steps

Run from the repository root, on a finished run whose config uses the shipped models (the
demo's, airline's):

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_distill_step.py RUN_DIR    # ~3 min

It prints each round's medians and a last line `plan_over_stage=R` (the median of the rounds'
ratios). The run directory is only read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.devices import Runtime  # noqa: E402
from pipeline.models.base import shipped_path  # noqa: E402
from pipeline.plan_time import _typical_lengths  # noqa: E402
from pipeline.stages.distill import distill  # noqa: E402
from pipeline.stages.generate import read_synthetic  # noqa: E402
from pipeline.timing import StepTimer  # noqa: E402


def plan_step(cfg, runtime: Runtime, lengths: list[int], prompt: int, calls: int) -> float:
    """Median seconds of the plan's distillation step on the full typical batch."""
    timer = StepTimer(cfg, runtime, repeats=calls)
    seconds: list[float] = []

    def each(fn) -> float:
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
        return min(seconds)
    timer._fastest = each
    timer._scaled = lambda seconds_of, batch: seconds_of(batch)  # the whole batch, no probe
    timer.distill_step(cfg.distill.student_model, cfg.teacher.model, lengths, prompt)
    return statistics.median(seconds)


def stage_step(cfg, runtime: Runtime, run: Path, steps: int) -> float:
    """Median seconds between the distillation stage's progress records, `steps` steps."""
    d = cfg.distill.model_copy(update={"epochs": 1, "num_synthetic": steps * cfg.distill.batch_size,
                                       "candidates": [], "eval_every": 10 ** 6})
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        distill(d, synthetic_path=run / "synthetic", teacher_dir=run / "teacher" / "model",
                student_model=shipped_path(cfg.distill.student_model), out_dir=Path(tmp), seed=cfg.seed, runtime=runtime,
                on_progress=lambda record: stamps.append(time.perf_counter()))
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a finished run directory (its synthetic/ and teacher/model)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cfg = load_config(str(args.run / "config.yaml"))
    train = read_synthetic(args.run / "synthetic", "train")
    lengths = [len(ids) for ids in train.column("token_ids").to_pylist()]
    prompt = round(statistics.mean(train.column("n_prompt_tokens").to_pylist()))
    batch = _typical_lengths(lengths, cfg.distill.batch_size, cfg.generate.max_length)
    runtime = Runtime(torch.device("cpu"), "fp32", 1)
    print(f"{len(lengths)} synthetic train samples, mean {statistics.mean(lengths):.1f} tokens; "
          f"typical batch mean {statistics.mean(batch):.1f}; prompt {prompt}; one thread")
    ratios = []
    for r in range(args.rounds):
        parts = [("plan", lambda: plan_step(cfg, runtime, batch, prompt, args.calls)),
                 ("stage", lambda: stage_step(cfg, runtime, args.run, args.steps))]
        got = {name: fn() for name, fn in (parts if r % 2 == 0 else parts[::-1])}
        ratios.append(got["plan"] / got["stage"])
        print(f"round {r}: plan {got['plan']:.3f} s, stage {got['stage']:.3f} s a step (medians), "
              f"ratio {ratios[-1]:.2f}")
    print(f"plan_over_stage={statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
