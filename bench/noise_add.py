"""A DP step's tail on a CPU: Opacus' accumulate, noise and mean against bk's one pass, side by side.

Every DP step adds the last physical batch's clipped sum to the step's, adds N(0, (σC)²) noise
to each trainable parameter's sum and divides by the expected batch size. Opacus does that in
three passes over the gradient (`accumulate`, `add_noise`, `scale_grad`), and its
`_generate_noise` allocates zeros the size of the parameter and draws the noise into a second
new tensor, which `add_noise` adds into a third; bk's optimizer (pipeline/privacy/bk.py
_InPlaceNoise) does all three in one pass, the noise drawn 1 M values at a time into a scratch
buffer (pipeline/privacy/noise.py add_gaussian_ with `plus` and `divisor`): the same values
from the same generator. This times both, and between them the noise added in place with the
other two passes apart (bk's step until the fusion), on the parameter shapes of SmolLM2-135M as the
teacher trains it (lm_head untied: 162.8 M values in 273 tensors), alternately in one
process, and prints the medians and their ratio. Run from the repository root:

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = [torch.zeros(s) for s in [(VOCAB, D), (VOCAB, D)] + LAYER * LAYERS + [(D,)]]
    last = [torch.ones_like(p) for p in params]  # the last physical batch's clipped sum
    gen = noise.generator("noise", secure=False)
    draw = opacus_optimizer._generate_noise._opacus_original  # what Opacus does with a torch.Generator
    batch = 64

    def opacus() -> None:
        for p, g in zip(params, last):
            p.add_(g)  # accumulate
            grad = p + draw(std=1.0, reference=p, generator=gen)  # add_noise
            grad /= batch  # scale_grad

    def three_passes() -> None:  # bk's step before the fusion: noise in place, the other two apart
        for p, g in zip(params, last):
            p.add_(g)
            noise.add_gaussian_(p, 1.0, gen)
            p.div_(batch)

    def fused() -> None:
        for p, g in zip(params, last):
            noise.add_gaussian_(p, 1.0, gen, g, batch)

    times = {"Opacus: accumulate, noise, scale": [], "noise in place, three passes": [],
             "bk: one pass (add_gaussian_)": []}
    for _ in range(args.repeats):
        for (name, runs), fn in zip(times.items(), (opacus, three_passes, fused)):
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
    print(f"one pass / Opacus: {c / a:.2f}   one pass / three passes: {c / b:.2f}")


if __name__ == "__main__":
    main()
