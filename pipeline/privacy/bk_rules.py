"""Which rule book-keeping clipping (pipeline/privacy/bk.py) clips each parameterised layer by,
decided by what the layer computes, never by its class name (CONVENTIONS 15; issues 35 and 62):

- a linear map x Wᵀ + b (nn.Linear's layout) or x W + b (GPT-2's Conv1D, W stored transposed):
  nn.Linear and Conv1D as they are; any other leaf module holding a 2-D `weight` (and a 1-D
  `bias`), such as Falcon's `FalconLinear` (`input @ self.weight.T + self.bias`), when its own
  forward, run on a small stand-in, gives that map (`_linear_kind`);
- an embedding lookup: nn.Embedding and its subclasses (a subclass's own forward kept);
- an elementwise scale y = c(x) + w ⊙ s(x) + b of the layer's `weight` w (and `bias` b, of w's
  shape), w of any shape that broadcasts over the input's trailing axes: norms (LayerNorm,
  RMSNorm's w·x̂, Gemma's (1+w)·x̂, Cohere's per-head norm of shape (heads, head_dim)) and a
  1-element gate x·w (ReZero), whose per-example gradient sums over every position and feature
  the gate scales (`_elementwise_kind`).

`bk_problems` is the same classification without wrapping: preflight calls it on a model built
on the meta device (the probes run on small float32 CPU stand-ins, never on the weights).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

# The rules, by what the layer computes (see the module docstring).
LINEAR, LINEAR_TRANSPOSED = "linear", "linear (W stored transposed)"
EMBEDDING, EMBEDDING_ROUTED = "embedding", "embedding (the subclass's own forward around the lookup)"
SCALE, ONE_PLUS_SCALE, AFFINE_SCALE = "w·s(x) + b", "(1+w)·s(x) + b", "c(x) + w·s(x) + b"

# Where a refusal (at wrap time or mid-training) sends the user: preflight decides, for every
# clipping mode, which can clip the model exactly (pipeline/privacy/clipping_modes.py).
WHICH_MODE = "`dpdistill plan` names the clipping mode (teacher.grad_sample_mode) that can train this model, if any"

# The linear probe's stand-in: W (OUT, IN) in nn.Linear's layout, (IN, OUT) in Conv1D's. Small,
# whatever the layer's size (a model's head may hold 300 M weights); the attributes a forward may
# read for its shapes are set to match (nn.Linear's in/out_features, Conv1D's nx/nf).
_PROBE_IN, _PROBE_OUT = 5, 4
_SHAPE_ATTRS = {"in_features": _PROBE_IN, "out_features": _PROBE_OUT, "nx": _PROBE_IN, "nf": _PROBE_OUT}


class UnsupportedLayer(Exception):
    """bk has no rule for a module; the message says why."""


def trainable_here(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def apply_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """x Wᵀ + b (nn.Linear's layout) or x W + b (Conv1D's, `transposed`): what bk's linear rule computes."""
    if not transposed:
        return F.linear(x, w, b)
    if b is None:
        return x @ w
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1)


def _stand_in(module: nn.Module, params: dict) -> nn.Module:
    """A shallow copy of `module` holding `params` (its own dict: the module is never modified),
    in training mode (a dropout inside fails the checks), whose class forward can be called."""
    probe = copy.copy(module)
    probe.__dict__.pop("forward", None)  # a module bk already patched: its class's forward
    probe.__dict__["_parameters"] = params
    probe.__dict__["training"] = True
    return probe


def _linear_kind(module: nn.Module) -> str:
    """LINEAR when the module's own forward computes x Wᵀ + b, LINEAR_TRANSPOSED when x W + b, W
    its 2-D `weight`, b its 1-D `bias` (or none); else UnsupportedLayer. Run on a stand-in with
    random W, b and input x (2, 3, 5), twice: equal to F.linear (or x W + b) to float32 rounding,
    and deterministic. Both layouts are tried where the shapes allow (a square weight)."""
    weight, bias = module.weight, module._parameters.get("bias")
    layouts = [t for t in (False, True)
               if bias is None or bias.shape[0] == weight.shape[1 if t else 0]]
    gen = torch.Generator().manual_seed(0)  # a fixed probe: the same verdict each time, global RNG untouched
    x = torch.randn(2, 3, _PROBE_IN, generator=gen)
    b = None if bias is None else torch.randn(_PROBE_OUT, generator=gen)
    failures = []
    for transposed in layouts:
        w = torch.randn(*((_PROBE_IN, _PROBE_OUT) if transposed else (_PROBE_OUT, _PROBE_IN)), generator=gen)
        probe = _stand_in(module, {k: (w if k == "weight" else b) for k in module._parameters})
        probe.__dict__.update({k: v for k, v in _SHAPE_ATTRS.items() if k in module.__dict__})
        want = apply_linear(x, w, b, transposed)
        try:
            with torch.no_grad():
                got, again = (type(module).forward(probe, x) for _ in range(2))
        except Exception as e:  # any failure means: not this rule (the message says what happened)
            failures.append(f"raised {type(e).__name__} ({e})")
            continue
        if (isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, again)
                and torch.allclose(got, want, rtol=1e-5, atol=1e-5)):
            return LINEAR_TRANSPOSED if transposed else LINEAR
        failures.append("gave another output")
    raise UnsupportedLayer(f"its forward is not the linear map x Wᵀ + b (or x W + b) of its 2-D weight: on a "
                           f"(2, 3, {_PROBE_IN}) probe it {' and '.join(failures)}")


def _affine_kind(probe: nn.Module, x: torch.Tensor, shape: tuple, has_bias: bool) -> str:
    """The elementwise rule of `probe` on input x, its weight (and bias) of `shape`: its forward at
    w = 0, 1 and a random r must give y(r) = y(0) + r ⊙ (y(1) − y(0)) to float32 rounding; y(0) = 0
    means c = 0 (w·x̂), y(0) = y(1) − y(0) means c = s ((1+w)·x̂)."""
    gen = torch.Generator().manual_seed(1)
    r, rb = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)

    def out(w, b=None):
        subs = {"weight": w} | ({"bias": torch.zeros(shape) if b is None else b} if has_bias else {})
        return torch.func.functional_call(probe, subs, (x,))

    try:
        with torch.no_grad():
            y0, y1, yr, y1_again = out(torch.zeros(shape)), out(torch.ones(shape)), out(r), out(torch.ones(shape))
            yb = out(torch.zeros(shape), rb) if has_bias else None
    except Exception as e:  # any failure means: not this rule (the message says what happened)
        raise UnsupportedLayer(f"not an elementwise scale c(x) + w·s(x) + b: its forward raised {type(e).__name__} "
                               f"on a {tuple(x.shape)} probe ({e})") from e
    if not all(isinstance(y, torch.Tensor) and y.shape == x.shape for y in (y0, y1, yr)):
        raise UnsupportedLayer("not an elementwise scale c(x) + w·s(x) + b: its output does not have its input's shape")
    s = y1 - y0
    tol = 1e-6 * (1 + max(y.abs().max().item() for y in (y0, y1, yr)))

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=tol)

    if not (torch.equal(y1, y1_again) and close(yr, y0 + r * s) and (yb is None or close(yb, y0 + rb))):
        raise UnsupportedLayer("not an elementwise scale c(x) + w·s(x) + b: its output is not affine in its weight "
                               "and bias, or not deterministic")
    if y0.abs().max() <= tol:
        return SCALE
    return ONE_PLUS_SCALE if close(y0, s) else AFFINE_SCALE


def _elementwise_kind(module: nn.Module) -> str:
    """SCALE, ONE_PLUS_SCALE or AFFINE_SCALE when `module` computes y = c(x) + w ⊙ s(x) + b in its
    `weight` w (and `bias` b of w's shape), else UnsupportedLayer. Found by running the module's
    own forward (on a float32 CPU copy: a model built on the meta device has no values) on a
    probe x (2, 3, *w.shape) (`_affine_kind`). A 1-element w (a gate x·w) broadcasts over any
    width: it is probed on a (2, 3, 4) input too, where its forward takes one, and must be the
    same rule there."""
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if (weight is None or weight.dim() == 0 or set(params) - {"weight", "bias"}
            or (bias is not None and bias.shape != weight.shape)
            or next(module.children(), None) is not None or next(module.buffers(), None) is not None):
        raise UnsupportedLayer("not a linear map, an embedding lookup, or an elementwise scale c(x) + w·s(x) + b of a "
                               "leaf module's weight (and a bias of its shape) without buffers")
    probe = copy.deepcopy(module)
    probe.__dict__.pop("forward", None)  # a module bk already patched: probe its class's forward
    if any(p.is_meta for p in probe.parameters()):
        probe = probe.to_empty(device="cpu")  # the values are substituted anyway
    probe = probe.to("cpu", torch.float32).train()  # train: a dropout inside fails the affinity check
    shape = tuple(weight.shape)
    gen = torch.Generator().manual_seed(0)  # a fixed probe: the same verdict each time, global RNG untouched
    kind = _affine_kind(probe, torch.randn(2, 3, *shape, generator=gen) * 2 + 0.5, shape, bias is not None)
    if weight.numel() == 1:
        wide = torch.randn(2, 3, 4, generator=gen) * 2 + 0.5  # non-zero mean: a norm centres it
        try:
            with torch.no_grad():
                torch.func.functional_call(probe, {"weight": torch.ones(shape)}, (wide,))
        except Exception:  # the layer takes inputs of width 1 only: nothing to broadcast over
            return kind
        if _affine_kind(probe, wide, shape, bias is not None) != kind:
            raise UnsupportedLayer("not an elementwise scale c(x) + w·s(x) + b: its 1-element weight is not the same "
                                   "rule at another input width")
    return kind


def layer_rule(module: nn.Module) -> str:
    """The rule bk clips `module`'s own trainable parameters by (LINEAR, ..., AFFINE_SCALE);
    raises UnsupportedLayer with the reason when there is none."""
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise UnsupportedLayer("an embedding with max_norm, sparse or scale_grad_by_freq")
        return EMBEDDING if type(module).forward is nn.Embedding.forward else EMBEDDING_ROUTED
    if type(module).forward is nn.Linear.forward:
        return LINEAR
    if type(module).forward is Conv1D.forward:
        return LINEAR_TRANSPOSED
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if (weight is not None and weight.dim() == 2 and not set(params) - {"weight", "bias"}
            and (bias is None or bias.dim() == 1) and next(module.children(), None) is None
            and next(module.buffers(), None) is None):
        try:
            return _linear_kind(module)
        except UnsupportedLayer as not_linear:
            try:  # a 2-D weight may still scale elementwise (Cohere's per-head norm)
                return _elementwise_kind(module)
            except UnsupportedLayer:
                raise not_linear from None
    return _elementwise_kind(module)


def problem_line(name: str, module: nn.Module, reason: str) -> str:
    return f"{name or 'the model'} ({type(module).__name__}): {reason}"


def bk_problems(model: nn.Module) -> list[str]:
    """One line per module with trainable parameters of its own that bk clipping has no rule
    for, naming its path, its class and the reason; [] when bk has a rule for every layer of
    the model as it stands (its trainable parameters now: apply LoRA or BiTFiT first). Patches
    nothing and runs no backward; works on a model built on the meta device. How the layers
    are used (a weight also used outside its module, tied weights, a reshaped batch) is
    checked by running one step: pipeline/privacy/clipping_modes.py."""
    problems = []
    for name, module in model.named_modules():
        if trainable_here(module):
            try:
                layer_rule(module)
            except UnsupportedLayer as e:
                problems.append(problem_line(name, module, str(e)))
    return problems
