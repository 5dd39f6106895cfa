"""Privacy machinery shared by the DP stages: Opacus samplers for GPT-2's Conv1D.

GPT-2 implements its attention and MLP projections with `transformers.pytorch_utils.Conv1D`
(y = x W + b with W of shape (in, out): an `nn.Linear` with a transposed weight). Opacus
knows `nn.Linear` but not `Conv1D`, so without help ghost clipping falls back to
materialising per-sample gradients for every Conv1D (functorch), losing its memory and
speed advantage. Registered here:

- a *norm sampler*: the per-example gradient norm of a linear map depends only on the
  layer's input a and output gradient g (‖Σ_t a_t g_tᵀ‖_F, computed as ⟨a aᵀ, g gᵀ⟩ by
  Opacus' `compute_linear_norm_sample`), not on how the weight is stored: exact for Conv1D;
- a *grad sampler* for Opacus' per-sample mode: the Linear einsum with in/out swapped.

LayerNorm gets a norm sampler too: its per-example gradient is one d-vector per example
(no larger than a row of activations), so it is computed and its norm taken; with it every
parameterised layer of GPT-2 (Embedding, Conv1D, LayerNorm, Linear) has a norm sampler. Its
grad sampler replaces Opacus' own, which reads `layer.bias.requires_grad` and so crashed on a
LayerNorm without bias (StableLM-2's per-head q/k norms; issue 62), in ghost and hooks alike.

Importing this module registers both (idempotent).
"""

from __future__ import annotations

import functools
import time

import torch
from opacus.accountants.analysis import rdp as _opacus_rdp
from opacus.grad_sample.linear import compute_linear_norm_sample
from opacus.grad_sample.utils import register_grad_sampler, register_norm_sampler
from opacus.utils.tensor_utils import sum_over_all_but_batch_and_last_n
from transformers.pytorch_utils import Conv1D


@register_grad_sampler(Conv1D)
def compute_conv1d_grad_sample(layer: Conv1D, activations: list[torch.Tensor], backprops: torch.Tensor):
    """Per-sample gradients of a Conv1D: weight (N, in, out), bias (N, out)."""
    a = activations[0].to(backprops.dtype)  # (N, ..., in)
    out = {}
    if layer.weight.requires_grad:
        out[layer.weight] = torch.einsum("n...i,n...j->nij", a, backprops)  # (N, in, out)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = torch.einsum("n...k->nk", backprops)  # (N, out)
    return out


register_norm_sampler(Conv1D)(compute_linear_norm_sample)


@register_grad_sampler(torch.nn.LayerNorm)
def compute_layer_norm_grad_sample(layer: torch.nn.LayerNorm, activations: list[torch.Tensor], backprops: torch.Tensor):
    """Per-sample gradients of a LayerNorm's weight and bias (each (N, *normalized_shape)), Opacus'
    arithmetic, with or without a bias."""
    out = {}
    if layer.weight.requires_grad:
        normed = torch.nn.functional.layer_norm(activations[0], layer.normalized_shape, eps=layer.eps)
        out[layer.weight] = sum_over_all_but_batch_and_last_n(normed * backprops, layer.weight.dim())
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = sum_over_all_but_batch_and_last_n(backprops, layer.bias.dim())
    return out


@register_norm_sampler(torch.nn.LayerNorm)
def compute_layer_norm_norm_sample(layer: torch.nn.LayerNorm, activations, backprops):
    """Per-sample gradient norms of a LayerNorm's weight and bias, each (N,)."""
    grads = compute_layer_norm_grad_sample(layer, activations, backprops)
    return {p: g.flatten(1).norm(dim=1) for p, g in grads.items()}


# --- accounting -------------------------------------------------------------------------
# ε always comes from an Opacus accountant given the mechanism's history of
# (noise multiplier σ, sampling rate q, steps) entries; never from arithmetic of ours.

ACCOUNTANTS = ("prv", "rdp", "gdp")
History = list[tuple[float, float, int]]


# Opacus' RDP of one subsampled Gaussian step at one order, `_compute_rdp(q, σ, order)`, is a
# pure function of its three numbers, and its accountants recompute it for each ε: the PRV
# accountant bounds its domain with two RDP accountants (two full passes over ~150 orders,
# 95% of a tiny teacher's time), and every step's ε recomputes it for the same (q, σ). Opacus'
# own function, remembered: the same values, the second time without the series.
if not hasattr(_opacus_rdp._compute_rdp, "cache_info"):  # once per process
    _opacus_rdp._compute_rdp = functools.lru_cache(maxsize=1 << 16)(_opacus_rdp._compute_rdp)


def epsilon_of(accountant: str, history: History, delta: float) -> float:
    """ε after the Gaussian mechanisms in `history`, by the named Opacus accountant.

    Opacus' GDP accountant reads only the last history entry, so it cannot compose
    mechanisms with different (σ, q): refused here rather than silently under-counted.
    """
    if accountant == "gdp" and len({(s, q) for s, q, _ in history}) > 1:
        raise ValueError("the gdp accountant cannot compose mechanisms with different σ or q; use prv or rdp")
    return _epsilon(accountant, tuple((float(s), float(q), int(n)) for s, q, n in history), float(delta))


# A run asks the accountant the same questions several times: the plan before the server
# starts, the plan inside the flow, the teacher stage (σ and its ε), the ledger's total and
# the dataset budget's. Each answer is a pure function of public numbers, so it is kept for
# the process (issue 22): a second plan of the tiny test config took 1.1 s before, 0.04 s now.
@functools.lru_cache(maxsize=1024)
def _epsilon(accountant: str, history: tuple, delta: float) -> float:
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    return float(acc.get_epsilon(delta=delta))


CALIBRATION_DEADLINE_S = 60.0
"""How long the noise calibration may search before the run stops with advice (issue 10)."""


class CalibrationTimeout(RuntimeError):
    """The accountant did not find σ for the target ε within the deadline."""


def calibrate_sigma(
    accountant: str, target_epsilon: float, delta: float, sample_rate: float, steps: int,
    deadline_s: float | None = None,
) -> float:
    """σ reaching (target ε, δ) after `steps` subsampled Gaussian steps at `sample_rate`.

    The search of Opacus' `get_noise_multiplier`, step for step (the same σ: a test checks it),
    with a deadline. Why not Opacus' function itself: at a very large ε (1000 at q=0.083 and 36
    steps) the PRV accountant overflows below some σ and returns ε=inf, ever more slowly (6 s
    per call at σ=0.078, 49 s at 0.039, measured); the bisection takes inf for "σ too small",
    while the finite ε just above that σ stays far below the target, so it never reaches its
    tolerance and never returns. Here the deadline is checked before each accountant call (one
    call may run past it), and a search that has narrowed to nothing stops too.
    Every ε comes from the accountant; only the choice of the next σ is ours (Opacus').
    """
    key = (accountant, float(target_epsilon), float(delta), float(sample_rate), int(steps))
    if key not in _calibrated:  # the same search again in this process (see `_epsilon`)
        _calibrated[key] = _search_sigma(*key, deadline_s)
    return _calibrated[key]


_calibrated: dict[tuple, float] = {}


def _search_sigma(accountant: str, target_epsilon: float, delta: float, sample_rate: float, steps: int,
                  deadline_s: float | None) -> float:
    from opacus.accountants import create_accountant
    from opacus.accountants.utils import MAX_SIGMA

    deadline_s = CALIBRATION_DEADLINE_S if deadline_s is None else deadline_s
    stop_at = time.monotonic() + deadline_s
    acc = create_accountant(mechanism=accountant)

    def eps(sigma: float) -> float:
        if time.monotonic() > stop_at:
            raise CalibrationTimeout(
                f"the {accountant} accountant found no σ for ε={target_epsilon} within {deadline_s:g} s"
            )
        acc.history = [(sigma, sample_rate, steps)]
        return acc.get_epsilon(delta=delta)

    epsilon_tolerance = 0.01  # Opacus' default
    eps_high = float("inf")
    sigma_low, sigma_high = 0, 10
    while eps_high > target_epsilon:
        sigma_high = 2 * sigma_high
        eps_high = eps(sigma_high)
        if sigma_high > MAX_SIGMA:
            raise ValueError("The privacy budget is too low.")  # Opacus' words
    while target_epsilon - eps_high > epsilon_tolerance:
        sigma = (sigma_low + sigma_high) / 2
        if not sigma_low < sigma < sigma_high:  # nothing left between them (ε jumps past the target)
            raise CalibrationTimeout(
                f"the {accountant} accountant jumps from ε={eps_high:.4g} to above ε={target_epsilon} at "
                f"σ={sigma_high:.6g} and cannot reach the target"
            )
        e = eps(sigma)
        if e < target_epsilon:
            sigma_high, eps_high = sigma, e
        else:
            sigma_low = sigma
    return sigma_high


def max_steps_within_budget(
    accountant: str, sigma: float, sample_rate: float, delta: float, target_epsilon: float, steps: int
) -> int:
    """The largest k ≤ `steps` whose ε after k steps stays ≤ the target (binary search).

    σ is calibrated for `steps`, but only up to the calibration's tolerance: training stops
    at this k, before the step that would exceed the budget, never after it.
    """

    def eps(k: int) -> float:
        return epsilon_of(accountant, [(sigma, sample_rate, k)], delta) if k > 0 else 0.0

    if eps(steps) <= target_epsilon:
        return steps
    lo, hi = 0, steps  # eps(lo) <= target < eps(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps(mid) <= target_epsilon else (lo, mid)
    return lo


# --- δ -----------------------------------------------------------------------------------
# δ = 1/N admits a mechanism that publishes each record with probability δ, i.e. one record
# in the clear in expectation. The default is ten times smaller: such a mechanism would then
# publish anything at all with probability at most 0.1, a fixed margin at every N (N^-1.1,
# the other common choice, is only 2x below 1/N at N = 1,500 and 4x at N = 1M).
DEFAULT_DELTA = "1/(10N)"


def resolve_delta(target: float | str, n_units: int) -> float:
    """δ for N privacy units (records or users): '1/(10N)', '1/N' (the paper's), or a number."""
    if target == "1/(10N)":
        return 1.0 / (10 * n_units)
    if target == "1/N":
        return 1.0 / n_units
    return float(target)


def weak_delta_warning(delta: float, n_units: int, unit: str, where: str) -> str | None:
    """The warning to log when δ ≥ 1/N (one unit may be released in the clear), else None."""
    if delta < 1.0 / n_units:
        return None
    return (
        f"{where}: δ={delta:.3g} is not below 1/N={1.0 / n_units:.3g} (N={n_units} {unit}s): a mechanism "
        "that publishes one random record in the clear satisfies this guarantee; use the default "
        "'1/(10N)' or a smaller number"
    )
