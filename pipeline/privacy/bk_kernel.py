"""bk's clipped sum of bf16 factors on a CUDA GPU as ONE matrix product (Triton), with no split.

The clipped sum of a linear weight is Xᵀ·diag(c)·Y over the B·T rows of the batch, where every
row of example i carries that example's clipping factor cᵢ (fp32). cuBLAS cannot apply a factor
along the contraction axis inside its product, so bk scaled one factor first; cᵢ·x is not a
bf16 value, hence the split into two bf16 terms, two products and the split's bound
(pipeline/privacy/bk.py, point 3). This kernel applies cᵢ after the product instead: each block
of rows it multiplies belongs to one example (blocks never straddle two: an example's T rows
are covered by ⌈T/BK⌉ blocks, the last one masked), so the block's product of the bf16 values,
exact per product with fp32 sums on the 16-bit units, is multiplied by that example's cᵢ in fp32
and added to the fp32 sum. The result is Σᵢ cᵢ·Xᵢᵀ·Yᵢ to fp32 rounding, as with fp32 factors on
a CPU: no split, none of its bound on the norms, one product (on an H200 2.2-2.4x the time of
cuBLAS's plain product of the same operands, where the split took 2.3-7x: bench/bk_kernel.py).

The batch is cut into S groups of examples (split-K) when the output has fewer tiles than twice
the GPU's multiprocessors; each group writes its own fp32 partial sum, added up afterwards in a
fixed order, so the result does not depend on scheduling. Triton ships with CUDA builds of
torch; without it, off CUDA, or where it cannot build (`_runs_on`), `available` is False and bk
keeps the split.
"""

from __future__ import annotations

import functools
import logging

import torch

try:  # in CUDA builds of torch; not in the CPU wheel
    import triton
    import triton.language as tl
except ImportError:
    triton = None

USE = True  # False: bk keeps the split on a GPU too (bench/teacher_modes.py's full-bk-split)
log = logging.getLogger(__name__)


def available(t: torch.Tensor) -> bool:
    return USE and t.is_cuda and triton is not None and _runs_on(t.device)


# The autotuner's candidates (BM, BN, BK, warps, stages), keyed per output shape. On an H200 at
# SmolLM2's shapes the first, second and fourth won (bench/bk_kernel.py). Two variants never won
# there and were dropped (docs/benchmarks.md): an accumulator per example in a loop of its own, and
# an example's blocks chained into one accumulator scaled once at its last block (which keeps a
# product in flight in sm_90 code, bench/bk_kernel_ptx.py, yet the step took the same time).
CONFIGS = [(64, 128, 64, 4, 3), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 32, 4, 4),
           (128, 64, 64, 4, 3), (128, 256, 64, 8, 3), (128, 64, 128, 4, 3)]


def _launch_options(config: tuple) -> dict:
    bm, bn, bk, warps, stages = config
    return dict(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)


_CHECK_DTYPE = torch.bfloat16  # the factors' dtype; fp16 under Triton's interpreter, whose numpy has no bf16


@functools.cache
def _runs_on(device: torch.device) -> bool:
    """Whether the kernel builds and sums right on this device, tried once per process for every
    candidate the autotuner may choose, on a sum known exactly: small integers in bf16, factors
    that are powers of two, a length no block divides. Triton compiles a launcher with the
    system's C compiler and Python headers at its first launch, which a CUDA runtime image may
    lack, and a compiler can get a configuration wrong on a new GPU. A candidate that fails is
    dropped; if none is left, bk keeps the split (its bound keeps every example within C). Either
    is said once."""
    b, t, m, n = 3, 37, 40, 72
    x = (torch.arange(b * t * m) % 7 - 3).reshape(b, t, m).double()  # -3..3: exact in bf16
    y = (torch.arange(b * t * n) % 5 - 2).reshape(b, t, n).double()
    coef = torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64)
    want = torch.einsum("b,btm,btn->mn", coef, x, y)  # every partial sum an exact fp32 value
    args = (x.to(device, _CHECK_DTYPE), y.to(device, _CHECK_DTYPE), coef.float().to(device))
    failed, unfit = {}, set()
    for config in CONFIGS:
        try:
            if not torch.equal(scaled_sum(*args, blocks=_launch_options(config)).cpu().double(), want):
                failed[config] = "a wrong sum"
        except Exception as e:  # noqa: BLE001 - any failure to build or launch: not this candidate
            if type(e).__name__ == "OutOfResources":  # too large for this GPU's shared memory: the
                unfit.add(config)  # autotuner skips it too, so no warning
            else:
                failed[config] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if len(failed) + len(unfit) == len(CONFIGS):
        log.warning("bk: the Triton kernel for the clipped sums does not run on %s (%s); bk forms them with the "
                    "split's two bf16 products instead (exact within its bound, slower: docs/benchmarks.md). A C "
                    "compiler and the Python headers (gcc, python3-dev) let Triton build",
                    device, "; ".join(sorted(set(failed.values()))) or "no configuration fits its shared memory")
        return False
    if failed:
        log.warning("bk: %d of the Triton kernel's %d configurations failed on %s and are not used: %s",
                    len(failed), len(CONFIGS), device, "; ".join(f"{c}: {why}" for c, why in failed.items()))
    if (failed or unfit) and triton is not None:  # the autotuner chooses among those that passed everywhere
        _tuned.configs = [c for c in _tuned.configs if _config_key(c) not in failed and _config_key(c) not in unfit]
    return True


def _config_key(config) -> tuple:
    """A triton.Config as its CONFIGS tuple."""
    k = config.kwargs
    return k["BM"], k["BN"], k["BK"], config.num_warps, config.num_stages


if triton is not None:
    @triton.jit
    def _scaled_sum_kernel(X, Y, C, OUT, M, N, T, B, per_split, sxk, sxm, syk, syn,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        m_ok, n_ok = rm < M, rn < N
        cols_x, cols_y = rm.to(tl.int64) * sxm, rn.to(tl.int64) * syn  # int64: a column-major x or y
        blocks = tl.cdiv(T, BK)  # an example's blocks; the last one masked past T
        first = pid_s * per_split
        last = tl.minimum(first + per_split, B)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range(first * blocks, last * blocks):  # one loop over every block: Triton pipelines it
            e = i // blocks
            j = i - e * blocks  # the block's place in example e
            rt = j * BK + tl.arange(0, BK)  # rows of example e, (BK,)
            rows = (e * T + rt).to(tl.int64)  # B·T·N passes 2³¹ for a vocabulary-wide head
            k_ok = rt < T
            x = tl.load(X + rows[:, None] * sxk + cols_x[None, :], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            y = tl.load(Y + rows[:, None] * syk + cols_y[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += tl.load(C + e) * tl.dot(tl.trans(x), y)  # (BM, BN): one example's block, then its factor
        out = OUT + (pid_s.to(tl.int64) * M + rm.to(tl.int64)[:, None]) * N + rn[None, :]  # M·N may pass 2³¹
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])

    _tuned = triton.autotune(key=["M", "N"], configs=[
        triton.Config(dict(BM=bm, BN=bn, BK=bk), num_warps=w, num_stages=s) for bm, bn, bk, w, s in CONFIGS
    ])(_scaled_sum_kernel)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def scaled_sum(x: torch.Tensor, y: torch.Tensor, coef: torch.Tensor, blocks: dict | None = None) -> torch.Tensor:
    """Σᵢ coefᵢ·xᵢᵀ·yᵢ (M, N) in fp32, from x (B, T, M) and y (B, T, N) of one dtype and coef (B,) fp32.
    The blocks are autotuned per output shape, or `blocks` as given (BM, BN and BK, and optionally
    num_warps and num_stages): `_runs_on`'s check of each candidate, and the tests under
    Triton's CPU interpreter, where nothing can be timed."""
    b, t, m = x.shape
    n = y.shape[2]
    x2, y2 = x.reshape(b * t, m), y.reshape(b * t, n)
    tiles = triton.cdiv(m, 128) * triton.cdiv(n, 128)
    groups = max(1, min(b, -(-2 * _multiprocessors(x.device) // tiles)))
    per_split = -(-b // groups)
    groups = -(-b // per_split)
    part = torch.empty(groups, m, n, dtype=torch.float32, device=x.device)

    def grid(meta):
        return triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]), groups

    kernel = _tuned[grid] if blocks is None else functools.partial(_scaled_sum_kernel[grid], **blocks)
    kernel(x2, y2, coef.float().contiguous(), part, m, n, t, b, per_split,
           x2.stride(0), x2.stride(1), y2.stride(0), y2.stride(1))
    return part[0] if groups == 1 else part.sum(0)
