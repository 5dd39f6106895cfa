"""Every clipping mode on every family, and the models a mode cannot clip exactly (issue 62).

pipeline/privacy/clipping_modes.py decides, on the model built on the meta device as preflight
builds it, which modes (bk, ghost, hooks) clip it exactly. Each verdict is checked here against
what the mode does: where a mode is accepted, its clipped sum as the teacher stage forms it
(per_example.mode_clipped_sum) equals the per-example reference (per_example.reference: one
batch-size-1 gradient per example, by torch.func); where it is refused, running it shows why
(a crash mid-training, or a clipped contribution above C)."""

from __future__ import annotations

import pytest
import torch

from families import CLIPPING_FAMILIES, ToyConfig, ToyLM
from per_example import assert_clipped_sums_equal, batch, mode_clipped_sum, reference
from pipeline.models.base import untie_lm_head
from pipeline.privacy.clipping_modes import MODES, advice, mode_problems

# Opacus refuses a trainable layer holding buffers (the Gemmas' scaled embeddings) and cannot detach
# OPT's int position offset; Falcon adds in place to a layer's output, which Opacus' hooks forbid.
OPACUS_REFUSED = {"gemma": "embed_tokens", "gemma2": "embed_tokens", "gemma3": "embed_tokens",
                  "opt": "embed_positions", "falcon": "mlp.dense_4h_to_h (FalconLinear): its output is modified in place"}


def _verdicts(build, *args) -> dict[str, list[str]]:
    """What preflight decides, on the model built on the meta device (no values)."""
    with torch.device("meta"):
        model = build(*args)
    untie_lm_head(model)  # as the pipeline does
    return mode_problems(model)


@pytest.mark.parametrize("family", sorted(CLIPPING_FAMILIES))
def test_every_family_in_every_mode_is_exact_or_refused_with_a_mode_that_can(tiny_tokenizer, family):
    found = _verdicts(CLIPPING_FAMILIES[family], len(tiny_tokenizer))
    assert found["bk"] == [], found["bk"]  # bk clips every family
    for mode in ("ghost", "hooks"):
        if family in OPACUS_REFUSED:
            assert found[mode] and all(OPACUS_REFUSED[family] in line for line in found[mode]), found[mode]
            assert advice(found, mode).startswith("use teacher.grad_sample_mode=bk")
        else:
            assert found[mode] == [], found[mode]
    model = CLIPPING_FAMILIES[family](len(tiny_tokenizer))
    untie_lm_head(model)
    inputs, labels = batch(tiny_tokenizer)
    want, clip = reference(model, inputs, labels)
    for mode in MODES:
        if not found[mode]:
            assert_clipped_sums_equal(mode_clipped_sum(model, mode, inputs, labels, clip), want)
    if family == "falcon":  # what preflight saves the user from: Opacus' hooks fail at the first step
        with pytest.raises(RuntimeError, match="BackwardHookFunction is a view and is being modified inplace"):
            mode_clipped_sum(model, "hooks", inputs, labels, clip)


def _toy(kind: str) -> ToyLM:
    return ToyLM(ToyConfig(kind=kind))


def _toy_batch(vocab: int = 50):
    ids = torch.randint(0, vocab, (4, 7))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "position_ids": torch.arange(7).expand(4, 7).contiguous()}
    return inputs, ids[:, 1:].clone()


def test_a_weight_also_used_outside_its_module_is_refused_in_every_mode():
    """Items 9 and 10: F.linear(h, lin.weight) in the model's own forward. bk would refuse it at its
    first step (after the data stages); ghost accepted it and clipped each example to more than
    C; hooks would drop that use's gradient. Preflight refuses it in every mode, naming the
    weight and the module that uses it, and says no mode can."""
    found = _verdicts(_toy, "outside")
    for mode in MODES:
        assert len(found[mode]) == 1, found[mode]
        line = found[mode][0]
        assert line.startswith("lin.weight: used outside its module, by the model (ToyLM)"), line
        assert "use the weight only by calling its module, or freeze it" in line
    assert advice(found, "ghost").startswith("no clipping mode can")

    model = _toy("outside")  # why: ghost's contribution of one example exceeds C
    inputs, labels = _toy_batch()
    one = {k: v[:1] for k, v in inputs.items()}
    got = mode_clipped_sum(model, "ghost", one, labels[:1], max_grad_norm=1e-3)
    norm = torch.cat([g.flatten() for g in got.values()]).norm()
    assert norm > 1e-3 * 1.0001, norm
    with pytest.raises(RuntimeError, match=r"autograd reached lin\.weight outside the layer"):
        mode_clipped_sum(model, "bk", inputs, labels, 1.0)


def test_a_linear_called_twice_is_refused_by_ghost_alone():
    """Item 13: Opacus' ghost clipping refuses a layer it has a norm sampler for when called
    twice, at its first step; preflight refuses it by name and points to bk, which clips it
    exactly (cross terms between the calls), as hooks does (its per-sample gradients add up)."""
    found = _verdicts(_toy, "twice")
    assert found["bk"] == [] and found["hooks"] == []
    assert found["ghost"] == ["lin (Linear): lin.weight (2 calls), lin.bias (2 calls) in one forward (a layer called "
                              "again, or a weight tied to another), which Opacus' ghost clipping refuses at its first "
                              "step (its norm sampler sees one call)"]
    assert advice(found, "ghost") == "use teacher.grad_sample_mode=bk (or hooks)"
    model = _toy("twice")
    inputs, labels = _toy_batch()
    want, clip = reference(model, inputs, labels)
    for mode in ("bk", "hooks"):
        assert_clipped_sums_equal(mode_clipped_sum(model, mode, inputs, labels, clip), want)
    with pytest.raises(NotImplementedError, match="Parameter tying is not supported with Ghost Clipping"):
        mode_clipped_sum(model, "ghost", inputs, labels, clip)


def test_a_one_element_gate_is_clipped_exactly_in_every_mode():
    """Item 11: a ReZero gate x·w (gate.weight of shape (1,)), broadcast over 16 features. bk summed its
    per-example gradient over positions only (a 16-vector: norms 0.027 for a true 0.0076 in the
    issue), then failed to assign it to the (1,) weight. Every mode now accepts it, exactly."""
    found = _verdicts(_toy, "gate")
    assert found == {mode: [] for mode in MODES}, found
    model = _toy("gate")
    inputs, labels = _toy_batch()
    want, clip = reference(model, inputs, labels)
    for mode in MODES:
        assert_clipped_sums_equal(mode_clipped_sum(model, mode, inputs, labels, clip), want)


def test_preflight_runs_a_model_with_sdpa_attention_on_the_meta_device(caplog):
    """transformers' sdpa mask reads whether every position is real, a value the meta device lacks:
    the trace runs again without the mask rather than skipping the checks (with a warning)."""
    with torch.device("meta"):
        model = CLIPPING_FAMILIES["llama"](300)
    model.config._attn_implementation = "sdpa"  # what from_config picks for a model of the hub
    untie_lm_head(model)
    with caplog.at_level("WARNING", logger="pipeline.privacy.clipping_modes"):
        assert mode_problems(model) == {mode: [] for mode in MODES}
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_the_shipped_gpt2_is_traced_on_the_meta_device_in_every_mode(caplog):
    """The demo's own teacher: GPT-2 asks the meta device for values under sdpa attention (the
    mask's `.all()`) and without a mask (is a padding id in the batch?), so preflight traces and
    steps it with eager attention; it must neither warn that it could not check it nor refuse it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.models.base import shipped_path

    with caplog.at_level("WARNING"):
        verdicts = _verdicts(AutoModelForCausalLM.from_config, AutoConfig.from_pretrained(shipped_path("builtin:teacher")))
    assert verdicts == {mode: [] for mode in MODES}
    assert not [r for r in caplog.records if "could not run" in r.getMessage()]
