"""Book-keeping ("bk") clipping: DP-SGD's clipped gradient sum in ONE backward pass.

Bu et al., "Differentially Private Optimization on Large Model at Small Cost" (ICML 2023).
Opacus' ghost clipping runs backward twice: once for the per-example gradient norms, once
more on the loss reweighted by the clipping factors. Book-keeping needs one:

1. During the single backward, each parameterised layer keeps its input a (B, T, d) and
   output gradient g (B, T, p), and computes each example's squared gradient norm, by the
   ghost trick ‖aᵢᵀgᵢ‖² = ⟨aᵢaᵢᵀ, gᵢgᵢᵀ⟩ when 2T² < p·d, else by forming aᵢᵀgᵢ.
   Autograd does not compute the weight gradients: each layer's backward returns the input
   gradient only (the weight gradient is the one to be clipped, formed once, below).
2. Once every norm is known: the factors Cᵢ = min(1, C / (‖∇ℓᵢ‖ + 1e-6)) (Opacus' formula)
   and each weight's clipped sum aᵀ·diag(C)·g, a product the size of the ordinary weight
   gradient. The embedding's sum is an index-add of the reweighted output gradients, never
   a (B, T, V) one-hot. LayerNorm's and the biases' per-example gradients are d-vectors:
   formed in the backward and reweighted.

The result lands in `p.grad` as Σᵢ Cᵢ ∇ℓᵢ, exactly what Opacus' fast-gradient-clipping
optimizers expect after ghost clipping's second backward, so Opacus' sampling, accountant,
noise and optimizer (DPDDP's too) are used unchanged: `BookKeepingPrivacyEngine` is
Opacus' PrivacyEngine with `grad_sample_mode="bk"` mapped to this module and to the
ghost-clipping optimizer.

Layers: nn.Linear, GPT-2's Conv1D, nn.Embedding, nn.LayerNorm (every parameterised layer of
GPT-2, peft's LoRA adapters being nn.Linear). Any other module with trainable parameters of
its own is refused by name, and so is a trainable parameter shared by two layers (tied
weights: each layer sees only its own use of it). The weights' gradients exist only after
`backward_clipped`; a plain `loss.backward()` on the wrapped model is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from opacus.optimizers import DistributedDPOptimizerFastGradientClipping, DPOptimizerFastGradientClipping
from opacus.optimizers import optimizer_fast_gradient_clipping as fgc
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch import nn
from transformers.pytorch_utils import Conv1D

BK = "bk"


@dataclass
class _Kept:
    """What one layer call leaves for the clipped sum: the squared per-example norms of its
    trainable parameters, and how to form each parameter's reweighted sum later."""

    sq_norm: torch.Tensor  # (B,), summed over the call's trainable parameters
    sums: list = field(default_factory=list)  # (parameter, fn(coef (B,)) -> gradient)


def _flat3(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])  # (B, T, ·)


def _matmul_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """‖aᵢᵀgᵢ‖²_F for each example i; a (B, T, d), g (B, T, p). Ghost when 2T² < p·d."""
    t, d, p = a.shape[1], a.shape[2], g.shape[2]
    if 2 * t * t < p * d:
        return ((a @ a.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))
    return torch.einsum("btd,btp->bdp", a, g).pow(2).sum((1, 2))


def _weighted_bias(per_example: torch.Tensor):
    return lambda coef: coef @ per_example  # (B,) @ (B, p) -> (p,)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would compute in here: autocast's (bf16 under precision=bf16) when
    it is on for x's device, else x's own. The Functions below cast explicitly, once in the
    forward, and their backward (which autocast does not cover) uses the same dtype, instead
    of being decorated with torch.amp.custom_fwd for one fixed device type."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _LinearFn(torch.autograd.Function):
    """y = x Wᵀ + b (nn.Linear) or y = x W + b (Conv1D, `transposed`); backward returns the
    input gradient only and keeps what the clipped sum needs. Under autocast the products run
    in its dtype (fp32 master weights cast per call); the norms and sums are formed in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed, keep):
        dt = _compute_dtype(x)
        xc = x.to(dt)
        ctx.save_for_backward(xc, weight)
        ctx.transposed, ctx.keep, ctx.weight, ctx.bias, ctx.dt = transposed, keep, weight, bias, dt
        w = (weight if transposed else weight.t()).to(dt)  # (d, p)
        with torch.autocast(x.device.type, enabled=False):
            if bias is None:
                return xc @ w
            return torch.addmm(bias.to(dt), xc.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        w = (weight if ctx.transposed else weight.t()).to(ctx.dt)  # (d, p)
        grad_x = g.to(ctx.dt) @ w.t() if ctx.needs_input_grad[0] else None  # autograd casts it to x's dtype
        a3, g3 = _flat3(x.detach()).float(), _flat3(g).float()  # x is an activation: no graph on it later
        sq = torch.zeros(a3.shape[0], device=g.device)
        sums = []
        if ctx.needs_input_grad[1]:
            sq = sq + _matmul_sq_norms(a3, g3)

            def weight_sum(coef, a3=a3, g3=g3, transposed=ctx.transposed):
                # aᵀ·diag(C)·g: scale the smaller of a and g (for lm_head, a: d=768 beside V=50257)
                c = coef.view(-1, 1, 1)
                a, g = (a3 * c, g3) if a3.shape[-1] <= g3.shape[-1] else (a3, g3 * c)
                a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])  # (B·T, d), (B·T, p)
                return a.t() @ g if transposed else g.t() @ a

            sums.append((ctx.weight, weight_sum))
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            per = g3.sum(1)  # (B, p)
            sq = sq + per.pow(2).sum(1)
            sums.append((ctx.bias, _weighted_bias(per)))
        ctx.keep(_Kept(sq, sums))
        return grad_x, None, None, None, None


class _EmbeddingFn(torch.autograd.Function):
    """y = W[ids]; backward keeps ids and g: ‖∇ℓᵢ‖² = Σ_{t,s} [idₜ = idₛ] gₜ·gₛ, and the
    clipped sum is an index-add of the reweighted rows of g."""

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
        same = ids2.unsqueeze(2) == ids2.unsqueeze(1)  # (B, T, T)
        sq = ((g3 @ g3.transpose(1, 2)) * same).sum((1, 2))

        def weight_sum(coef, ids2=ids2, g3=g3, shape=ctx.weight.shape):
            rows = (g3 * coef.view(-1, 1, 1)).reshape(-1, g3.shape[-1])  # (B·T, d)
            return torch.zeros(shape, device=g3.device).index_add_(0, ids2.reshape(-1), rows)

        ctx.keep(_Kept(sq, [(ctx.weight, weight_sum)]))
        return None, None, None, None


class _AffineFn(torch.autograd.Function):
    """LayerNorm's elementwise affine y = x̂ ⊙ w + b on the normalised input x̂; per-example
    gradients Σₜ gₜ ⊙ x̂ₜ and Σₜ gₜ are d-vectors, formed here."""

    @staticmethod
    def forward(ctx, xhat, weight, bias, keep):
        ctx.save_for_backward(xhat, weight)
        ctx.keep, ctx.weight, ctx.bias = keep, weight, bias
        out = xhat * weight
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, g):
        xhat, weight = ctx.saved_tensors
        g3, x3 = _flat3(g).float(), _flat3(xhat.detach()).float()
        sq = torch.zeros(g3.shape[0], device=g.device)
        sums = []
        if ctx.needs_input_grad[1]:
            per = (g3 * x3).sum(1)  # (B, d)
            sq = sq + per.pow(2).sum(1)
            sums.append((ctx.weight, _weighted_bias(per)))
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            per = g3.sum(1)
            sq = sq + per.pow(2).sum(1)
            sums.append((ctx.bias, _weighted_bias(per)))
        ctx.keep(_Kept(sq, sums))
        return g * weight, None, None, None


def _linear_forward(module: nn.Module, keep, transposed: bool):
    return lambda x: _LinearFn.apply(x, module.weight, module.bias, transposed, keep)


def _embedding_forward(module: nn.Embedding, keep):
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise NotImplementedError(f"bk clipping: {module} uses max_norm, sparse or scale_grad_by_freq")
    return lambda ids: _EmbeddingFn.apply(ids, module.weight, module.padding_idx, keep)


def _layer_norm_forward(module: nn.LayerNorm, keep):
    def forward(x):
        xhat = F.layer_norm(x, module.normalized_shape, None, None, module.eps)
        return _AffineFn.apply(xhat, module.weight, module.bias, keep)
    return forward


class GradSampleModuleBookKeeping(AbstractGradSampleModule):
    """Opacus' GradSampleModule contract for `grad_sample_mode="bk"`: wraps the model, and
    after `backward_clipped(per_example_loss)` every trainable parameter's `.grad` holds
    Σᵢ Cᵢ ∇ℓᵢ (Cᵢ = min(1, max_grad_norm / (‖∇ℓᵢ‖ + 1e-6)))."""

    def __init__(self, m: nn.Module, *, batch_first=True, loss_reduction="mean", strict=True,
                 max_grad_norm: float = 1.0, **_):
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        self.max_grad_norm = max_grad_norm
        self.hooks_enabled = True
        self._kept: list[_Kept] = []
        self._patched: list[nn.Module] = []
        self.per_sample_gradient_norms: torch.Tensor | None = None
        self._clipping = False  # True only inside backward_clipped: the one backward bk supports
        owners: dict[int, str] = {}  # id(trainable parameter) -> its first name
        for name, module in m.named_modules():
            if not any(p.requires_grad for p in module.parameters(recurse=False)):
                continue
            self._claim(name, module, owners)
            if type(module) is nn.Linear:
                module.forward = _linear_forward(module, self._keep, transposed=False)
            elif type(module) is Conv1D:
                module.forward = _linear_forward(module, self._keep, transposed=True)
            elif type(module) is nn.Embedding:
                module.forward = _embedding_forward(module, self._keep)
            elif type(module) is nn.LayerNorm:
                module.forward = _layer_norm_forward(module, self._keep)
            else:
                self.remove_hooks()
                raise NotImplementedError(
                    f"bk clipping has no rule for {name or 'the model'} ({type(module).__name__}); "
                    "use teacher.grad_sample_mode=ghost or hooks"
                )
            self._patched.append(module)

    def _claim(self, name: str, module: nn.Module, owners: dict[int, str]) -> None:
        """Refuse a trainable parameter that an earlier patched module also owns (tied weights):
        each module's backward gives the norm of its own use, so a shared weight's per-example
        norm would miss the cross term between its two uses (GPT-2's tied lm_head: up to 1%)."""
        for pname, p in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            if p.requires_grad and (first := owners.setdefault(id(p), full)) != full:
                self.remove_hooks()
                raise ValueError(
                    f"bk clipping: parameter {full} is the same tensor as {first} (tied weights), so its "
                    "per-example gradient norm would be wrong; untie it before wrapping the model, e.g. "
                    "pipeline.models.base.untie_lm_head(model) for an lm_head tied to the input embedding"
                )

    def _keep(self, kept: _Kept) -> None:
        if not self._clipping:
            # The Functions above return no weight gradient: outside backward_clipped every
            # patched weight would keep .grad None and the optimizer would skip it silently.
            raise RuntimeError(
                "bk clipping: backward() ran outside GradSampleModuleBookKeeping.backward_clipped, so the "
                "weights would get no gradient; call dp_model.backward_clipped(per_example_loss) with the "
                "(B,) per-example losses instead of loss.backward()"
            )
        if self.hooks_enabled:
            self._kept.append(kept)

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def backward_clipped(self, per_example_loss: torch.Tensor) -> torch.Tensor:
        """One backward of Σᵢ ℓᵢ, then each trainable `.grad` = Σᵢ Cᵢ ∇ℓᵢ. Returns the
        factors C (B,). The per-example norms never leave this function (not private)."""
        self._kept.clear()
        self._clipping = True
        try:
            per_example_loss.sum().backward()
        finally:
            self._clipping = False
        kept, self._kept = self._kept, []
        norms = torch.stack([k.sq_norm for k in kept]).sum(0).sqrt()  # (B,)
        coef = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        # Layer by layer, dropping each layer's a and g as soon as its sums are formed: the
        # gradients grow while the kept activations shrink, so the peak stays near the larger
        # of the two instead of their sum.
        with torch.no_grad():
            while kept:
                sums = kept.pop(0).sums  # backward order: lm_head's large g goes first
                while sums:
                    param, weighted_sum = sums.pop()
                    grad = weighted_sum(coef).to(param.dtype)
                    del weighted_sum  # its closure holds the layer's a and g
                    param.grad = grad if param.grad is None else param.grad + grad
        return coef

    def remove_hooks(self) -> None:
        for module in self._patched:
            del module.forward  # the class's own forward again
        self._patched, self._kept = [], []

    def enable_hooks(self):
        self.hooks_enabled = True

    def disable_hooks(self):
        self.hooks_enabled = False



class _InPlaceNoise:
    """Opacus' fast-gradient-clipping optimizer step (accumulate, noise, scale) without its
    two full copies of the gradient: the clipped sum bk formed in `.grad` becomes
    `summed_grad` itself (Opacus deep-copies it), and the noise is added to it in place
    (Opacus allocates the noised sum anew). The same arithmetic and the same noise draws
    (Opacus' `_generate_noise`, through pipeline/privacy/noise.py's dispatcher), so the same
    update (tests/stages/test_teacher.py trains bk and ghost to the same weights); peak memory
    drops by up to twice the model's gradient size. Data-parallel ranks other than 0 add no
    noise, as in Opacus."""

    def accumulate(self):
        for p in self.params:
            if p.summed_grad is not None:
                p.summed_grad.add_(p.grad)
            else:
                p.summed_grad = p.grad  # no copy: zero_grad below only ever drops .grad

    def zero_grad(self, set_to_none: bool = False):
        super().zero_grad(True)  # never zero .grad in place: it may be this step's summed_grad

    def add_noise(self):
        if getattr(self, "rank", 0) != 0:  # DistributedDPOptimizerFastGradientClipping, rank > 0
            for p in self.params:
                p.grad = p.summed_grad.view_as(p)
            return
        std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier) * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            p.summed_grad.add_(fgc._generate_noise(std=std, reference=p.summed_grad, generator=self.generator,
                                                    secure_mode=self.secure_mode))
            p.grad = p.summed_grad.view_as(p)
            _mark_as_processed(p.summed_grad)


class _BookKeepingOptimizer(_InPlaceNoise, DPOptimizerFastGradientClipping):
    pass


class _DistributedBookKeepingOptimizer(_InPlaceNoise, DistributedDPOptimizerFastGradientClipping):
    pass


class BookKeepingPrivacyEngine(PrivacyEngine):
    """Opacus' PrivacyEngine, with `grad_sample_mode="bk"`: the model wrapped by
    GradSampleModuleBookKeeping, the optimizer Opacus' fast-gradient-clipping one (noise on
    the already clipped sum in `.grad`, DPDDP's all-reduce), everything else unchanged.
    make_private returns (module, optimizer, data_loader) for bk, as for hooks."""

    def _prepare_model(self, module, *, grad_sample_mode="hooks", max_grad_norm=1.0, loss_reduction="mean",
                       batch_first=True, **kwargs):
        if grad_sample_mode != BK:
            return super()._prepare_model(module, grad_sample_mode=grad_sample_mode, max_grad_norm=max_grad_norm,
                                          loss_reduction=loss_reduction, batch_first=batch_first, **kwargs)
        self.validate(module=module, optimizer=None, data_loader=None)
        return GradSampleModuleBookKeeping(module, batch_first=batch_first, loss_reduction=loss_reduction,
                                           max_grad_norm=max_grad_norm)

    def _prepare_optimizer(self, *, grad_sample_mode="hooks", **kwargs):
        optimizer = super()._prepare_optimizer(
            grad_sample_mode="ghost" if grad_sample_mode == BK else grad_sample_mode, **kwargs)
        if grad_sample_mode == BK:  # Opacus' ghost optimizer, with the copy-free step above
            optimizer.__class__ = (_DistributedBookKeepingOptimizer
                                   if isinstance(optimizer, DistributedDPOptimizerFastGradientClipping)
                                   else _BookKeepingOptimizer)
        return optimizer
