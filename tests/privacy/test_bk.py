"""Book-keeping clipping (pipeline/privacy/bk.py) against Opacus' per-sample gradients (hooks).

With σ = 0 a DP step's gradient is Σᵢ clip(∇ℓᵢ, C) / B: bk must give what Opacus' per-sample
hooks give, for every training mode, with padded records of different lengths, whether
every example is clipped, none is, or some are."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny_model
from pipeline.privacy import accountant  # noqa: F401  (registers the Conv1D grad sampler for hooks)
from pipeline.batching import TokenizedRecords, lm_batch
from pipeline.privacy.bk import BookKeepingPrivacyEngine, GradSampleModuleBookKeeping
from pipeline.config import TeacherConfig
from pipeline.records import encode_record
from pipeline.models.base import untie_lm_head
from pipeline.models.losses import per_sequence_loss
from pipeline.stages.teacher.trainable import prepare_trainable

TEXTS = [
    "Great tacos and friendly staff.",
    "Never again.",
    "The room was clean but the bed was hard, and the breakfast was cold.",
    "Ok",
]


def _dp_gradient(model, tokenizer, mode: str, max_grad_norm: float, max_length: int):
    """The σ = 0 DP gradient of one step (after Opacus' pre_step: clipped sum ÷ batch)."""
    data = TokenizedRecords([encode_record(tokenizer, "Stars: 5", t, max_length) for t in TEXTS],
                            tokenizer.pad_token_id, max_length)
    loader = torch.utils.data.DataLoader(data, batch_size=len(TEXTS))
    ids, lengths = next(iter(loader))
    assert len(set(lengths.tolist())) > 1  # padded: records of different lengths
    batch = lm_batch(ids, lengths)
    labels = batch.pop("labels")
    trainable = [p for p in model.parameters() if p.requires_grad]
    dp_model, optimizer, _ = BookKeepingPrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(trainable, lr=0.0), data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=max_grad_norm, poisson_sampling=False, grad_sample_mode=mode,
    )
    per_example = per_sequence_loss(dp_model(**batch).logits, labels)
    if mode == "bk":
        dp_model.backward_clipped(per_example)
    else:
        per_example.mean().backward()
    optimizer.pre_step()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    dp_model._close()
    return grads


@pytest.mark.parametrize("teacher_mode", ["full", "bitfit", "lora"])
@pytest.mark.parametrize("max_grad_norm", [1e-3, 2.5, 1e4], ids=["all-clipped", "some-clipped", "none-clipped"])
@pytest.mark.parametrize("max_length", [16, 48], ids=["T16-ghost-norms", "T48-mixed-norms"])  # 2T² vs p·d
def test_bk_equals_per_sample_clipping(tiny_tokenizer, teacher_mode, max_grad_norm, max_length):
    torch.manual_seed(0)
    base = make_tiny_model(tiny_tokenizer)
    untie_lm_head(base)
    cfg = TeacherConfig(mode=teacher_mode, lora_rank=4)
    trainable = prepare_trainable(base, cfg)  # LoRA adapters initialised once, then copied
    with torch.no_grad():  # peft starts B at 0, which would leave A's gradient 0: untested
        for name, p in trainable.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    got = _dp_gradient(copy.deepcopy(trainable), tiny_tokenizer, "bk", max_grad_norm, max_length)
    want = _dp_gradient(copy.deepcopy(trainable), tiny_tokenizer, "hooks", max_grad_norm, max_length)
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)
    flat = torch.cat([g.flatten() for g in got.values()])
    assert flat.norm() > 0


def test_some_but_not_all_examples_are_clipped_at_the_middle_norm(tiny_tokenizer):
    """The 'some-clipped' case above really mixes clipped and unclipped examples."""
    torch.manual_seed(0)
    model = make_tiny_model(tiny_tokenizer)
    untie_lm_head(model)
    bk = GradSampleModuleBookKeeping(model, max_grad_norm=2.5)
    data = TokenizedRecords([encode_record(tiny_tokenizer, "Stars: 5", t, 48) for t in TEXTS],
                            tiny_tokenizer.pad_token_id, 48)
    ids, lengths = next(iter(torch.utils.data.DataLoader(data, batch_size=len(TEXTS))))
    batch = lm_batch(ids, lengths)
    labels = batch.pop("labels")
    coef = bk.backward_clipped(per_sequence_loss(bk(**batch).logits, labels))
    assert (coef < 1).any() and (coef == 1).any(), coef


def test_a_layer_without_a_rule_is_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Conv2d(1, 1, 1))
    with pytest.raises(NotImplementedError, match=r"(?s)1 \(Conv2d\).*`dpdistill plan` names the clipping mode"):
        GradSampleModuleBookKeeping(model)
    assert "forward" not in vars(model[0])  # the Linear patched before the refusal is restored


def test_close_restores_the_plain_model(tiny_tokenizer):
    model = make_tiny_model(tiny_tokenizer)
    untie_lm_head(model)
    ids = torch.tensor([[5, 6, 7]])
    before = model(input_ids=ids).logits
    bk = GradSampleModuleBookKeeping(model)
    torch.testing.assert_close(bk(input_ids=ids).logits, before)
    bk._close()
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_tied_head_is_accepted_and_any_other_shared_parameter_refused_by_name(tiny_tokenizer):
    """GPT-2's lm_head tied to wte is one weight with two uses, which bk clips over both (the cross
    term: tests/privacy/test_bk_families.py, the `-tied` cases). Two linear maps sharing one weight
    have no cross-term rule: refused at wrap time, naming both and the fix."""
    model = make_tiny_model(tiny_tokenizer)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as transformers builds it
    GradSampleModuleBookKeeping(model)._close()  # a tied head: accepted
    two = torch.nn.ModuleDict({"first": torch.nn.Linear(4, 4), "second": torch.nn.Linear(4, 4)})
    two["second"].weight = two["first"].weight  # two linear maps, one weight
    with pytest.raises(ValueError, match=r"second\.weight is the same tensor as first\.weight.*untie"):
        GradSampleModuleBookKeeping(two)
    assert not any("forward" in vars(m) for m in two.modules())  # nothing was patched


def test_a_plain_backward_is_an_error_not_a_missing_gradient(tiny_tokenizer):
    """bk forms the weights' gradients only in backward_clipped: a plain loss.backward() would
    leave them None and an optimizer step would silently skip them."""
    model = make_tiny_model(tiny_tokenizer)
    untie_lm_head(model)
    bk = GradSampleModuleBookKeeping(model, max_grad_norm=1.0)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    batch = lm_batch(ids, torch.tensor([4, 3]))
    labels = batch.pop("labels")
    with pytest.raises(RuntimeError, match=r"backward_clipped\(per_example_loss\)"):
        per_sequence_loss(bk(**batch).logits, labels).mean().backward()
    assert all(p.grad is None for p in model.parameters())
    bk.backward_clipped(per_sequence_loss(bk(**batch).logits, labels))  # the intended call still works
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("physical", [1, 3])
@pytest.mark.parametrize("device_path", ["cpu-fused", "generic"])
def test_bk_optimizer_step_is_opacus_step_bit_for_bit(physical, device_path, monkeypatch):
    """bk's optimizer step (pipeline/privacy/bk.py _InPlaceNoise: the clipped sum kept without a
    copy, the noise added in place chunk by chunk) gives Opacus' ghost optimizer's weights bit
    for bit, and leaves the noise generator where Opacus leaves it: one or three physical
    batches a step, parameters around the chunk size (4,096 here), its 16-value blocks and the
    noise lanes' threshold (pipeline/privacy/noise.py, Opacus' draw through its dispatcher), two
    steps, Adam on top; `generic` is the path off the CPU draw (secure mode, a GPU)."""
    from opacus.optimizers import DPOptimizerFastGradientClipping

    from pipeline.privacy import noise
    from pipeline.privacy.bk import _BookKeepingOptimizer

    monkeypatch.setattr(noise, "NOISE_CHUNK", 4096)
    monkeypatch.setattr(noise, "LANE_MIN", 4096 * 2)  # the first two parameters come in lanes
    if device_path == "generic":
        monkeypatch.setattr(noise, "cpu_draw", lambda *args: False)
    shapes = [(3, 4096 + 5), (4096 * 2 + 16,), (7,)]
    torch.manual_seed(0)
    start = [torch.randn(s) for s in shapes]
    grads = [[[torch.randn(s) for s in shapes] for _ in range(physical)] for _ in range(2)]
    results = {}
    for cls in (DPOptimizerFastGradientClipping, _BookKeepingOptimizer):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        gen = noise.generator("noise", secure=False)
        gen.manual_seed(1234)
        optimizer = cls(torch.optim.Adam(params, lr=0.1), noise_multiplier=1.3, max_grad_norm=0.7,
                        expected_batch_size=5, loss_reduction="mean", generator=gen)
        for step in grads:
            for i, batch in enumerate(step):
                for p, g in zip(params, batch):
                    p.grad = g.clone()
                    p._processed = False  # opacus' flag: the backward's clipped sum is fresh
                optimizer.signal_skip_step(do_skip=i < physical - 1)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        results[cls] = ([p.detach() for p in params], gen.get_state())
    (want, want_state), (got, got_state) = results.values()
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and torch.equal(want_state, got_state)
    assert not all(torch.equal(a, b) for a, b in zip(start, got))
