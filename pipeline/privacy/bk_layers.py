"""Book-keeping clipping's layers (pipeline/privacy/bk.py wraps the model with them): the
autograd Functions that keep each use's input and output gradient in the one backward; each
use's per-example squared norm and its cross terms with another use of the same parameter; and
each rule's forward. Which rule a layer gets, by what it computes, is pipeline/privacy/bk_rules.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.privacy import bk_kernel
from pipeline.privacy.bk_rules import ONE_PLUS_SCALE, SCALE, WHICH_MODE, apply_linear


# --- one call's per-example gradient of one parameter, kept in factored form -------------------

class Use:
    """What one call of a layer leaves for one trainable parameter, in factored form: `add_sq(norms)`
    adds to a `SquaredNorms` the squared norm of each example's gradient from this call, `dot(other)` (B,) the
    inner products with another call's (same parameter), `weighted_sum(coef)` = Σᵢ coefᵢ ∇ᵢ.

    The factors' dim 0 is the example, as the loss's. A layer fed a 2-D input (N, d) with no
    sequence axis (OPT's MLP and final LayerNorm run on hidden states reshaped from (B, T, d)
    to (B·T, d)) has N = B·T rows: `by_example` regroups them as (B, T, ·). That is exact
    when the rows are example-major, as flattening a batch-first (B, T, d) tensor makes them
    (every decoder family in transformers is batch-first); bk cannot check it, and a model
    that flattened time-major (T, B, d) rows would be grouped wrongly. A 3-D input, or a row
    count that is not a multiple of B, is refused."""

    rows: int  # the factors' dim 0
    flat: bool  # True when the layer's input was 2-D (no sequence axis): rows may be B·T
    bf16 = False  # True where the factors stay bf16 (_MatmulUse on a GPU): its norms get BF16_NORM_MARGIN

    def split_bound(self) -> torch.Tensor | None:
        """The scale (B,) of weighted_sum's error beyond fp32 rounding: only _MatmulUse's
        bf16 factors have one."""
        return None

    def by_example(self, batch: int, name: str) -> None:
        if self.rows == batch:
            return
        if not self.flat or self.rows % batch:
            raise RuntimeError(
                f"bk clipping: {name} saw a batch whose rows are not the loss's examples "
                f"(a model that reshapes the batch dimension), so bk cannot tell whose gradient is whose; {WHICH_MODE}")
        self._regroup(batch)
        self.rows = batch


class SquaredNorms:
    """Σ over uses of each example's squared gradient norm (B,), in as few products as the
    arithmetic allows: the uses of one input a (q, k and v; gate and up: 7 linear maps of a
    Llama layer read 4 inputs) add up their output Gram matrices Σⱼ gⱼgⱼᵀ in place, and each
    input's Gram matrix aaᵀ meets that sum once, ⟨aaᵀ, Σⱼ gⱼgⱼᵀ⟩ = Σⱼ ‖aᵀgⱼ‖² per example.
    Fewer kernels per layer matter on a GPU, where a step of a 135 M model is launch-bound.
    An input is keyed by its memory, which the kept uses hold until the norms are formed, so
    no other tensor can have it."""

    def __init__(self, batch: int, device: torch.device):
        self.sq = torch.zeros(batch, device=device)
        self.split_sq = torch.zeros(batch, device=device)  # Σ over parameters of (Σ over calls of split_bound)²
        self._ghost: dict = {}  # input key -> [a (B, T, d), Σⱼ gⱼgⱼᵀ (B, T, T)]

    def add(self, values: torch.Tensor) -> None:
        self.sq.add_(values)

    def add_dot(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """sq += ⟨xᵢ, yᵢ⟩ for each example i, over everything after dim 0: one batched product
        instead of a multiply, a sum and an add (three kernels, ~270 times a step on a 30-layer
        Llama, where a GPU step of a small model waits on the host)."""
        b = self.sq.shape[0]
        self.sq.view(b, 1, 1).baddbmm_(x.reshape(b, 1, -1), y.reshape(b, -1, 1))

    def add_ghost(self, a: torch.Tensor, g: torch.Tensor) -> None:
        key = (a.data_ptr(), tuple(a.shape), tuple(a.stride()))
        if (entry := self._ghost.get(key)) is None:
            self._ghost[key] = [a, _mm32(g, g.transpose(1, 2))]
        elif g.dtype == torch.float32:
            entry[1].baddbmm_(g, g.transpose(1, 2))
        else:  # bf16 factors: the product in fp32 first (an in-place baddbmm keeps one dtype)
            entry[1].add_(_mm32(g, g.transpose(1, 2)))

    def total(self) -> torch.Tensor:
        """The (B,) sums; the Gram matrices are dropped."""
        for a, gg in self._ghost.values():
            self.add_dot(_mm32(a, a.transpose(1, 2)), gg)  # ⟨aaᵀ, Σⱼ gⱼgⱼᵀ⟩, (B, T, T) each
        self._ghost = {}
        return self.sq


def _ghost_is_cheaper(t1: int, t2: int, d: int, p: int) -> bool:
    """Ghost (T × T' Gram matrices) when 2·T·T' < p·d, else through the (B, d, p) gradients."""
    return 2 * t1 * t2 < p * d


def _matmul_dot(a1, g1, a2, g2) -> torch.Tensor:
    """⟨a1ᵢᵀg1ᵢ, a2ᵢᵀg2ᵢ⟩_F for each example i (two calls of one weight); aₖ (B, Tₖ, d),
    gₖ (B, Tₖ, p)."""
    if _ghost_is_cheaper(a1.shape[1], a2.shape[1], a1.shape[2], g1.shape[2]):
        return ((a1 @ a2.transpose(1, 2)) * (g1 @ g2.transpose(1, 2))).sum((1, 2))  # (B, T, T') each
    return (torch.einsum("btd,btp->bdp", a1, g1) * torch.einsum("btd,btp->bdp", a2, g2)).sum((1, 2))


class _MatmulUse(Use):
    """A linear map's weight: example i's gradient aᵢᵀgᵢ (d, p), or its transpose for
    nn.Linear's (p, d) layout; never formed per example unless that is the cheaper way.

    a and g are fp32, or bf16 where the layer ran in autocast's bf16 on a device with bf16
    matrix units (`split_products`): then every product of two factors is formed from the
    bf16 values with fp32 products and sums (`_mm32`, exact products as in fp32, at the
    16-bit units' rate), and the clipped sum applies the factors inside one product
    (pipeline/privacy/bk_kernel.py) or, without Triton, splits its one rescaled factor, which is
    not a bf16 value, into two bf16 terms (`weighted_sum`)."""

    def __init__(self, a3: torch.Tensor, g3: torch.Tensor, transposed: bool, flat: bool):
        self.a, self.g, self.transposed = a3, g3, transposed  # (B, T, d), (B, T, p)
        self.rows, self.flat = a3.shape[0], flat
        # bf16 factors: the clipped sum as one product with the factors applied per example
        # inside it (bk_kernel, Triton on CUDA), else as the split's two bf16 products
        self.bf16 = a3.dtype == torch.bfloat16
        self.kernel = self.bf16 and bk_kernel.available(a3)
        self.split = self.bf16 and not self.kernel

    def _regroup(self, batch: int) -> None:
        self.a = self.a.reshape(batch, -1, self.a.shape[-1])
        self.g = self.g.reshape(batch, -1, self.g.shape[-1])

    def add_sq(self, norms: SquaredNorms) -> None:
        t, d, p = self.a.shape[1], self.a.shape[2], self.g.shape[2]
        if _ghost_is_cheaper(t, t, d, p):
            norms.add_ghost(self.a, self.g)
        else:
            norms.add(torch.einsum("btd,btp->bdp", self.a.float(), self.g.float()).pow(2).sum((1, 2)))

    def split_bound(self) -> torch.Tensor | None:
        """‖aᵢ‖_F‖gᵢ‖_F (B,) with bf16 factors: weighted_sum's error for example i is at most
        2⁻¹⁶·Cᵢ times this. None with fp32 factors."""
        return (_sq_frobenius(self.a) * _sq_frobenius(self.g)).sqrt() if self.split else None

    def dot(self, other: Use) -> torch.Tensor:
        if isinstance(other, _LookupUse):  # a head tied to the input embedding
            return _lookup_head_dot(other, self)
        return _matmul_dot(self.a.float(), self.g.float(), other.a.float(), other.g.float())

    def weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        """aᵀ·diag(C)·g. With bf16 factors on CUDA with Triton: one product, C applied per
        example block inside it, exact to fp32 rounding. Else scale the smaller of a and g (for
        lm_head, a: d=576 beside V=49,152); with bf16 factors the scaled one x = C·a (fp32) is split as hi = bf16(x) and
        lo = bf16(x − hi), |x − hi − lo| ≤ 2⁻¹⁶|x| elementwise, and the sum is the two bf16
        products' sum: example i's part then differs from Cᵢaᵢᵀgᵢ by at most
        2⁻¹⁶·Cᵢ‖aᵢ‖_F‖gᵢ‖_F, which backward_clipped adds to the norm it clips by."""
        if self.kernel:  # Conv1D's (d, p) = aᵀ·diag(C)·g; nn.Linear's (p, d) = gᵀ·diag(C)·a
            return bk_kernel.scaled_sum(*((self.a, self.g) if self.transposed else (self.g, self.a)), coef)
        c = coef.view(-1, 1, 1)
        scale_a = self.a.shape[-1] <= self.g.shape[-1]
        x, other = (self.a, self.g) if scale_a else (self.g, self.a)
        x = x * c  # fp32 (a bf16 factor times the fp32 coefficients promotes)
        x, other = x.reshape(-1, x.shape[-1]), other.reshape(-1, other.shape[-1])  # (B·T, ·)

        def product(scaled: torch.Tensor) -> torch.Tensor:
            a, g = (scaled, other) if scale_a else (other, scaled)
            return _mm32(a.t(), g) if self.transposed else _mm32(g.t(), a)

        if not self.split:
            return product(x)
        hi = x.to(torch.bfloat16)
        lo = x.sub_(hi).to(torch.bfloat16)  # x − hi, in place: exact in fp32 (Sterbenz)
        return product(hi).add_(product(lo))


class _LookupUse(Use):
    """An embedding's weight: example i's gradient has row v = Σ_{t: idᵢₜ = v} gᵢₜ, so
    ‖∇ᵢ‖² = Σ_{t,s} [idᵢₜ = idᵢₛ] gᵢₜ·gᵢₛ, never a (B, V, d) tensor."""

    def __init__(self, ids2: torch.Tensor, g3: torch.Tensor, shape: torch.Size, flat: bool):
        self.ids, self.g, self.shape = ids2, g3, shape  # (B, T), (B, T, d)
        self.rows, self.flat = ids2.shape[0], flat

    def _regroup(self, batch: int) -> None:
        self.ids, self.g = self.ids.reshape(batch, -1), self.g.reshape(batch, -1, self.g.shape[-1])

    def add_sq(self, norms: SquaredNorms) -> None:
        norms.add(self.dot(self))

    def dot(self, other: Use) -> torch.Tensor:
        if isinstance(other, _MatmulUse):  # the output head tied to this embedding
            return _lookup_head_dot(self, other)
        same = self.ids.unsqueeze(2) == other.ids.unsqueeze(1)  # (B, T, T')
        return ((self.g @ other.g.transpose(1, 2)) * same).sum((1, 2))

    def weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        rows = (self.g * coef.view(-1, 1, 1)).reshape(-1, self.g.shape[-1])  # (B·T, d)
        return torch.zeros(self.shape, device=rows.device).index_add_(0, self.ids.reshape(-1), rows)


def _lookup_head_dot(lookup: _LookupUse, head: _MatmulUse) -> torch.Tensor:
    """⟨Eᵢ, Hᵢ⟩ for each example i, where one weight W (V, d) is both an embedding (Eᵢ: row v is
    Σ_{t: idᵢₜ = v} eᵢₜ, e the lookup's output gradient) and a linear head in nn.Linear's layout
    (Hᵢ = gᵢᵀaᵢ, g the logits' gradient (S, V), a the head's input (S, d)): the cross term of the
    tied weight's per-example norm, ‖Eᵢ + Hᵢ‖² = ‖Eᵢ‖² + ‖Hᵢ‖² + 2⟨Eᵢ, Hᵢ⟩. It reads only the head's
    rows at the looked-up ids: ⟨Eᵢ, Hᵢ⟩ = Σₜ eᵢₜ·Hᵢ[idᵢₜ] = Σ_{s,t} gᵢ[s, idᵢₜ] (aᵢₛ·eᵢₜ), a product
    of two (B, S, T) matrices, never a (B, V, d) tensor."""
    if head.transposed:
        raise RuntimeError("bk clipping: a tied head stored transposed (Conv1D) has no cross-term rule")
    a, g, e, ids = head.a.float(), head.g.float(), lookup.g, lookup.ids  # (B,S,d), (B,S,V), (B,T,d), (B,T)
    at_ids = torch.gather(g, 2, ids.unsqueeze(1).expand(-1, g.shape[1], -1))  # (B, S, T): gᵢ[s, idᵢₜ]
    return (at_ids * (a @ e.transpose(1, 2))).sum((1, 2))


class _VectorUse(Use):
    """A bias, a norm's weight or a gate's: the per-example gradients (B, n), n the parameter's
    size, are small, formed outright from the per-position products x (B, ..., *) by summing
    every axis the parameter broadcasts over: the positions (and heads), and for a 1-element
    gate x·w the features too (issue 62: summed over positions only, a gate's gradient had the
    input's width, its norm was wrong and its sum did not fit the parameter)."""

    def __init__(self, x: torch.Tensor, shape: torch.Size, flat: bool):
        lead = x.dim() - len(shape)  # the example's axis and the positions'
        if lead < 1:
            raise RuntimeError(f"bk clipping: a parameter of shape {tuple(shape)} scaled an input of shape "
                               f"{tuple(x.shape)}, which has no example axis; {WHICH_MODE}")
        target = (x.shape[0],) + (1,) * (lead - 1) + tuple(shape)
        self.per = (x if x.shape == target else x.sum_to_size(target)).reshape(x.shape[0], -1)  # (B, n)
        self.shape, self.rows, self.flat = shape, x.shape[0], flat

    def _regroup(self, batch: int) -> None:
        self.per = self.per.reshape(batch, -1, self.per.shape[-1]).sum(1)

    def add_sq(self, norms: SquaredNorms) -> None:
        norms.add_dot(self.per, self.per)

    def dot(self, other: _VectorUse) -> torch.Tensor:
        return (self.per * other.per).sum(1)

    def weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        return (coef @ self.per).view(self.shape)  # (B,) @ (B, n) -> (n,), the parameter's shape


Keep = Callable[[list], None]  # receives [(parameter, Use)] from one call's backward


def _flat3(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])  # (B, T, ·)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would compute in here: autocast's (bf16 under precision=bf16) when
    it is on for x's device, else x's own. The Functions below cast explicitly, once in the
    forward, and their backward (which autocast does not cover) uses the same dtype, instead
    of being decorated with torch.amp.custom_fwd for one fixed device type."""
    kind = x.device.type
    if kind == "meta":  # preflight's dry run on the meta device (no autocast there)
        return x.dtype
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


# Devices whose bf16 matrix products can return fp32 (torch.mm/bmm's out_dtype): there a linear
# layer run in bf16 keeps its factors in bf16 and bk's products run on the 16-bit units. On an
# H100 its fp32 products ran as SIMT sgemm, 40 % of bk's GPU time at SmolLM2's shape
# (docs/benchmarks.md). Elsewhere the factors are upcast once and multiplied in fp32.
SPLIT_DEVICES = {"cuda"}

# |x − hi − lo| ≤ 2⁻¹⁶|x| for hi = bf16(x), lo = bf16(x − hi) (8-bit significands, round to
# nearest); twice that, for margin.
SPLIT_ERROR = 2.0**-15

# With bf16 factors the norms come from bf16 products summed in fp32 on the 16-bit units, which
# truncate as they sum (tensor cores are not IEEE round-to-nearest: Fasi, Higham, Mikaitis and
# Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021). On an H200 every example's
# norm read at least 4e-7 (relative) below the same norm from the fp32 factors' fp32 products, and
# one example run alone was clipped to C·(1 + 1e-6) (bench/bk_bf16_factors.py): a bias, which the
# split's bound (1.7e-4 on the factors) used to hide. No bound on it is published, so each norm is
# raised by this margin, 120 times the largest excess seen and the size of the split's bound: no
# example is clipped by less than C, at a cost of 1.2e-4 of each clipped gradient.
BF16_NORM_MARGIN = 2.0**-13


def split_products(a: torch.Tensor, g: torch.Tensor) -> bool:
    return a.dtype == g.dtype == torch.bfloat16 and a.device.type in SPLIT_DEVICES


def _mm32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y (2-D or batched 3-D) in fp32: fp32 factors as they are; bf16 factors with fp32
    products and sums, which is exact per product (two 8-bit significands fit fp32's 24), on
    the GPU's 16-bit units (out_dtype), else by upcasting."""
    if x.dtype == torch.float32:
        return x @ y
    if x.device.type == "cuda":
        return (torch.mm if x.dim() == 2 else torch.bmm)(x, y, out_dtype=torch.float32)
    return x.float() @ y.float()


def _sq_frobenius(t: torch.Tensor) -> torch.Tensor:
    """‖tᵢ‖²_F for each example i of t (B, ·, ·), in fp32."""
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1, dtype=torch.float32).square()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype; t itself when it already is (no dispatch: these run once per layer call)."""
    return t if t.dtype == dtype else t.to(dtype)


# --- the layers' autograd Functions: input gradient out, per-example factors kept ---------------

class _LinearFn(torch.autograd.Function):
    """y = x Wᵀ + b (nn.Linear) or y = x W + b (Conv1D, `transposed`); backward returns the
    input gradient only and keeps what the clipped sum needs. Under autocast the products run
    in its dtype (fp32 master weights cast per call); the norms and sums are formed in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed, keep):
        dt = _compute_dtype(x)
        xc = _as(x, dt)
        ctx.save_for_backward(xc, weight)
        ctx.transposed, ctx.keep, ctx.weight, ctx.bias, ctx.dt = transposed, keep, weight, bias, dt
        # every operand already in dt, autocast's own dtype when it is on: it casts nothing more
        return apply_linear(xc, _as(weight, dt), None if bias is None else _as(bias, dt), transposed)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:  # autograd casts it to x's dtype
            w = _as(weight, ctx.dt)  # Linear: (p, d), so g W; Conv1D: (d, p), so g Wᵀ
            grad_x = _as(g, ctx.dt) @ (w.t() if ctx.transposed else w)
        a3, g3 = _flat3(x.detach()), _flat3(g)  # x: no graph on it later
        if not split_products(a3, g3):  # else kept in bf16, half the memory (_MatmulUse)
            a3, g3 = _as(a3, torch.float32), _as(g3, torch.float32)
        flat = x.dim() == 2
        uses = []
        if ctx.needs_input_grad[1]:
            uses.append((ctx.weight, _MatmulUse(a3, g3, ctx.transposed, flat)))
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            uses.append((ctx.bias, _VectorUse(_as(g, torch.float32), ctx.bias.shape, flat)))
        ctx.keep(uses)
        return grad_x, None, None, None, None


class _EmbeddingFn(torch.autograd.Function):
    """y = W[ids]; backward keeps ids and g (`_LookupUse`): the clipped sum is an index-add of
    the reweighted rows of g."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, keep):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx, ctx.keep = weight, padding_idx, keep
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        ids2 = ids.reshape(ids.shape[0], -1)  # (B, T)
        g3 = _flat3(g).float()  # (B, T, d)
        if ctx.padding_idx is not None:  # torch gives the padding row no gradient
            g3 = g3 * (ids2 != ctx.padding_idx).unsqueeze(-1)
        use = _LookupUse(ids2, g3, ctx.weight.shape, flat=ids.dim() == 1)
        ctx.keep([(ctx.weight, use)] if ctx.needs_input_grad[1] else [])
        return None, None, None, None


class _ScaleFn(torch.autograd.Function):
    """An elementwise scale y = c + w ⊙ s + b (`one_plus`: y = c + (1 + w) ⊙ s + b) on s (B, T, ...)
    (and c, None when 0) computed by the module's own forward, w broadcast over s's trailing axes;
    per-example gradients Σ gₜ ⊙ sₜ and Σ gₜ over every axis w broadcasts over have w's size,
    formed here (`_VectorUse`). The product runs in fp32 (at least) and the output
    takes s's dtype, which is the module's own output dtype (s came out of its forward)."""

    @staticmethod
    def forward(ctx, s, c, weight, bias, one_plus, keep):
        ctx.save_for_backward(s, weight)
        ctx.keep, ctx.weight, ctx.bias, ctx.one_plus = keep, weight, bias, one_plus
        dt = torch.promote_types(s.dtype, torch.float32)  # Gemma's 1 + w would round away in bf16
        out = s.to(dt) * (weight.to(dt) + 1 if one_plus else weight.to(dt))
        if c is not None:
            out = out + c.to(dt)
        if bias is not None:
            out = out + bias.to(dt)
        return out.to(s.dtype)

    @staticmethod
    def backward(ctx, g):
        s, weight = ctx.saved_tensors
        g32, flat = g.float(), g.dim() == 2  # (B, T, ...), or (B·T, d) without a sequence axis
        uses = []
        if ctx.needs_input_grad[2]:
            uses.append((ctx.weight, _VectorUse(g32 * s.detach().float(), weight.shape, flat)))
        if ctx.bias is not None and ctx.needs_input_grad[3]:
            uses.append((ctx.bias, _VectorUse(g32, ctx.bias.shape, flat)))
        ctx.keep(uses)
        grad_s = None
        if ctx.needs_input_grad[0]:
            scale = weight.float() + 1 if ctx.one_plus else weight.float()
            grad_s = (g32 * scale).sum_to_size(s.shape).to(g.dtype)  # autograd casts it to s's dtype
        return grad_s, (g if ctx.needs_input_grad[1] else None), None, None, None, None


# --- patching: each rule's forward -------------------------------------------------------------

def linear_forward(module: nn.Module, keep: Keep, transposed: bool):
    return lambda x: _LinearFn.apply(x, module.weight, module.bias, transposed, keep)


def embedding_forward(module: nn.Embedding, keep: Keep):
    return lambda ids: _EmbeddingFn.apply(ids, module.weight, module.padding_idx, keep)


class _RoutedLookup(nn.Embedding):
    """nn.Embedding's lookup through bk. Placed in an nn.Embedding subclass's MRO right before
    nn.Embedding (`routed_class`), so that the subclass's own forward runs as written (OPT's
    position ids, Gemma's √d scale) and its `super().forward(ids)` reaches this lookup. A
    subclass that reads `self.weight` some other way (F.embedding itself) is caught by
    backward_clipped's check for gradients that bypassed bk."""

    def forward(self, ids):
        return _EmbeddingFn.apply(ids, self.weight, self.padding_idx, self._bk_keep)


_ROUTED: dict[type, type] = {}


def routed_class(cls: type) -> type:
    """cls with _RoutedLookup between it and nn.Embedding in the MRO: (cls, ..., _RoutedLookup,
    nn.Embedding, nn.Module). Same name, so messages and reprs read as before."""
    if cls not in _ROUTED:
        _ROUTED[cls] = type(cls.__name__, (cls, _RoutedLookup), {"__module__": cls.__module__})
    return _ROUTED[cls]


def elementwise_forward(module: nn.Module, kind: str, keep: Keep):
    """The module's own forward run at w = 1 (SCALE: s), w = 0 (ONE_PLUS_SCALE: s; AFFINE_SCALE:
    c, then w = 1 for c + s) and b = 0, on a stand-in: a shallow copy that shares the module's
    attributes (eps, shapes) but holds these constants as its parameters, so the module
    itself is never modified and its hooks do not run twice."""
    forward_of_class = type(module).forward
    stand_in = copy.copy(module)
    stand_in.__dict__.pop("forward", None)

    made: dict = {}  # the constants, made once per (w, the weight's shape, dtype and device, a bias or not)

    def constants(w: float) -> dict:
        weight, bias = module.weight, module._parameters.get("bias")
        key = (w, weight.shape, weight.dtype, weight.device, bias is None)
        if (consts := made.get(key)) is None:
            consts = made[key] = {"weight": torch.full_like(weight, w, requires_grad=False)}  # w's shape
            if "bias" in module._parameters:  # None stays None: LayerNorm(bias=False) reads self.bias
                consts["bias"] = None if bias is None else torch.zeros_like(bias, requires_grad=False)
        return consts

    def own_forward(x, w: float):
        stand_in.__dict__["_parameters"] = constants(w)  # never the module's own dict
        stand_in.__dict__["training"] = module.training
        return forward_of_class(stand_in, x)

    def forward(x):
        weight, bias = module.weight, module._parameters.get("bias")
        if kind == SCALE:
            return _ScaleFn.apply(own_forward(x, 1.0), None, weight, bias, False, keep)
        if kind == ONE_PLUS_SCALE:
            return _ScaleFn.apply(own_forward(x, 0.0), None, weight, bias, True, keep)
        c = own_forward(x, 0.0)
        return _ScaleFn.apply(own_forward(x, 1.0) - c, c, weight, bias, False, keep)

    return forward


# --- the wrapper ---------------------------------------------------------------------------------

