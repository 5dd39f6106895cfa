"""Compile bk's Triton kernel (pipeline/privacy/bk_kernel.py) for an H100/H200 (sm_90) without a GPU
and say whether its loop keeps a matrix product in flight. Triton's Hopper path issues each block's
product asynchronously (wgmma) and waits for it before the product's first use; a plain chained
product (acc = dot(x, y, acc)) waits with one product pending, so the next block's product runs
meanwhile; bk's kernel uses each product at once (acc += c·dot), so it waits with none pending.
Prints, for each, the loads' kind (cp.async: pipelined) and each wait's `pendings`. Needs Triton
(CUDA builds of torch bring it; on a CPU machine `pip install triton` into a folder of its own):

    PYTHONPATH=<folder with triton> .venv/bin/python bench/bk_kernel_ptx.py
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pipeline.privacy import bk_kernel  # noqa: E402


@triton.jit
def chained(X, Y, C, OUT, M, N, T, B, per_split, sxk, sxm, syk, syn,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """bk's kernel without the factor: the same loads, the products chained into one accumulator."""
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok, n_ok = rm < M, rn < N
    cols_x, cols_y = rm.to(tl.int64) * sxm, rn.to(tl.int64) * syn
    blocks = tl.cdiv(T, BK)
    first = pid_s * per_split
    last = tl.minimum(first + per_split, B)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(first * blocks, last * blocks):
        e = i // blocks
        rt = (i - e * blocks) * BK + tl.arange(0, BK)
        rows = (e * T + rt).to(tl.int64)
        k_ok = rt < T
        x = tl.load(X + rows[:, None] * sxk + cols_x[None, :], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        y = tl.load(Y + rows[:, None] * syk + cols_y[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(x), y, acc)
    out = OUT + (pid_s.to(tl.int64) * M + rm.to(tl.int64)[:, None]) * N + rn[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


def main() -> None:
    signature = {"X": "*bf16", "Y": "*bf16", "C": "*fp32", "OUT": "*fp32", "M": "i32", "N": "i32", "T": "i32",
                 "B": "i32", "per_split": "i32", "sxk": "i32", "sxm": "i32", "syk": "i32", "syn": "i32",
                 "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    # as a launch specializes them: 16-byte aligned pointers, sizes and row strides divisible by 16, unit column strides
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 9, 11)}
    print(f"Triton {triton.__version__}, sm_90, blocks 128 x 128 x 64, 8 warps, 3 stages")
    for name, fn in [("bk's kernel (acc += c * dot)", bk_kernel._scaled_sum_kernel), ("chained, no factor", chained)]:
        constexprs = {"BM": 128, "BN": 128, "BK": 64, "sxm": 1, "syn": 1}
        src = ASTSource(fn=fn, signature=signature, attrs=attrs, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
        ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
        waits = re.findall(r"warp_group_dot_wait[^{]*\{pendings = (\d+)", ttgir)
        print(f"{name}: {ptx.count('wgmma.mma_async')} wgmma a block, {ptx.count('cp.async.cg')} cp.async loads, "
              f"waits with pendings {', '.join(waits)}")


if __name__ == "__main__":
    main()
