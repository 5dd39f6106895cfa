"""Adding a DP step's noise on a CPU: Opacus' draw against bk's in-place one, side by side.

Every DP step adds N(0, (σC)²) noise to each trainable parameter's clipped sum. Opacus'
`_generate_noise` allocates zeros the size of the parameter, draws the noise into a second new
tensor, and the optimizer adds it in a third pass; bk's optimizer (pipeline/privacy/bk.py)
adds it in place, drawn 1 M values at a time into a scratch buffer
(pipeline/privacy/noise.py add_gaussian_): the same values from the same generator. This times
both on the parameter shapes of SmolLM2-135M as the teacher trains it (lm_head untied:
162.8 M values in 273 tensors), alternately in one process, and prints the medians and
their ratio. Run from the repository root:

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

    times = {"Opacus' _generate_noise, then add": [], "add_gaussian_ (in place)": []}
    for _ in range(args.repeats):
        for (name, runs), fn in zip(times.items(), (opacus, in_place)):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
    values = sum(p.numel() for p in params)
    print(f"{values / 1e6:.1f} M values in {len(params)} tensors, {args.threads} thread(s), "
          f"median of {args.repeats} (alternating)")
    medians = {name: statistics.median(runs) for name, runs in times.items()}
    for name, m in medians.items():
        print(f"  {name:36s} {m:.3f} s  (min {min(times[name]):.3f}, max {max(times[name]):.3f})")
    a, b = medians.values()
    print(f"in place / Opacus: {b / a:.2f}")


if __name__ == "__main__":
    main()
