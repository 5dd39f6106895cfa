"""Which clipping modes can clip a model exactly, decided before any stage runs (issue 62).

    found = mode_problems(model)                 # {"bk": [...], "ghost": [...], "hooks": [...]}
    found["ghost"]                               # [] where the mode clips every example to C exactly
    advice(found, "ghost")                       # "use teacher.grad_sample_mode=bk", or that none can

The model is the one the DP-SGD stage will wrap (untied, LoRA or BiTFiT applied), built on the
meta device by preflight (no weights, no memory; a model with values works too). Three checks,
each asking the code that will run where it can:

1. its layers: bk's rules (pipeline/privacy/bk_rules.py); Opacus refuses a trainable layer that
   holds buffers, and its hooks detach every positional input, so a forward taking numbers fails;
2. one forward, traced (`_Trace`): every use of a trainable parameter and the modules running
   when it happens, every call of each layer, and every in-place change of a layer's output
   (Falcon's `mlp_output += attention_output`: Opacus' hooks return each output as a view that
   autograd forbids modifying in place). A weight also used outside its module
   (F.linear(x, layer.weight) in another module's forward) is refused in every mode: bk would
   refuse it at the first step, after the data stages (it sets every .grad aside and finds one
   filled); ghost clipping's norms miss that use while its second backward adds it, so examples
   are clipped to more than C (issue 62 measured 1.002·C) under a ledger that says C; Opacus'
   per-sample hooks miss it and its gradient is dropped. A parameter of a layer Opacus has a norm
   sampler for (Linear, Embedding, Conv1D, LayerNorm) used by more than one call: ghost refuses it
   at run time ("Parameter tying is not supported with Ghost Clipping");
3. one DP-SGD step of the mode, wrapped as the teacher stage wraps it (BookKeepingPrivacyEngine's
   make_private, dpsgd.CLIPPING, the optimizer's step) on a (3, 5) batch: whatever the mode's own
   code raises is refused, naming the innermost layer the error came from (Falcon adds in place
   to an output that Opacus' hooks return as a view; a batch reshaped inside bk's layers). On the
   meta device ghost's own step cannot run (Opacus' embedding norm sampler calls torch.unique,
   which needs values): ghost is checked by the hooks step, which wraps every layer the same way,
   and by check 2's rule for its norm samplers.

Every problem line names the layer, its class and why; `advice` names a mode that can, or says
that none can. Advice never points to a mode that would accept the model inexactly.
"""

from __future__ import annotations

import copy
import inspect
import logging
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, TensorDataset

from pipeline.privacy import accountant  # noqa: F401  (registers the Conv1D and LayerNorm samplers)
from pipeline.privacy.bk import BookKeepingPrivacyEngine
from pipeline.privacy.bk_rules import bk_problems, problem_line, trainable_here
from pipeline.privacy.dpsgd import CLIPPING

log = logging.getLogger(__name__)

MODES = ("bk", "ghost", "hooks")  # advice's order: one backward, two, per-sample gradients
BATCH, LENGTH = 3, 5  # the dry run's batch: B·T = 15 tells a reshaped batch from B

_OUTSIDE = {  # what each mode would do with a weight also used outside its module
    "bk": "bk would refuse it at the first step, after the data stages",
    "ghost": "ghost clipping's norms would miss that use while its second backward adds it: examples "
             "clipped to more than teacher.max_grad_norm, under a ledger that says otherwise",
    "hooks": "Opacus' per-sample gradients would miss that use and drop its gradient",
}
_HINTS = {  # errors whose cause is worth a sentence of ours
    "BackwardHookFunction": "its forward modifies in place the output of a layer Opacus hooks, which Opacus' "
                            "hooks return as a view that autograd forbids modifying in place",
}
_INPLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__iand__",
            "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}


def mode_problems(model: nn.Module, modes=MODES) -> dict[str, list[str]]:
    """{mode: one line per layer the mode cannot clip exactly}; [] where it can."""
    found = {mode: _layer_problems(model, mode) for mode in modes}
    trace = _Trace.run(model)
    if isinstance(trace, str):  # the model's own forward failed: no mode can run it
        return {mode: found[mode] or [trace] for mode in modes}
    for mode in modes:
        if trace is not None and not found[mode]:
            found[mode] = trace.problems(mode)
        if trace is not None and not found[mode]:
            with _attention(model, trace.attention):  # the step runs as the trace ran, on the same batch
                if failed := _dry_run(model, mode, trace.inputs):
                    found[mode] = [failed]
    return found


def advice(found: dict[str, list[str]], mode: str) -> str:
    """What to set instead of `mode`: the first other mode `found` has no problem for, else that
    no mode can (each problem line says what to change in the model)."""
    able = [m for m in MODES if m != mode and m in found and not found[m]]
    if able:
        return f"use teacher.grad_sample_mode={able[0]}" + "".join(f" (or {m})" for m in able[1:])
    return "no clipping mode can train it as it stands: change or freeze the layers named"


def _layer_problems(model: nn.Module, mode: str) -> list[str]:
    if mode == "bk":
        return bk_problems(model)
    return [problem_line(n, m, why) for n, m in model.named_modules()
            if trainable_here(m) and (why := _opacus_problem(m))]


def _opacus_problem(module: nn.Module) -> str | None:
    """Why Opacus' hooks (ghost and hooks clipping) cannot wrap this trainable layer. They compute
    per-sample gradients of any layer (functorch for unknown ones), but refuse a layer holding
    buffers (Gemma's scaled embedding), and detach every positional input of the layer, so one
    whose forward takes numbers (OPT's learned positions: a mask and an int offset) fails."""
    if next(module.buffers(), None) is not None:
        return "a trainable layer holding buffers, which Opacus refuses"
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    if any(p.annotation in (int, float, bool, "int", "float", "bool") for p in params):
        return "its forward takes numbers beside tensors, which Opacus' hooks cannot detach"
    return None


def _batch(model: nn.Module, masked: bool = True) -> dict[str, torch.Tensor]:
    """The teacher stage's inputs (pipeline/batching.py lm_batch), (BATCH, LENGTH) of token 0."""
    device = next(model.parameters()).device
    ids = torch.zeros(BATCH, LENGTH, dtype=torch.long, device=device)
    return {"input_ids": ids, "position_ids": torch.arange(LENGTH, device=device).expand(BATCH, LENGTH).contiguous(),
            **({"attention_mask": torch.ones_like(ids)} if masked else {})}


@contextmanager
def _attention(model: nn.Module, implementation: str | None):
    """The model with another attention implementation for the block (None: as it is)."""
    before = getattr(model.config, "_attn_implementation", None)
    if implementation is None or before == implementation or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _per_example(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out  # (B, T, V)
    return logits.float().mean(tuple(range(1, logits.dim())))  # (B,)


class _Trace(TorchFunctionMode):
    """One forward of the model seen from inside: which of its modules are running (global forward
    hooks) when a trainable parameter is used (a torch function taking it whose result carries
    its gradient), how many calls of the layers owning each parameter there are, and which
    module modifies a trainable layer's output in place."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.names: dict[int, str] = {}
        self.owners: dict[int, tuple[str, set[int]]] = {}  # id(parameter) -> (its name, ids of its owners)
        self.norm_sampled: set[int] = set()  # ids of parameters owned by a layer with a ghost norm sampler
        for name, m in model.named_modules(remove_duplicate=False):
            self.names.setdefault(id(m), name)
            for pname, p in m.named_parameters(recurse=False):
                if p.requires_grad:
                    self.owners.setdefault(id(p), (f"{name}.{pname}" if name else pname, set()))[1].add(id(m))
                    if type(m) in GradSampleModuleFastGradientClipping.NORM_SAMPLERS:
                        self.norm_sampled.add(id(p))
        self.modules = {id(m): m for m in model.modules()}
        self.stack: list[int] = []
        self.calls: Counter = Counter()  # id(parameter) -> calls of the layers owning it
        self.outside: dict[str, int | None] = {}  # parameter name -> id of the module that used it
        self.outputs: dict[int, tuple[torch.Tensor, int]] = {}  # id(output) -> (it, id of the trainable layer)
        self.modified: dict[int, int | None] = {}  # id(trainable layer) -> id of the module changing its output
        self.inputs: dict[str, torch.Tensor] = {}  # the batch that ran: the dry run's too
        self.attention: str | None = None  # the attention implementation it ran with (None: the model's)

    @classmethod
    def run(cls, model: nn.Module) -> _Trace | str | None:
        """The trace of one forward; a problem line if the forward raised; None (and a warning)
        if it could not run on the meta device for want of values. There, transformers' sdpa mask
        asks whether every position is real (`padding_mask.all()`), a value the device lacks: the
        forward is tried again with eager attention (GPT-2, Llama, ...), then without
        attention_mask (GPT-2 then asks whether a padding id is in the batch, a value too). Each
        calls the same parameterised layers the same way: attention's kernel holds no weight."""
        tries = ((True, None), (True, "eager"), (False, None))
        for masked, attention in tries:
            trace = cls(model)
            trace.attention = attention
            try:
                with _attention(model, attention):
                    trace.inputs = _batch(model, masked)
                    trace._forward(model)
                return trace
            except Exception as e:
                error = e
                if "meta" not in str(e).lower():
                    return (f"{_where(e, model)}: the model's forward failed on a batch shaped as the teacher's "
                            f"(input_ids, attention_mask, position_ids of ({BATCH}, {LENGTH})): {_first_line(e)}")
        log.warning("preflight could not run %s on the meta device (%s: %s); its clipping is checked when the "
                    "teacher stage wraps it", type(model).__name__, type(error).__name__, error)
        return None

    def _forward(self, model: nn.Module) -> None:
        was_training = model.training
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self._enter)
        post = torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True)
        try:
            with torch.enable_grad(), self:
                model.train()(**self.inputs)
        finally:
            pre.remove()
            post.remove()
            model.train(was_training)

    def _enter(self, module, args):
        if id(module) in self.names:
            self.stack.append(id(module))
            for p in module.parameters(recurse=False):
                if id(p) in self.owners:
                    self.calls[id(p)] += 1

    def _leave(self, module, args, out):
        if self.stack and self.stack[-1] == id(module):
            self.stack.pop()
        if id(module) in self.names and trainable_here(module):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.outputs[id(t)] = (t, id(module))  # held: no other tensor takes its id

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) in self.owners:
                name, owners = self.owners[id(leaf)]
                if not owners.intersection(self.stack) and _carries_grad(out):
                    self.outside.setdefault(name, self.stack[-1] if self.stack else None)
        name = getattr(func, "__name__", "")
        if (name in _INPLACE or (name.endswith("_") and not name.startswith("_")) or (kwargs or {}).get("inplace")) \
                and args and isinstance(args[0], torch.Tensor):
            for t in (args[0], args[0]._base):
                if (seen := self.outputs.get(id(t))) is not None and seen[0] is t:
                    self.modified.setdefault(seen[1], self.stack[-1] if self.stack else None)
        return out

    def problems(self, mode: str) -> list[str]:
        """What this forward shows `mode` cannot clip exactly (the module docstring's check 2)."""
        lines = []
        for name, user in self.outside.items():
            lines.append(f"{name}: used outside its module, by {self._name(user)}; {_OUTSIDE[mode]}; use the "
                         "weight only by calling its module, or freeze it")
        if mode != "bk":
            for layer, user in self.modified.items():
                lines.append(f"{self._name(layer)}: its output is modified in place by {self._name(user)}, and "
                             "Opacus' hooks return each layer's output as a view that autograd forbids modifying in "
                             "place: the teacher stage would fail at its first step")
        if mode == "ghost":
            tied: dict[int, list[str]] = {}  # id(layer) -> its parameters used by more than one call
            for pid, n in self.calls.items():
                if n > 1 and pid in self.norm_sampled:
                    name, owners = self.owners[pid]
                    tied.setdefault(min(owners, key=self.names.__getitem__), []).append(f"{name} ({n} calls)")
            for layer, uses in tied.items():
                lines.append(f"{self._name(layer)}: {', '.join(uses)} in one forward (a layer called again, or a "
                             "weight tied to another), which Opacus' ghost clipping refuses at its first step (its "
                             "norm sampler sees one call)")
        return lines

    def _name(self, module_id: int | None) -> str:
        if module_id is None:
            return "a function outside every module"
        return f"{self.names[module_id] or 'the model'} ({type(self.modules[module_id]).__name__})"


def _carries_grad(out) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(out))


def _dry_run(model: nn.Module, mode: str, inputs: dict) -> str | None:
    """What one DP-SGD step of `mode` raises on a copy of the model, wrapped as the teacher stage
    wraps it (σ = 0, nothing learned), as a problem line; None when the step runs. Ghost runs the
    hooks step (the module docstring's check 3 says why)."""
    step = "hooks" if mode == "ghost" else mode
    model = copy.deepcopy(model)  # wrapping patches or hooks it
    params = [p for p in model.parameters() if p.requires_grad]
    loader = DataLoader(TensorDataset(torch.zeros(2 * BATCH, 1)), batch_size=BATCH)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus' secure-RNG and full-backward-hook warnings
            made = BookKeepingPrivacyEngine(accountant="rdp").make_private(
                module=model, optimizer=torch.optim.SGD(params, lr=0.0), data_loader=loader, noise_multiplier=0.0,
                max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=step)
            dp_model, optimizer = made[0], made[1]
            CLIPPING[step](dp_model, optimizer, _per_example(dp_model.train()(**inputs)))
            optimizer.step()
    except Exception as e:
        hint = next((h for key, h in _HINTS.items() if key in str(e)), None)
        runs = "bk clipping" if step == "bk" else "Opacus' hooks (ghost and hooks clipping wrap layers alike)"
        return (f"{_where(e, model)}: {hint + '; ' if hint else ''}{runs} failed in one DP-SGD step (σ = 0, as "
                f"preflight builds the model): {_first_line(e)}")
    return None


def _where(error: Exception, model: nn.Module) -> str:
    """The innermost layer of `model` running where `error` was raised, as "path (Class)": a
    frame of its forward (`self`) or of a function handed it (`module`, `layer`)."""
    names = {id(m): n for n, m in model.named_modules()}
    for frame, _ in reversed(list(traceback.walk_tb(error.__traceback__))):
        for key in ("self", "module", "layer"):
            value = frame.f_locals.get(key)
            if isinstance(value, nn.Module) and id(value) in names:
                return f"{names[id(value)] or 'the model'} ({type(value).__name__})"
    return f"the model ({type(model).__name__})"


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"
