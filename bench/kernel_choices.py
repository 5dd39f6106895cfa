"""(Not `kernels.py`: transformers imports a module of that name when it finds one.)
Two kernel choices of 2026-11-24, each reverted on its own against the tree as it is, on the
demo's shapes, side by side in one run:

  gelu_new     GPT-2's tanh GELU as transformers writes it (five elementwise ops) instead of
               torch's fused kernel of the same formula (`models.base.fused_gelu`)
  sliced_nll   the next-token NLL on `logits[:, :-1]` (a non-contiguous view, so flattening it
               copied the logits, and in training their gradient) instead of whole rows with an
               IGNORE label last (`models.losses.next_token_nll`)

    .venv/bin/python bench/kernel_choices.py [--rounds 6] [--threads N] [--config configs/demo.yaml]

Each part is the stage's own step as `dpdistill plan` times it (pipeline/timing.py: the
fastest of 3 calls, random weights and ids): the teacher's DP step (Opacus, the run's clipping
mode) on one physical batch at max_length, a distillation step (student forward+backward with
the teacher's forward), a generation batch (the fast engine, the run's rows) and an evaluation
batch (the teacher's forward and NLL, `scoring.nll_by_owner`). Rounds rotate the recipes, each
with models built afresh, after one warm-up round of each that is not counted. Ends with one
line per reverted choice, `gelu_new: teacher_x=... distill_x=... generation_x=... evaluation_x=...`:
its median seconds over the tree's, over the rounds (> 1: the tree's choice is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F  # noqa: E402
from transformers.activations import GELUTanh, NewGELUActivation  # noqa: E402

import pipeline.models.scoring  # noqa: E402
import pipeline.models.losses  # noqa: E402
from pipeline.batching import IGNORE  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.devices import Runtime  # noqa: E402
from pipeline.timing import StepTimer  # noqa: E402

RECIPES = ("tree", "gelu_new", "sliced_nll")
USERS_OF_NLL = (pipeline.models.losses, pipeline.models.scoring)  # the modules whose NLL the parts run


def _unfused(model) -> None:
    """Back to transformers' own `gelu_new` modules (what a model loads as without fused_gelu)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is GELUTanh:
                setattr(parent, name, NewGELUActivation())


def _sliced_nll(logits, labels):
    """The NLL as computed before `next_token_nll`: on the `[:, :-1]` view, flattened (a copy)."""
    logits = logits[:, :-1].float()  # (B, L-1, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                           reduction="none").view(labels.shape)


def _parts(cfg, recipe: str) -> dict[str, float]:
    nll = {m: m.next_token_nll for m in USERS_OF_NLL}
    if recipe == "sliced_nll":
        for m in USERS_OF_NLL:
            m.next_token_nll = _sliced_nll
    try:
        return _timed(cfg, recipe)
    finally:
        for m, fn in nll.items():
            m.next_token_nll = fn


def _timed(cfg, recipe: str) -> dict[str, float]:
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
        "evaluation": timer.score(teacher, e.batch_size, e.window),
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
    times = {r: {} for r in RECIPES}  # recipe -> part -> seconds of each round
    print("| round | recipe | teacher s | distill s | generation s | evaluation s | load |\n|---|---|---|---|---|---|---|")
    for recipe in RECIPES:  # warm-up: allocator, lazy imports, first builds
        _parts(cfg, recipe)
    for r in range(args.rounds):
        for recipe in RECIPES[r % 3:] + RECIPES[:r % 3]:
            parts = _parts(cfg, recipe)
            for k, v in parts.items():
                times[recipe].setdefault(k, []).append(v)
            print(f"| {r} | {recipe} | " + " | ".join(f"{parts[k]:.4f}" for k in parts)
                  + f" | {os.getloadavg()[0]:.1f} |", flush=True)
    tree = {k: statistics.median(v) for k, v in times["tree"].items()}
    for recipe in RECIPES[1:]:
        print(f"{recipe}: " + " ".join(f"{k}_x={statistics.median(v) / tree[k]:.3f}" for k, v in times[recipe].items()))


if __name__ == "__main__":
    main()
