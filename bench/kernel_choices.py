"""GPT-2's tanh GELU as transformers writes it (`gelu_new`: five elementwise ops) against
torch's fused kernel of the same formula (`GELUTanh`, what `models.base.fused_gelu` loads),
on the demo's shapes, side by side in one run.

    .venv/bin/python bench/activation.py [--rounds 6] [--config configs/demo.yaml]

Each part is the stage's own step as `dpdistill plan` times it (pipeline/timing.py: the
fastest of 3 calls, random weights and ids): the teacher's DP step (Opacus, the run's clipping
mode) on one physical batch at max_length, a distillation step (student forward+backward with
the teacher's forward), a generation batch (the fast engine, the run's rows) and an evaluation
batch (the teacher's forward). Rounds alternate the two recipes, each with models built afresh,
after one warm-up round of each that is not counted.
Ends with `teacher_x=... distill_x=... generation_x=... evaluation_x=...`: gelu_new's seconds
over the fused kernel's, summed over rounds (> 1: the fused kernel is faster).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.activations import GELUTanh, NewGELUActivation  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.devices import Runtime  # noqa: E402
from pipeline.timing import StepTimer  # noqa: E402

RECIPES = ("fused", "gelu_new")


def _unfused(model) -> None:
    """Back to transformers' own `gelu_new` modules (what a model loads as without fused_gelu)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is GELUTanh:
                setattr(parent, name, NewGELUActivation())


def _parts(cfg, recipe: str) -> dict[str, float]:
    timer = StepTimer(cfg, Runtime.from_config(cfg))
    teacher, student = cfg.teacher.model, cfg.distill.student_model
    if recipe == "gelu_new":
        for name in (teacher, student):
            _unfused(timer.model(name))
            _unfused(timer.model(name, inference=True))
    t, g, e = cfg.teacher, cfg.generate, cfg.evaluate
    prompt = 16
    return {
        "teacher": timer.teacher_step(teacher, t.physical_batch_size, t.max_length),
        "distill": timer.distill_step(student, teacher, [g.max_length] * cfg.distill.batch_size, prompt),
        "generation": timer.generate_batch(teacher, g.batch_size, prompt, 64),
        "evaluation": timer.forward(teacher, e.batch_size, e.window),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--threads", type=int, help="torch threads (default: the config's)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.threads:
        cfg = cfg.model_copy(update={"threads": args.threads})
    totals = {r: {} for r in RECIPES}
    print("| round | recipe | teacher s | distill s | generation s | evaluation s | load |\n|---|---|---|---|---|---|---|")
    for recipe in RECIPES:  # warm-up: allocator, lazy imports, first builds
        _parts(cfg, recipe)
    for r in range(args.rounds):
        for recipe in RECIPES if r % 2 == 0 else RECIPES[::-1]:
            parts = _parts(cfg, recipe)
            for k, v in parts.items():
                totals[recipe][k] = totals[recipe].get(k, 0.0) + v
            print(f"| {r} | {recipe} | " + " | ".join(f"{parts[k]:.4f}" for k in parts)
                  + f" | {os.getloadavg()[0]:.1f} |", flush=True)
    print(" ".join(f"{k}_x={totals['gelu_new'][k] / totals['fused'][k]:.3f}" for k in totals["fused"]))


if __name__ == "__main__":
    main()
