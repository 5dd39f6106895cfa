"""bk's clipped sum of one linear weight with bf16 factors on a CUDA GPU: the kernel that applies each
example's factor inside one product (pipeline/privacy/bk_kernel.py) against the split's two bf16
products and their elementwise passes (what bk ran before), and against one plain bf16 product of
the same operands without any factor (what a non-private step's weight gradient costs: the floor).
Every linear shape of SmolLM2-135M (576 wide, MLP 1,536, 3 of 9 heads' width for k and v, the
49,152-token head), random bf16 factors, C from U(0, 1) per example. Prints, per shape, the median
time of each path over --repeats calls after 3 warm-up calls (autotuning included there), the
ratios, and each path's error against float64 (relative Frobenius); then which candidate the
autotuner chose per shape. Needs a GPU with Triton:

    bash bench/device_run.sh python3 bench/bk_kernel.py --batch 512 --seq 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [("q_proj, o_proj", 576, 576), ("k_proj, v_proj", 576, 192), ("gate_proj, up_proj", 576, 1536),
          ("down_proj", 1536, 576), ("lm_head", 576, 49152)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()

    import torch

    from pipeline.privacy import bk_kernel, bk_layers

    torch.manual_seed(0)
    dev = torch.device("cuda")

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(a.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    assert bk_kernel._runs_on(dev)  # every candidate checked on the device
    print(f"{a.batch} x {a.seq} tokens, {torch.cuda.get_device_name()}, median of {a.repeats} calls")
    print("| layer | d → p | plain bf16 product (ms) | split (ms) | kernel (ms) | kernel / plain | kernel / split "
          "| split error | kernel error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    total = [0.0, 0.0, 0.0]
    for name, d, p_ in SHAPES:
        x = torch.randn(a.batch, a.seq, d, device=dev).bfloat16()  # the layer's input a
        g = (torch.randn(a.batch, a.seq, p_, device=dev) * 1e-3).bfloat16()  # its output gradient
        coef = torch.rand(a.batch, device=dev)
        bk_kernel.USE = False
        split_use = bk_layers._MatmulUse(x, g, transposed=False, flat=False)
        bk_kernel.USE = True
        kernel_use = bk_layers._MatmulUse(x, g, transposed=False, flat=False)
        assert split_use.split and kernel_use.kernel
        g2, x2 = g.reshape(-1, p_), x.reshape(-1, d)
        rows = [timed(lambda: bk_layers._mm32(g2.t(), x2)), timed(lambda: split_use.weighted_sum(coef)),
                timed(lambda: kernel_use.weighted_sum(coef))]
        want = sum(torch.einsum("b,btp,btd->pd", coef[i:i + 32].double(), g[i:i + 32].double(), x[i:i + 32].double())
                   for i in range(0, a.batch, 32))  # float64, 32 examples at a time
        def error(use) -> float:
            return ((use.weighted_sum(coef).double() - want).norm() / want.norm()).item()
        err = [error(split_use), error(kernel_use)]
        # a step: 30 layers' 7 linear maps (two of each shape where the row names two) and the head once
        total = [t + r * (1 if name == "lm_head" else 30 * (2 if "," in name else 1)) for t, r in zip(total, rows)]
        print(f"| {name} | {d} → {p_} | {rows[0] * 1e3:.2f} | {rows[1] * 1e3:.2f} | {rows[2] * 1e3:.2f} "
              f"| {rows[2] / rows[0]:.2f} | {rows[2] / rows[1]:.2f} | {err[0]:.1e} | {err[1]:.1e} |")
        del x, g, g2, x2, split_use, kernel_use, want
        torch.cuda.empty_cache()
    print("autotuned: (M, N, ...) -> config:", {k: str(v) for k, v in bk_kernel._tuned.cache.items()})
    print(f"a step's clipped sums (30 layers' 7 linear maps, the head once; ms): plain {total[0] * 1e3:.1f}, "
          f"split {total[1] * 1e3:.1f}, kernel {total[2] * 1e3:.1f}")


if __name__ == "__main__":
    main()
