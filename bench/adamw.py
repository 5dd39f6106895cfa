"""The optimizer step on a CPU: torch's AdamW as it was (a loop of elementwise passes per parameter),
its foreach form, and the fused form every training stage now uses (pipeline/devices.py adamw),
side by side.

An AdamW step reads and writes each parameter, its gradient and two moments in a dozen passes
(the moments' lerp and multiply-add, a square root, a division, the weight decay, the update);
the fused form makes one. The step is the same for a private and a non-private teacher, so it
lowers both; at SmolLM2's 163 M trainable parameters it was a tenth of a non-private step on
these CPUs. This times the three forms on the parameter shapes of SmolLM2-135M as the teacher
trains it (lm_head untied: 162.8 M values in 273 tensors), with gradients of the noise's scale,
alternately in one process, prints the medians and their ratios and checks that the fused
form's weights match the loop's to float rounding. Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python bench/adamw.py --threads 1      # ~1 min
"""

from __future__ import annotations

import statistics
import time

import torch

from noise_add import SHAPES, timing_args  # SmolLM2-135M's trainable tensors (bench/ is this script's first path entry)

from pipeline.devices import adamw


def main() -> None:
    args = timing_args(__doc__)
    gen = torch.Generator().manual_seed(0)
    forms = {"loop (torch's default on a CPU)": {"foreach": False}, "foreach": {"foreach": True}, "fused": None}
    params, optimizers = {}, {}
    for name, kind in forms.items():
        params[name] = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        optimizers[name] = (adamw(params[name], 1e-4) if kind is None
                            else torch.optim.AdamW(params[name], lr=1e-4, weight_decay=0.01, **kind))
    assert optimizers["fused"].defaults["fused"]
    times = {name: [] for name in forms}
    for _ in range(args.repeats + 1):  # the first step of each creates its moments: not timed
        grads = [torch.randn(s, generator=gen) * 0.1 for s in SHAPES]
        for name in forms:
            for p, g in zip(params[name], grads):
                p.grad = g.clone()
            start = time.perf_counter()
            optimizers[name].step()
            times[name].append(time.perf_counter() - start)
    print(f"{sum(p.numel() for p in params['fused']) / 1e6:.1f} M values in {len(SHAPES)} tensors, "
          f"{args.threads} thread(s), median of {args.repeats} steps after the first (alternating)")
    medians = {name: statistics.median(runs[1:]) for name, runs in times.items()}
    for name, m in medians.items():
        print(f"  {name:32s} {m:.3f} s  (min {min(times[name][1:]):.3f}, max {max(times[name][1:]):.3f})")
    drift = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(params["loop (torch's default on a CPU)"], params["fused"]))
    loop, foreach, fused = medians.values()
    print(f"fused / loop: {fused / loop:.2f}   foreach / loop: {foreach / loop:.2f}   "
          f"largest relative difference of the weights, fused against loop: {drift:.1e}")


if __name__ == "__main__":
    main()
