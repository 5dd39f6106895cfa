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
   a (B, T, V) one-hot. The norm weights' and the biases' per-example gradients are
   d-vectors: formed in the backward and reweighted.
3. On a CUDA GPU, linear layers run in bf16 keep a and g in bf16 and the products run on the
   16-bit units with fp32 products and sums (exact per product). The clipped sum applies
   each Cᵢ inside one product, after each example's block of it (pipeline/privacy/bk_kernel.py,
   Triton): exact to fp32 rounding, no bound of its own. Without Triton the rescaled factor Cᵢaᵢ, which
   is not a bf16 value, is split into two bf16 terms, and the split's bound
   (2⁻¹⁵‖aᵢ‖_F‖gᵢ‖_F, summed over a weight's calls, squared and summed over weights) is
   added to ‖∇ℓᵢ‖ before Cᵢ is formed, so each example's part stays within C
   (`_MatmulUse.weighted_sum`). Either way each norm is raised by 2⁻¹³ (BF16_NORM_MARGIN):
   norms from bf16 products summed on the 16-bit units read low. Elsewhere a and g are upcast
   once and everything runs in fp32, as Opacus' formula says.

The result lands in `p.grad` as Σᵢ Cᵢ ∇ℓᵢ, exactly what Opacus' fast-gradient-clipping
optimizers expect after ghost clipping's second backward, so Opacus' sampling, accountant,
noise and optimizer (DPDDP's too) are used unchanged: `BookKeepingPrivacyEngine` is
Opacus' PrivacyEngine with `grad_sample_mode="bk"` mapped to this module and to the
ghost-clipping optimizer.

Layers are matched on what they compute, not on their class name (issues 35 and 62), so that
every decoder family (tests/families.py: GPT-2, Llama, Qwen2, Mistral, Gemma, GPT-NeoX, Phi-3,
OPT, Falcon, StableLM, Cohere, OLMo-2, Granite, StarCoder2, Qwen3, Gemma 2 and 3) runs without
a rule of its own (pipeline/privacy/bk_rules.py says which rule each layer gets):

- linear maps: nn.Linear (peft's LoRA adapters are nn.Linear), GPT-2's Conv1D (the same map,
  W stored transposed), and any leaf module with a 2-D weight whose own forward, run on a small
  stand-in, computes one of the two (Falcon's FalconLinear);
- embedding lookups: nn.Embedding and its subclasses. A subclass with a forward of its own
  (OPT's learned positions, Gemma's √d-scaled embedding) keeps it: only the lookup it
  reaches through `super().forward` is bk's (see `_RoutedLookup`);
- elementwise scales of a leaf module's `weight` (and a `bias` of its shape),
  y = c(x) + w ⊙ s(x) + b, w broadcast over the input's trailing axes: LayerNorm with or
  without bias, RMSNorm as w·x̂ (Llama, Qwen2, Mistral, Phi-3; c = 0) and as (1+w)·x̂ (Gemma;
  c = s), a per-head norm, a 1-element gate x·w. Found by running the module's own forward at
  w = 0, 1 and a random value and checking that the output is affine in w, so a new norm
  class with the same arithmetic needs nothing here. At run time s(x) (and c(x) for the
  general form) come from that same forward with w = 1 or 0 substituted, so the dtype and
  the fp32 upcasts are the module's own.

Anything else with trainable parameters of its own is refused by name and class before any
patching (`bk_problems`, which preflight calls on a model built on the meta device, before it
runs one step of every clipping mode there: pipeline/privacy/clipping_modes.py). The autograd
Functions and the per-use norms are in pipeline/privacy/bk_layers.py; this module wraps the
model with them and forms the clipped sums.

Exactness guards, each found by an independent check (issue 35):
- a module called more than once in one forward (a reused layer, an adapter applied twice):
  each call keeps its own factors, and a parameter's per-example norm is that of the SUM of
  its calls' gradients, ‖Σⱼ ∇ⱼ‖² = Σⱼ‖∇ⱼ‖² + 2Σⱼ<ₖ⟨∇ⱼ, ∇ₖ⟩, the cross terms formed
  ghost-style like the norms (`Use.dot`);
- a patched parameter also used outside its layer (F.linear(x, layer.weight) elsewhere):
  autograd would add that use's gradient to `.grad` unclipped, so `backward_clipped` runs its
  backward with every `.grad` set aside and refuses any that autograd filled;
- a trainable parameter shared by two layers (tied weights): an input embedding tied to the
  linear output head (GPT-2, Llama 3.2, Qwen2.5, SmolLM2, Gemma) gets the norm of the sum of
  both uses' gradients, the cross term from the head's logit gradients at the looked-up ids
  (`_lookup_head_dot`); any other sharing is refused at wrap time. The pipeline unties lm_head
  unless `teacher.untie_lm_head=false` (pipeline.models.base.untie_lm_head).
The weights' gradients exist only after `backward_clipped`; a plain `loss.backward()` on the
wrapped model is an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from opacus import PrivacyEngine
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from opacus.optimizers import DistributedDPOptimizerFastGradientClipping, DPOptimizerFastGradientClipping
from opacus.optimizers import optimizer_fast_gradient_clipping as fgc
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch import nn

from pipeline.devices import ieee_fp32_products
from pipeline.privacy import noise
from pipeline.privacy.bk_layers import (BF16_NORM_MARGIN, SPLIT_ERROR, Keep, SquaredNorms, Use, elementwise_forward,
                                        embedding_forward, linear_forward, routed_class)
from pipeline.privacy.bk_rules import (EMBEDDING, EMBEDDING_ROUTED, LINEAR, LINEAR_TRANSPOSED, WHICH_MODE,
                                       UnsupportedLayer, layer_rule, problem_line, trainable_here)

BK = "bk"


class GradSampleModuleBookKeeping(AbstractGradSampleModule):
    """Opacus' GradSampleModule contract for `grad_sample_mode="bk"`: wraps the model, and
    after `backward_clipped(per_example_loss)` every trainable parameter's `.grad` holds
    Σᵢ Cᵢ ∇ℓᵢ (Cᵢ = min(1, max_grad_norm / (‖∇ℓᵢ‖ + 1e-6)), with bf16 factors on a GPU
    ‖∇ℓᵢ‖ plus the split's bound: point 3 above)."""

    def __init__(self, m: nn.Module, *, batch_first=True, loss_reduction="mean", strict=True,
                 max_grad_norm: float = 1.0, **_):
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        self.max_grad_norm = max_grad_norm
        self.hooks_enabled = True
        self._kept: list[tuple[str, nn.Parameter, Use]] = []
        self._undo: list[Callable[[], None]] = []  # restores each patched module
        self.per_sample_gradient_norms: torch.Tensor | None = None
        self._clipping = False  # True only inside backward_clipped: the one backward bk supports
        rules, problems = {}, []
        for name, module in m.named_modules():  # the same classification as bk_problems
            if trainable_here(module):
                try:
                    rules[name] = layer_rule(module)
                except UnsupportedLayer as e:
                    problems.append(problem_line(name, module, str(e)))
        if problems:  # refused before anything is patched
            raise NotImplementedError("bk clipping has no rule for " + (
                problems[0] if len(problems) == 1 else f"{len(problems)} modules:\n" + "\n".join(problems))
                + f"\n({WHICH_MODE})")
        self._check_shared_weights(m, rules)
        for name, module in m.named_modules():
            if name in rules:
                self._patch(module, rules[name], self._keep_for(name))

    @staticmethod
    def _check_shared_weights(m: nn.Module, rules: dict[str, str]) -> None:
        """Accept a trainable parameter that two patched modules own only as an input embedding
        tied to a linear output head (nn.Linear's layout): its per-example norm is that of the
        sum of both uses' gradients, the cross term formed by `_lookup_head_dot`. Refuse any other
        sharing (each module's backward sees only its own use, and no cross term is formed)."""
        owners: dict[int, list[tuple[str, str]]] = {}  # id(trainable parameter) -> [(name, rule)]
        for name, module in m.named_modules():
            if name not in rules:
                continue
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    owners.setdefault(id(p), []).append((f"{name}.{pname}" if name else pname, rules[name]))
        for uses in owners.values():
            kinds = sorted(rule for _, rule in uses)
            if len(uses) > 1 and not (len(uses) == 2 and kinds[0] in (EMBEDDING, EMBEDDING_ROUTED)
                                      and kinds[1] == LINEAR):
                (full, _), (first, _) = uses[-1], uses[0]
                raise ValueError(
                    f"bk clipping: parameter {full} is the same tensor as {first} (tied weights), and only an "
                    "input embedding tied to a linear output head is clipped over both uses; untie it before "
                    "wrapping the model, e.g. pipeline.models.base.untie_lm_head(model)"
                )

    def _patch(self, module: nn.Module, rule: str, keep: Keep) -> None:
        if rule == EMBEDDING_ROUTED:
            cls = type(module)
            module.__class__ = routed_class(cls)
            module._bk_keep = keep

            def undo():
                module.__class__ = cls
                del module._bk_keep
            self._undo.append(undo)
            return
        if rule in (LINEAR, LINEAR_TRANSPOSED):
            module.forward = linear_forward(module, keep, transposed=rule == LINEAR_TRANSPOSED)
        elif rule == EMBEDDING:
            module.forward = embedding_forward(module, keep)
        else:
            module.forward = elementwise_forward(module, rule, keep)
        self._undo.append(lambda: delattr(module, "forward"))  # the class's own forward again

    def _keep_for(self, name: str) -> Keep:
        def keep(uses: list) -> None:
            if not self._clipping:
                # The Functions above return no weight gradient: outside backward_clipped every
                # patched weight would keep .grad None and the optimizer would skip it silently.
                raise RuntimeError(
                    "bk clipping: backward() ran outside GradSampleModuleBookKeeping.backward_clipped, so the "
                    "weights would get no gradient; call dp_model.backward_clipped(per_example_loss) with the "
                    "(B,) per-example losses instead of loss.backward()"
                )
            if self.hooks_enabled:
                self._kept.extend((name, param, use) for param, use in uses)
        return keep

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def backward_clipped(self, per_example_loss: torch.Tensor) -> torch.Tensor:
        """One backward of Σᵢ ℓᵢ, then each trainable `.grad` += Σᵢ Cᵢ ∇ℓᵢ. Returns the
        factors C (B,). The per-example norms never leave this function (not private)."""
        if not self.hooks_enabled:  # nothing would be kept: every weight left without a gradient
            raise RuntimeError("bk clipping: backward_clipped with hooks disabled; call enable_hooks() first")
        if per_example_loss.dim() != 1:
            raise ValueError(f"bk clipping: backward_clipped takes the (B,) per-example losses, got a "
                             f"{per_example_loss.dim()}-D tensor")
        batch = per_example_loss.shape[0]
        trainable = [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]
        # Set every .grad aside (physical batches of one logical batch accumulate there): after
        # the backward, any .grad that is not None was filled by autograd outside bk's layers.
        earlier = [p.grad for _, p in trainable]
        for _, p in trainable:
            p.grad = None
        self._kept.clear()
        self._clipping = True
        try:
            per_example_loss.sum().backward()
        finally:
            self._clipping = False
            kept, self._kept = self._kept, []
            bypassed = [n for n, p in trainable if p.grad is not None]
            for (_, p), grad in zip(trainable, earlier):
                p.grad = grad
        if bypassed:
            raise RuntimeError(
                f"bk clipping: autograd reached {', '.join(bypassed)} outside the layer bk clips it in (the "
                "parameter is also used directly, e.g. F.linear(x, layer.weight) in another module's forward), "
                "so that gradient would be added unclipped and break the DP guarantee; use each trainable "
                "parameter only through its own module, or freeze it (no clipping mode clips such a use: ghost's "
                "norms would miss it, hooks would drop its gradient)"
            )
        # Autocast off and fp32 products in full fp32 whoever calls: under autocast matmul and bmm
        # would form the norms and sums in bf16, under TF32 (or oneDNN's bf16 mode on a CPU) with a
        # 10-bit (8-bit) significand, and a norm rounded down clips by less than C.
        device = per_example_loss.device.type  # meta: preflight's dry run, which has no autocast
        no_autocast = contextlib.nullcontext() if device == "meta" else torch.autocast(device, enabled=False)
        with torch.no_grad(), no_autocast, ieee_fp32_products():
            sq, split_sq = _per_example_sq_norms(kept, batch, per_example_loss.device)  # (B,) each
            # With bf16 factors each example's clipped part may exceed Cᵢ‖∇ℓᵢ‖ by the split's error,
            # at most Cᵢ·SPLIT_ERROR·√(split_sq) (_MatmulUse.weighted_sum): clip by the sum of the two.
            norms = sq.sqrt() + SPLIT_ERROR * split_sq.sqrt()
            if any(use.bf16 for _, _, use in kept):
                norms = norms * (1 + BF16_NORM_MARGIN)  # bf16 factors' norms read low (bk_layers)
            coef = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            # Call by call, dropping each call's a and g as soon as its sums are formed: the
            # gradients grow while the kept activations shrink, so the peak stays near the larger
            # of the two instead of their sum. Backward order: lm_head's large g goes first.
            while kept:
                _, param, use = kept.pop(0)
                grad = use.weighted_sum(coef).to(param.dtype)
                del use  # it holds the call's a and g
                param.grad = grad if param.grad is None else param.grad + grad
        return coef

    def remove_hooks(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo, self._kept = [], []

    def enable_hooks(self):
        self.hooks_enabled = True

    def disable_hooks(self):
        self.hooks_enabled = False


def _per_example_sq_norms(kept: list, batch: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """‖∇ℓᵢ‖² (B,) over every trainable parameter, and the split error's squared scale (B,),
    zero unless a layer kept bf16 factors. A parameter with several calls in the forward
    (a reused module) gets the norm of the sum of its calls' gradients: Σⱼ‖∇ⱼ‖² + 2Σⱼ<ₖ⟨∇ⱼ, ∇ₖ⟩."""
    norms = SquaredNorms(batch, device)
    calls: dict[int, list[Use]] = {}  # id(parameter) -> its calls' uses, in backward order
    for name, param, use in kept:
        use.by_example(batch, name)
        use.add_sq(norms)
        calls.setdefault(id(param), []).append(use)
    for uses in calls.values():
        for j in range(1, len(uses)):
            for k in range(j):
                norms.add(2 * uses[j].dot(uses[k]))
        # The split errors of one parameter's calls land on the same entries: their bounds add;
        # different parameters' errors are orthogonal: their squares add.
        if bounds := [b for use in uses if (b := use.split_bound()) is not None]:
            norms.split_sq.add_(sum(bounds).square())
    return norms.total(), norms.split_sq


class _InPlaceNoise:
    """Opacus' fast-gradient-clipping optimizer step (accumulate, noise, scale) without its
    two full copies of the gradient: the clipped sum bk formed in `.grad` becomes
    `summed_grad` itself (Opacus deep-copies it), and the noise is added to it in place
    (Opacus allocates the noised sum anew; on a CPU pipeline/privacy/noise.py add_gaussian_
    also skips the draw's own temporaries). The same arithmetic and the same noise draws
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
            if std != 0 and noise.cpu_draw(self.generator, p.summed_grad, self.secure_mode):
                noise.add_gaussian_(p.summed_grad, std, self.generator)  # Opacus' draw, no temporaries
            else:
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
