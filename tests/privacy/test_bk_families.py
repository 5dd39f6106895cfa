"""Book-keeping clipping on every decoder family (issue 35 items 1, 2, 6).

bk's clipped gradient sum Σᵢ Cᵢ ∇ℓᵢ against an independent reference: each example's
gradient from torch.func (functional_call + vmap(grad) over the examples, none of bk's
code), clipped with Opacus' factor Cᵢ = min(1, C / (‖∇ℓᵢ‖ + 1e-6)) and summed. Also the
preflight check, the elementwise rules found by probing, a module called twice in one
forward (exact), and a parameter used outside its module (refused)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from families import CLIPPING_FAMILIES, FAMILIES
from per_example import TEXTS, assert_clipped_sums_equal
from per_example import batch as _batch
from per_example import clipped_sum as _clipped_sum
from per_example import lm_loss as _lm_loss
from per_example import per_example_grads as _per_example_grads
from pipeline.models.base import untie_lm_head
from pipeline.privacy import bk_layers as bk
from pipeline.privacy import bk_rules
from pipeline.privacy.bk import GradSampleModuleBookKeeping
from pipeline.privacy.bk_rules import bk_problems, layer_rule
from pipeline.models.losses import per_sequence_loss

ROOT = Path(__file__).resolve().parents[2]


def _assert_clipped_sums_equal(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    assert_clipped_sums_equal({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, want)


TIED = [f for f in CLIPPING_FAMILIES if CLIPPING_FAMILIES[f](8).config.tie_word_embeddings]  # as each builds it


@pytest.mark.parametrize("family", list(FAMILIES) + [f"{f}-tied" for f in TIED])
def test_bk_equals_an_independent_per_example_reference(tiny_tokenizer, family):
    """`-tied`: the family's lm_head left tied to its input embedding (teacher.untie_lm_head=false),
    one weight with two uses: the reference's per-example gradient of that weight is the sum of
    both (torch.func differentiates the one tensor), and bk must clip by its norm. Every family
    untied, in every clipping mode: tests/privacy/test_clipping_modes.py."""
    model = CLIPPING_FAMILIES[family.removesuffix("-tied")](len(tiny_tokenizer))
    if family.endswith("-tied"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    else:
        untie_lm_head(model)
    model.train()
    batch, labels = _batch(tiny_tokenizer)
    grads = _per_example_grads(model, _lm_loss, batch["input_ids"], batch["attention_mask"],
                               batch["position_ids"], labels)
    norms = _clipped_sum(grads, 1.0)[2]
    max_grad_norm = norms.median().item()  # between the norms: some examples clipped, some not
    want, coef, _ = _clipped_sum(grads, max_grad_norm)
    classes = {name: type(m) for name, m in model.named_modules()}

    dp_model = GradSampleModuleBookKeeping(model, max_grad_norm=max_grad_norm)
    got_coef = dp_model.backward_clipped(per_sequence_loss(dp_model(**batch).logits, labels))
    assert (got_coef < 1).any() and (got_coef == 1).any(), got_coef
    torch.testing.assert_close(got_coef, coef, rtol=1e-5, atol=0)
    _assert_clipped_sums_equal(model, want)
    dp_model._close()
    assert {name: type(m) for name, m in model.named_modules()} == classes  # OPT's, Gemma's embeddings too
    assert not any("forward" in vars(m) or "_bk_keep" in vars(m) for m in model.modules())


def test_preflight_accepts_every_family_even_on_the_meta_device():
    """bk_problems is what preflight calls before any stage: no weights needed (the norms are
    probed on tiny CPU copies), nothing patched."""
    for family, build in CLIPPING_FAMILIES.items():
        with torch.device("meta"):
            model = build(300)
        assert bk_problems(model) == [], family
        assert not any("forward" in vars(m) for m in model.modules())


def test_the_norms_are_told_apart_by_their_arithmetic():
    """One probed rule: Llama-like RMSNorm is w·x̂ (c = 0), Gemma's is (1+w)·x̂ (c = s),
    LayerNorm with or without bias is w·x̂ + b, a module adding its input is c + w·s."""
    assert layer_rule(FAMILIES["llama"](300).model.norm) == bk_rules.SCALE
    assert layer_rule(FAMILIES["phi3"](300).model.norm) == bk_rules.SCALE
    assert layer_rule(FAMILIES["gemma"](300).model.norm) == bk_rules.ONE_PLUS_SCALE
    assert layer_rule(nn.LayerNorm(8)) == bk_rules.SCALE
    assert layer_rule(nn.LayerNorm(8, bias=False)) == bk_rules.SCALE
    assert layer_rule(_ResidualNorm(8)) == bk_rules.AFFINE_SCALE
    assert layer_rule(FAMILIES["opt"](300).model.decoder.embed_positions) == bk_rules.EMBEDDING_ROUTED
    assert layer_rule(FAMILIES["gpt2"](300).transformer.h[0].attn.c_attn) == bk_rules.LINEAR_TRANSPOSED


class _SquaredScale(nn.Module):
    """w²·x: elementwise, but not affine in w: no rule may accept it."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * self.weight * x


def test_preflight_names_each_module_it_cannot_clip():
    model = nn.Sequential(nn.Linear(8, 8), nn.Conv2d(1, 1, 1), _SquaredScale(8))
    problems = bk_problems(model)
    assert len(problems) == 2
    assert problems[0].startswith("1 (Conv2d): ") and problems[1].startswith("2 (_SquaredScale): ")
    assert not any("grad_sample_mode" in p for p in problems)  # preflight says which mode can (test_clipping_modes)
    assert "not affine in its weight" in problems[1]
    with pytest.raises(NotImplementedError) as refused:  # the wrapper: the same lines, nothing patched
        GradSampleModuleBookKeeping(model)
    assert all(p in str(refused.value) for p in problems)
    assert not any("forward" in vars(m) for m in model.modules())
    model[1].weight.requires_grad_(False)
    model[1].bias.requires_grad_(False)  # a frozen module needs no rule
    assert bk_problems(model) == [problems[1]]


class _ResidualNorm(nn.Module):
    """x + w ⊙ rms_norm(x): an elementwise scale with c(x) = x ≠ 0."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x + self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Reused(nn.Module):
    """Each parameterised module called twice in one forward: an embedding looked up twice,
    a LayerNorm and a Linear applied twice (and with `residual_norm`, a c + w·s norm twice)."""

    def __init__(self, residual_norm: bool, vocab=50, d=16):
        super().__init__()
        self.emb, self.norm, self.lin = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, d)
        self.res = _ResidualNorm(d) if residual_norm else nn.Identity()
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):  # ids (B, T)
        h = self.emb(ids) + 0.5 * self.emb(ids.flip(1))
        h = self.lin(torch.tanh(self.lin(self.norm(h))))
        return self.head(self.res(self.norm(self.res(h))))  # (B, T, V)


def _token_loss(call, ids):
    logits = call(ids=ids[None])  # (1, T, V)
    return F.cross_entropy(logits[0, :-1], ids[1:])


@pytest.mark.parametrize("residual_norm", [False, True], ids=["linear-embedding-layernorm", "c+w·s-norm-too"])
def test_a_module_called_twice_in_one_forward_is_exact(residual_norm):
    """Each example's gradient of a reused weight is the sum over its calls: the norm needs
    the cross terms between calls (the check in issue 35 found 8.395 for a true 8.849)."""
    model = _Reused(residual_norm)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # LayerNorm's w = 1, b = 0 would hide terms
    ids = torch.randint(0, 50, (4, 7))
    grads = _per_example_grads(model, _token_loss, ids)
    max_grad_norm = _clipped_sum(grads, 1.0)[2].median().item()
    want, coef, _ = _clipped_sum(grads, max_grad_norm)

    dp_model = GradSampleModuleBookKeeping(model, max_grad_norm=max_grad_norm)
    logits = dp_model(ids)
    got_coef = dp_model.backward_clipped(F.cross_entropy(
        logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1))
    assert (got_coef < 1).any() and (got_coef == 1).any()
    torch.testing.assert_close(got_coef, coef, rtol=1e-5, atol=0)
    _assert_clipped_sums_equal(model, want)


class _UsedOutside(nn.Module):
    """lin.weight used by lin and, directly, by the parent's forward: autograd would give that
    second use's gradient straight to .grad, unclipped."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.lin(h) + F.linear(h, self.lin.weight))


def test_a_parameter_also_used_outside_its_module_is_refused():
    model = _UsedOutside()
    dp_model = GradSampleModuleBookKeeping(model, max_grad_norm=1.0)
    ids = torch.randint(0, 50, (3, 6))
    logits = dp_model(ids)
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    with pytest.raises(RuntimeError, match=r"lin\.weight outside the layer.*unclipped"):
        dp_model.backward_clipped(loss)
    assert all(p.grad is None for p in model.parameters())  # nothing half-written


def test_gradients_accumulated_before_are_kept(tiny_tokenizer):
    """backward_clipped sets .grad aside during its backward (to see what autograd fills):
    a physical batch's clipped sum still adds to the earlier ones of the logical batch."""
    model = FAMILIES["llama"](len(tiny_tokenizer))
    untie_lm_head(model)
    batch, labels = _batch(tiny_tokenizer)
    dp_model = GradSampleModuleBookKeeping(model, max_grad_norm=1.0)
    dp_model.backward_clipped(per_sequence_loss(dp_model(**batch).logits, labels))
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    dp_model.backward_clipped(per_sequence_loss(dp_model(**batch).logits, labels))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], msg=n)


@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2"])
def test_bk_follows_the_models_dtype_under_bf16_autocast(tiny_tokenizer, family):
    """The norms' outputs keep the dtype the module's own forward gives (Llama's and Gemma's
    RMSNorm compute in fp32 and cast back): the wrapped model's logits are the plain one's."""
    model = FAMILIES[family](len(tiny_tokenizer))
    untie_lm_head(model)
    batch, _ = _batch(tiny_tokenizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(**batch).logits
        dp_model = GradSampleModuleBookKeeping(model)
        wrapped = dp_model(**batch).logits
    assert wrapped.dtype == plain.dtype
    torch.testing.assert_close(wrapped.float(), plain.float(), rtol=0.02, atol=0.02)
    dp_model._close()


def test_backward_clipped_under_autocast_forms_its_norms_in_fp32(tiny_tokenizer):
    """A caller that keeps autocast on around backward_clipped (the teacher stage does not) gets
    the same factors and clipped sums as one that leaves it first: under autocast matmul and bmm
    would form the norms in bf16, and a norm rounded down clips by less than C."""
    model = FAMILIES["llama"](len(tiny_tokenizer))
    untie_lm_head(model)
    batch, labels = _batch(tiny_tokenizer)
    dp_model = GradSampleModuleBookKeeping(model, max_grad_norm=1e-3)
    results = []
    for inside in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = per_sequence_loss(dp_model(**batch).logits, labels)
            coef = dp_model.backward_clipped(loss) if inside else None
        coef = dp_model.backward_clipped(loss) if not inside else coef
        results.append((coef, [p.grad.clone() for p in model.parameters()]))
    (coef_out, grads_out), (coef_in, grads_in) = results
    assert torch.equal(coef_in, coef_out)
    assert all(torch.equal(a, b) for a, b in zip(grads_in, grads_out))
    dp_model._close()


_CUDA_MM, _ONEDNN_MM = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
FAST_FP32 = {  # how a process lets fp32 products run faster: (set it, back to the default by the same API)
    "global": (lambda: torch.set_float32_matmul_precision("medium"),
               lambda: torch.set_float32_matmul_precision("highest")),
    "legacy": (lambda: setattr(_CUDA_MM, "allow_tf32", True), lambda: setattr(_CUDA_MM, "allow_tf32", False)),
    "per-backend": (lambda: setattr(_ONEDNN_MM, "fp32_precision", "bf16"),
                    lambda: setattr(_ONEDNN_MM, "fp32_precision", "none")),
}


@pytest.mark.parametrize("setting", list(FAST_FP32))
def test_backward_clipped_forms_its_products_in_ieee_fp32_whatever_the_caller_set(tiny_tokenizer, setting,
                                                                                    monkeypatch):
    """A caller (or a library it imports) that lets fp32 products run in TF32 on CUDA or in bf16 on
    a CPU's oneDNN would have bk's Gram matrices and clipped sums formed with 10 or 8 significand
    bits: a norm rounded down clips by less than C. Inside backward_clipped every fp32 product is
    IEEE fp32; the caller's own settings come back after, read through the API it used (mixing
    the two APIs raises on reading)."""
    seen = []
    mm32 = bk._mm32

    def spy(x, y):
        seen.append((_CUDA_MM.fp32_precision, _ONEDNN_MM.fp32_precision))
        return mm32(x, y)

    monkeypatch.setattr(bk, "_mm32", spy)
    make_fast, restore = FAST_FP32[setting]
    make_fast()
    try:
        before = (_CUDA_MM.fp32_precision, _ONEDNN_MM.fp32_precision)
        assert before != ("ieee", "ieee")
        model = FAMILIES["llama"](len(tiny_tokenizer))
        untie_lm_head(model)
        batch, labels = _batch(tiny_tokenizer)
        dp_model = GradSampleModuleBookKeeping(model, max_grad_norm=1.0)
        dp_model.backward_clipped(per_sequence_loss(dp_model(**batch).logits, labels))
        dp_model._close()
        assert seen and set(seen) == {("ieee", "ieee")}
        assert (_CUDA_MM.fp32_precision, _ONEDNN_MM.fp32_precision) == before
        if setting == "legacy":
            assert _CUDA_MM.allow_tf32 is True
        if setting == "global":
            assert torch.get_float32_matmul_precision() == "medium"
    finally:
        restore()


def test_the_split_sum_of_bf16_factors_stays_within_its_bound():
    """_MatmulUse.weighted_sum with bf16 factors: each example's part within
    2⁻¹⁶·Cᵢ‖aᵢ‖_F‖gᵢ‖_F of the exact Cᵢaᵢᵀgᵢ (float64, from the same bf16 values), also where
    the tokens' gradients cancel, so that the error is large beside ‖aᵢᵀgᵢ‖ itself. bf16(C·a)
    alone, without its low part, is ~2⁻⁹ off and fails this."""
    torch.manual_seed(0)
    a = torch.randn(2, 6, 5).bfloat16()
    g = torch.randn(2, 6, 9).bfloat16()
    g[1, 1::2] = -g[1, ::2]  # example 1: a pairwise-cancelling gradient
    a[1, 1::2] = a[1, ::2]
    coef = torch.tensor([0.3141592, 0.0271828])
    for i in range(2):
        for transposed in (False, True):
            use = bk._MatmulUse(a[i:i + 1], g[i:i + 1], transposed, flat=False)
            assert use.split
            exact = coef[i].double() * (a[i].double().t() @ g[i].double())  # (d, p)
            got = use.weighted_sum(coef[i:i + 1]).double()
            err = (got - (exact if transposed else exact.t())).norm()
            bound = 2.0**-16 * coef[i] * a[i].double().norm() * g[i].double().norm()
            assert err <= bound, (i, transposed, err, bound)
    assert (a[1].double().t() @ g[1].double()).norm() < 1e-6  # the cancelling case is one


def test_the_split_bounds_of_one_weights_calls_add_before_squaring():
    """Two calls of one weight put their split errors on the same entries (‖E₁ + E₂‖ ≤ b₁ + b₂);
    two weights' errors are orthogonal (√(b₁² + b₂²))."""
    from pipeline.privacy.bk import _per_example_sq_norms

    torch.manual_seed(0)
    uses = [bk._MatmulUse(torch.randn(3, 4, 5).bfloat16(), torch.randn(3, 4, 6).bfloat16(), False, False)
            for _ in range(2)]
    b1, b2 = (u.split_bound() for u in uses)
    w, v = nn.Parameter(torch.zeros(6, 5)), nn.Parameter(torch.zeros(6, 5))
    _, same = _per_example_sq_norms([("w", w, uses[0]), ("w", w, uses[1])], 3, torch.device("cpu"))
    _, apart = _per_example_sq_norms([("w", w, uses[0]), ("v", v, uses[1])], 3, torch.device("cpu"))
    torch.testing.assert_close(same, (b1 + b2).square())
    torch.testing.assert_close(apart, b1.square() + b2.square())


def _reference_scaled_sum(x, y, coef):
    return torch.einsum("b,btm,btn->mn", coef.double(), x.double(), y.double()).float()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_with_the_kernel_bf16_factors_clip_by_the_norm_and_its_margin_in_either_layout(tiny_tokenizer, family,
                                                                                       monkeypatch):
    """Where bk_kernel runs (CUDA with Triton) the clipped sum of bf16 factors is one product with
    each example's factor applied inside it: no split, so no split bound. The kernel is replaced
    here by its float64 definition, on the CPU, to check what bk hands it: the operands in
    nn.Linear's (Llama) and Conv1D's (GPT-2) layouts. Against fp32 factors (the same bf16 values,
    upcast): the norms raised by BF16_NORM_MARGIN alone, so every factor smaller by that, and the
    clipped sums the same but for it."""
    torch.manual_seed(0)
    model = FAMILIES[family](len(tiny_tokenizer))
    untie_lm_head(model)
    batch, labels = _batch(tiny_tokenizer)
    uses, bound = [], bk._MatmulUse.split_bound
    monkeypatch.setattr(bk._MatmulUse, "split_bound", lambda u: uses.append(u) or bound(u))

    def clipped(kernel: bool):
        monkeypatch.setattr(bk, "SPLIT_DEVICES", {"cuda", "cpu"} if kernel else {"cuda"})
        monkeypatch.setattr(bk.bk_kernel, "available", lambda t: kernel)
        monkeypatch.setattr(bk.bk_kernel, "scaled_sum", _reference_scaled_sum)
        for p in model.parameters():
            p.grad = None
        dp_model = GradSampleModuleBookKeeping(model, max_grad_norm=1e-3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = dp_model(**batch).logits
        uses.clear()
        coef = dp_model.backward_clipped(per_sequence_loss(logits, labels))
        dp_model._close()
        assert uses and all(u.kernel == kernel and not u.split for u in uses)
        return torch.cat([p.grad.flatten() for p in model.parameters()]), coef

    fp32, coef32 = clipped(kernel=False)
    fused, coef = clipped(kernel=True)
    assert (coef32 < 1).all()  # every example clipped, so every factor is C / norm
    torch.testing.assert_close(coef * (1 + bk.BF16_NORM_MARGIN), coef32, rtol=2e-6, atol=0)
    torch.testing.assert_close(fused * (1 + bk.BF16_NORM_MARGIN), fp32, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("outcome", ["right", "wrong", "no compiler", "narrow ones wrong", "wide ones too large"])
def test_the_kernel_is_checked_on_the_device_and_a_failing_candidate_is_never_used(outcome, monkeypatch, caplog):
    """A CUDA runtime image without a C compiler lets Triton import but not launch, and a compiler
    can get one configuration wrong: once per process and device, every candidate the autotuner may
    choose sums a case known exactly. One that fails is dropped; if all fail, bk keeps the split
    (available() False). One warning names the cause; never a crash mid-training. One too large
    for the GPU's shared memory is dropped without a warning, as the autotuner skips it."""
    from pipeline.privacy import bk_kernel

    def fake(x, y, coef, blocks=None):
        if outcome == "no compiler":
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable")
        if outcome == "wide ones too large" and blocks["BN"] == 256:
            raise type("OutOfResources", (Exception,), {})("out of resource: shared memory")  # Triton's, by name
        exact = torch.einsum("b,btm,btn->mn", coef.double(), x.double(), y.double()).float()
        wrong = outcome == "wrong" or (outcome == "narrow ones wrong" and blocks["BN"] == 64)
        return exact + 1 if wrong else exact

    monkeypatch.setattr(bk_kernel, "scaled_sum", fake)
    bk_kernel._runs_on.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=bk_kernel.__name__):
            runs = bk_kernel._runs_on(torch.device("cpu"))
    finally:
        bk_kernel._runs_on.cache_clear()
    assert runs == (outcome in ("right", "narrow ones wrong", "wide ones too large"))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == (outcome not in ("right", "wide ones too large"))  # a GPU too small for one: no warning
    if outcome in ("wrong", "no compiler"):
        assert "split" in warned[0] and ("C compiler" if outcome == "no compiler" else "wrong sum") in warned[0]
    if outcome == "narrow ones wrong":
        narrow = [c for c in bk_kernel.CONFIGS if c[1] == 64]
        assert 0 < len(narrow) < len(bk_kernel.CONFIGS)
        assert f"{len(narrow)} of the Triton kernel's {len(bk_kernel.CONFIGS)} configurations failed" in warned[0]
        assert all(str(c) in warned[0] for c in narrow)


_KERNEL_CHECK = """
import torch
from pipeline.privacy import bk_kernel
device = "cuda" if torch.cuda.is_available() else "cpu"
# on a CPU (Triton's interpreter): fp16, whose products are as exact in fp32 as bf16's (its numpy
# holds no bf16), and fixed blocks that cut T=17 and T=100 mid-way, since autotuning needs a GPU;
# on CUDA: bf16, autotuned
dtype, variants = torch.bfloat16, [None]  # autotuned
if device == "cpu":
    dtype, variants = torch.float16, []
    bk_kernel._CHECK_DTYPE = torch.float16
variants.append(dict(BM=32, BN=32, BK=16))  # blocks that cut T=17 and T=100 mid-way
for blocks in variants:
    for b, t, m, n in [(5, 32, 40, 70), (3, 17, 130, 9), (4, 100, 64, 200), (7, 20, 33, 40), (1, 40, 24, 30)]:
        bk_kernel._multiprocessors = lambda d: 8 if b == 7 else 1  # 7: the batch cut into groups (split-K)
        torch.manual_seed(0)
        x, y = torch.randn(b, t, m).to(device, dtype), torch.randn(b, t, n).to(device, dtype)
        if b == 1:  # x column-major: its (T, M) view has strides (1, T)
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        coef = torch.rand(b, device=device)
        got = bk_kernel.scaled_sum(x, y, coef, blocks=blocks).cpu().double()
        want = torch.einsum("b,btm,btn->mn", coef.cpu().double(), x.cpu().double(), y.cpu().double())
        print("sum", b, t, m, n, ((got - want).norm() / want.norm()).item())
# every candidate's check on the device: all pass here
print("runs_on", bk_kernel._runs_on(torch.device(device)))
"""


def test_the_kernel_is_the_sum_of_each_examples_product_times_its_factor():
    """bk_kernel.scaled_sum against float64: lengths that no block
    size divides (17, 100: masked last blocks), edges of the output tiles, the batch cut into
    groups, a column-major factor; then the device check of every candidate passes. Without a GPU under
    Triton's interpreter, which must be on before Triton is imported: in a process of its own."""
    pytest.importorskip("triton", reason="Triton ships with torch's CUDA builds, not with the CPU wheel")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    errors = [float(line.split()[-1]) for line in lines if line.startswith("sum")]
    assert len(errors) in (5, 10) and max(errors) < 1e-6, done.stdout
    assert lines[-1] == "runs_on True", done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_factors_clip_like_fp32_factors_and_no_example_exceeds_the_bound(tiny_tokenizer, family, monkeypatch):
    """On a GPU a layer run in bf16 keeps bf16 factors and bk's products run on the 16-bit units
    (bk_layers.SPLIT_DEVICES); forced here on the CPU, where _mm32 upcasts (the same arithmetic:
    exact products, fp32 sums). Against the same bf16 forward with fp32 factors: the same clipped
    sum to well within bf16's rounding, factors no larger (the split's bound is added to each
    norm), and each example's own clipped part, from a batch of one, no larger than C."""
    torch.manual_seed(0)
    model = FAMILIES[family](len(tiny_tokenizer))
    untie_lm_head(model)
    batch, labels = _batch(tiny_tokenizer)
    clip = 1e-3  # below every example's norm: every example clipped

    def clipped(split: bool, rows=slice(None)):
        monkeypatch.setattr(bk, "SPLIT_DEVICES", {"cuda", "cpu"} if split else {"cuda"})
        for p in model.parameters():
            p.grad = None
        dp_model = GradSampleModuleBookKeeping(model, max_grad_norm=clip)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = dp_model(**{k: v[rows] for k, v in batch.items()}).logits
        coef = dp_model.backward_clipped(per_sequence_loss(logits, labels[rows]))
        dp_model._close()
        return torch.cat([p.grad.flatten() for p in model.parameters()]).double(), coef

    fp32, coef32 = clipped(split=False)
    split, coef = clipped(split=True)
    assert (coef < coef32).all() and ((coef32 - coef) / coef32).max() < 1e-3, (coef, coef32)
    assert (split - fp32).norm() / fp32.norm() < 1e-3
    for i in range(len(TEXTS)):
        alone, _ = clipped(split=True, rows=slice(i, i + 1))
        assert alone.norm() <= clip * (1 + 1e-6), (i, alone.norm())


class _SplitsTheBatch(nn.Module):
    """Runs its Linear on (2B, T/2, d): bk cannot tell which rows are whose."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb, self.lin = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, ids):  # ids (B, T), T even
        h = self.emb(ids)
        return self.lin(h.reshape(2 * ids.shape[0], ids.shape[1] // 2, -1)).reshape(*ids.shape, -1)


def test_a_layer_that_sees_a_reshaped_batch_is_refused():
    """OPT's (B·T, d) rows are regrouped per example (the family test above); rows that are
    not the loss's examples on a sequence axis are refused, not guessed."""
    dp_model = GradSampleModuleBookKeeping(_SplitsTheBatch(), max_grad_norm=1.0)
    ids = torch.randint(0, 50, (3, 6))
    logits = dp_model(ids)
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    with pytest.raises(RuntimeError, match=r"lin saw a batch whose rows are not the loss's examples"):
        dp_model.backward_clipped(loss)
