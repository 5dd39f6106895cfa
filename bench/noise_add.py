"""Adding a DP step's noise on a CPU: Opacus' draw against ours, one stream and in lanes, side by side.

Every DP step adds N(0, (σC)²) noise to each trainable parameter's clipped sum. Opacus'
`_generate_noise` allocates zeros the size of the parameter, draws the noise from one
mt19937 into a second new tensor, and the optimizer adds it in a third pass; ours
(pipeline/privacy/noise.py add_gaussian_, bk's optimizer step) adds it in place, drawn 1 M
values at a time into a scratch buffer, and draws a parameter of 2^18 values or more in 4
lanes, each its own mt19937, on up to `--threads` threads. Timed on the parameter shapes of
SmolLM2-135M as the teacher trains it (lm_head untied: 162.8 M values in 273 tensors),
alternately in one process: Opacus' draw (its own, without our dispatcher), ours with one
stream (no lanes: the draw before lanes), and ours; prints the medians and their ratios to
Opacus'. Run from the repository root:

    .venv/bin/python bench/noise_add.py               # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from opacus.optimizers import optimizer as opacus_optimizer

from pipeline.privacy import noise

D, KV, MLP, VOCAB, LAYERS = 576, 192, 1536, 49152, 30  # SmolLM2-135M
LAYER = [(D, D), (KV, D), (KV, D), (D, D), (MLP, D), (MLP, D), (D, MLP), (D,), (D,)]
SHAPES = [(VOCAB, D), (VOCAB, D)] + LAYER * LAYERS + [(D,)]  # its trainable tensors, lm_head untied (bench/adamw.py too)


def timing_args(doc: str) -> argparse.Namespace:
    """--repeats and --threads, as this bench and bench/adamw.py take them; sets torch's threads."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = timing_args(__doc__)
    params = [torch.zeros(s) for s in SHAPES]
    gen = noise.generator("noise", secure=False)
    draw = opacus_optimizer._generate_noise._opacus_original  # what Opacus does with a torch.Generator

    def opacus() -> None:
        for p in params:
            p.add_(draw(std=1.0, reference=p, generator=gen))

    def in_place() -> None:
        for p in params:
            noise.add_gaussian_(p, 1.0, gen)

    def one_stream() -> None:
        lane_min, noise.LANE_MIN = noise.LANE_MIN, 2**63
        try:
            in_place()
        finally:
            noise.LANE_MIN = lane_min

    times = {"Opacus' _generate_noise, then add": [], "in place, one stream": [],
             f"in place, {noise.LANES} lanes": []}
    for _ in range(args.repeats):
        for (name, runs), fn in zip(times.items(), (opacus, one_stream, in_place)):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
    values = sum(p.numel() for p in params)
    print(f"{values / 1e6:.1f} M values in {len(params)} tensors, {args.threads} thread(s), "
          f"median of {args.repeats} (alternating)")
    medians = {name: statistics.median(runs) for name, runs in times.items()}
    for name, m in medians.items():
        print(f"  {name:36s} {m:.3f} s  (min {min(times[name]):.3f}, max {max(times[name]):.3f})")
    a, b, c = medians.values()
    print(f"vs Opacus: one stream {b / a:.2f}, lanes {c / a:.2f}; lanes / one stream {c / b:.2f}")


if __name__ == "__main__":
    main()
