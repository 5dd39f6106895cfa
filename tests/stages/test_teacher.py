"""The teacher stage's privacy machinery: accounting, clipping, empty Poisson batches."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from safetensors.torch import load_file

from pipeline.batching import lm_batch
from pipeline.config import TeacherConfig
import pipeline.privacy.accountant  # noqa: F401  (registers the exact norm samplers on import)
from pipeline.privacy import noise
from pipeline.privacy.noise import TEST_SEED_ENV
from pipeline.privacy.dpsgd import TeacherError
from pipeline.models.base import load_causal_lm
from pipeline.models.losses import per_sequence_loss
from pipeline.stages.teacher.recipe import train_teacher
from conftest import first_record_rewritten, make_tiny_model, noise_free_dp_gradient


@pytest.fixture
def fixed_noise(monkeypatch):
    """The test-only hook: DP noise, sampling and picks from a fixed seed (NOT private)."""
    monkeypatch.setenv(TEST_SEED_ENV, "1234")


def _teacher(splits, model_dir, out, on_progress=None, **overrides):
    cfg = TeacherConfig(
        **{
            "target_epsilon": 3.0,
            "epochs": 1,
            "batch_size": 25,
            "physical_batch_size": 10,
            "max_length": 48,
            "learning_rate": 1e-3,
            **overrides,
        }
    )
    return cfg, train_teacher(
        cfg, train_path=splits.train, validation_path=splits.validation, base_model=str(model_dir), out_dir=out, seed=0,
        on_progress=on_progress,
    )


def test_user_level_teacher_samples_users_and_trains_on_one_record_each(splits, tiny_model_dir, tmp_path):
    """A split with a user column: N and q count users; each step's physical batches are cut
    from the drawn users' picked records (teacher.RankShareSampler, shortest_first)."""
    table = pq.read_table(splits.train)
    users = [f"u{i % 33:02d}" for i in range(table.num_rows)]  # 33 users of 3 records each
    train = tmp_path / "train.parquet"
    pq.write_table(table.append_column("user", pa.array(users)), train)
    cfg, result = _teacher(dataclasses.replace(splits, train=train), tiny_model_dir, tmp_path / "teacher",
                           batch_size=11, physical_batch_size=4)
    e = result.ledger
    assert e.privacy_unit == "user" and e.sample_rate == pytest.approx(1 / 3) and e.steps == 3  # 33 users / 11
    assert e.delta == pytest.approx(1 / (10 * 33)) and 0 < e.epsilon <= cfg.target_epsilon


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_ledger_epsilon_is_the_accountants(splits, tiny_model_dir, tmp_path, accountant):
    """ε in the ledger equals a fresh Opacus accountant's for the same σ, q, steps, and ≤ target."""
    cfg, result = _teacher(splits, tiny_model_dir, tmp_path, accountant=accountant)
    e = result.ledger
    assert e.stage == "teacher" and e.accountant == accountant and e.privacy_unit == "record"
    assert e.delta == pytest.approx(1 / (10 * splits.n_train))  # the default δ = 1/(10N)
    assert e.sample_rate == pytest.approx(1 / 4)  # ceil(99 / 25) = 4 batches per epoch
    assert e.steps == 4
    fresh = PRVAccountant() if accountant == "prv" else RDPAccountant()
    fresh.history = [(e.noise_multiplier, e.sample_rate, e.steps)]
    assert e.epsilon == pytest.approx(fresh.get_epsilon(delta=e.delta), rel=1e-9)
    assert 0 < e.epsilon <= cfg.target_epsilon
    # Calibration is tight: σ was chosen for this budget, so little of it is left unused.
    assert e.epsilon > 0.9 * cfg.target_epsilon


def test_dp_training_changes_weights_and_saves_safetensors(splits, tiny_model_dir, tmp_path):
    """The released checkpoint differs from the base model and is stored as safetensors."""
    _, result = _teacher(splits, tiny_model_dir, tmp_path)
    before = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(result.checkpoint / "model.safetensors")
    changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2
    assert "lm_head.weight" in after  # untied for ghost clipping, saved on its own
    assert (tmp_path / "manifest.json").is_file() and (tmp_path / "accountant_state.pt").is_file()


@pytest.mark.parametrize("mode", ["ghost", "hooks", "bk"])
def test_every_clipping_mode_clips_in_ieee_fp32_whatever_the_caller_set(splits, tiny_model_dir, tmp_path, mode,
                                                                       monkeypatch):
    """A process that let fp32 products run in TF32 (CUDA) or bf16 (a CPU's oneDNN), for speed,
    elsewhere: each mode's per-example norms and clipped sums (Opacus' too, in its backward and
    in the optimizer's step) still run in IEEE fp32, and the process's setting comes back after."""
    from pipeline.stages.teacher import recipe

    cuda, mkldnn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    seen = []
    clip = recipe.CLIPPING[mode]

    def spy(*args):
        seen.append((cuda.fp32_precision, mkldnn.fp32_precision))
        return clip(*args)

    monkeypatch.setitem(recipe.CLIPPING, mode, spy)
    mkldnn.fp32_precision = "bf16"
    try:
        _teacher(splits, tiny_model_dir, tmp_path, grad_sample_mode=mode)
        assert seen and set(seen) == {("ieee", "ieee")}
        assert mkldnn.fp32_precision == "bf16"
    finally:
        mkldnn.fp32_precision = "none"


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_empty_poisson_batches_still_count_as_steps(splits, tiny_model_dir, tmp_path, mode):
    """With q = 1/N about a third of the logical batches are empty; each is a noise-only step."""
    cfg, result = _teacher(splits, tiny_model_dir, tmp_path, batch_size=1, physical_batch_size=1, target_epsilon=8.0,
                           grad_sample_mode=mode)
    # One epoch is int(1 / q) Poisson draws (N - 1 or N, float rounding), each one accounted.
    assert result.ledger.steps in (splits.n_train - 1, splits.n_train)
    assert result.ledger.steps == round(1 / result.ledger.sample_rate)
    assert result.ledger.epsilon <= cfg.target_epsilon


def test_batch_not_smaller_than_dataset_is_refused(splits, tiny_model_dir, tmp_path):
    """A sampling rate of 1 is refused with a message naming the field."""
    with pytest.raises(TeacherError, match="teacher.batch_size"):
        _teacher(splits, tiny_model_dir, tmp_path, batch_size=500, physical_batch_size=10)


def _clipped_sum_reference(model, batch, lengths_, C):
    """Σ_i clip(∇ℓ_i, C) computed one example at a time on a plain copy of the model."""
    total = None
    norms = []
    for i in range(batch["input_ids"].shape[0]):
        model.zero_grad()
        one = lm_batch(batch["input_ids"][i : i + 1], lengths_[i : i + 1])
        labels = one.pop("labels")
        per_sequence_loss(model(**one).logits, labels).sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norms.append(norm)
        scale = min(1.0, C / (norm.item() + 1e-6))
        grads = [g * scale for g in grads]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return total, torch.stack(norms)


@pytest.mark.parametrize("mode", ["ghost", "hooks", "bk"])
def test_noise_free_step_clips_every_example_to_max_grad_norm(tiny_tokenizer, mode):
    """σ = 0: the DP gradient is the sum of per-example gradients each clipped to C (÷ batch)."""
    C = 0.01  # far below every raw per-example norm, so every example is clipped
    model, initial, batch, _, lengths = noise_free_dp_gradient(tiny_tokenizer, mode, C)
    expected, raw_norms = _clipped_sum_reference(initial, batch, lengths, C)
    assert bool((raw_norms > 10 * C).all())
    flat_got = torch.cat([p.grad.flatten() for p in model.parameters()])
    flat_expected = torch.cat([g.flatten() for g in expected]) / len(lengths)
    torch.testing.assert_close(flat_got, flat_expected, rtol=1e-3, atol=1e-7)
    # Each clipped example contributes exactly C: the sum's norm is at most B·C / B = C.
    assert flat_got.norm() <= C * (1 + 1e-4)


def test_every_gpt2_layer_has_a_ghost_norm_sampler(tiny_tokenizer):
    """No parameterised GPT-2 module falls back to per-sample gradients under ghost clipping."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping as Ghost

    model = make_tiny_model(tiny_tokenizer)
    kinds = {type(m) for m in model.modules() if any(True for _ in m.parameters(recurse=False))}
    assert kinds and all(k in Ghost.NORM_SAMPLERS for k in kinds), kinds - set(Ghost.NORM_SAMPLERS)


def _weights(path):
    return load_file(path / "model.safetensors")


def test_bitfit_trains_only_bias_terms(splits, tiny_model_dir, tmp_path):
    """mode=bitfit: every weight matrix is unchanged, bias terms moved."""
    _, result = _teacher(splits, tiny_model_dir, tmp_path, mode="bitfit")
    before, after = _weights(tiny_model_dir), _weights(result.checkpoint)
    changed = {k for k in before if k in after and not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(".bias") for k in changed)
    assert result.ledger.epsilon <= 3.0 and "bitfit" in result.ledger.note


def test_a_kept_tie_trains_one_shared_weight_and_saves_it_tied(splits, tiny_model_dir, tmp_path, caplog):
    """teacher.untie_lm_head=false: the head tied to the input embedding stays one weight (bk clips it
    over both uses: tests/privacy/test_bk_families.py), the saved model is tied, no parameters are
    added, and the log says so; the default unties, as before."""
    caplog.set_level("INFO")
    _, tied = _teacher(splits, tiny_model_dir, tmp_path / "tied", untie_lm_head=False)
    _, untied = _teacher(splits, tiny_model_dir, tmp_path / "untied")
    assert tied.ledger.untied_parameters == 0 and untied.ledger.untied_parameters > 0
    assert "lm_head kept tied to the input embedding" in caplog.text
    model = load_causal_lm(str(tied.checkpoint))
    assert model.lm_head.weight is model.transformer.wte.weight
    before = _weights(tiny_model_dir)["transformer.wte.weight"]
    assert not torch.equal(model.transformer.wte.weight.detach(), before)  # trained
    assert "lm_head.weight" in _weights(untied.checkpoint)  # the default keeps its own head
    with pytest.raises(ValueError, match="untie_lm_head=false needs teacher.grad_sample_mode=bk"):
        TeacherConfig(untie_lm_head=False, grad_sample_mode="ghost")
    assert not TeacherConfig(mode="lora", grad_sample_mode="ghost").unties_head  # a frozen head: nothing to clip


def test_a_kept_tie_changes_the_teacher_key_and_the_default_leaves_earlier_ones_valid(tiny_config, tmp_path,
                                                                                      monkeypatch):
    """teacher.untie_lm_head came after stage caches and checkpoints existed: at its default it is in
    neither the teacher's cache key nor a checkpoint's fingerprint (a study's shared DPKD teacher, an
    interrupted run's checkpoint are still found); set to false it changes both."""
    from flows.tasks import teacher_task
    from pipeline.stages.teacher import checkpoint
    from pipeline.stages.teacher.checkpoint import checkpoint_fingerprint

    kept = tiny_config.model_copy(update={"teacher": tiny_config.teacher.model_copy(update={"untie_lm_head": False})})
    assert "untie_lm_head" not in teacher_task.cache_policy.config_of(tiny_config)["teacher"]
    assert teacher_task.cache_policy.config_of(kept)["teacher"]["untie_lm_head"] is False
    train = tmp_path / "train.parquet"
    train.write_bytes(b"records")

    def fingerprint(cfg):
        return checkpoint_fingerprint(cfg.teacher, "base", train, 0, 1.0, None)

    default = fingerprint(tiny_config)
    assert default != fingerprint(kept)
    monkeypatch.setattr(checkpoint, "at_later_defaults", lambda cfg: set())  # as if the field counted
    assert fingerprint(tiny_config) != default  # so the default's fingerprint is the one from before the field


def test_lora_saves_a_merged_plain_checkpoint(splits, tiny_model_dir, tmp_path):
    """mode=lora: only the adapted projections change, merged into a plain GPT-2 checkpoint."""
    _, result = _teacher(splits, tiny_model_dir, tmp_path, mode="lora", lora_target_modules=["c_attn"])
    before, after = _weights(tiny_model_dir), _weights(result.checkpoint)
    assert not any("lora" in k for k in after)  # merged: generation loads it like any GPT-2
    assert set(after) == set(before) and "untied" not in result.ledger.note  # the frozen head stays tied
    changed = {k for k in before if k in after and not torch.equal(before[k], after[k])}
    assert changed and all("c_attn.weight" in k for k in changed), changed


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("teacher_mode", ["full", "bitfit"])
def test_every_clipping_mode_trains_the_same_teacher(splits, tiny_model_dir, tmp_path, fixed_noise, mode,
                                                     teacher_mode, monkeypatch):
    """Same data, sampling and noise (the test hook): per-sample hooks (the reference) and
    book-keeping train to ghost clipping's weights and ledger through the whole stage, with
    padded records, several physical batches per logical one, and Adam on top. bk adds the
    noise in place, 4,096 values at a time here (pipeline/privacy/noise.py add_gaussian_), the
    others draw it through Opacus' `_generate_noise`: the same values, in lanes on parallel
    threads for parameters of 4,096 values and up here."""
    monkeypatch.setattr(noise, "NOISE_CHUNK", 4096)
    monkeypatch.setattr(noise, "LANE_MIN", 4096)
    ghost = _teacher(splits, tiny_model_dir, tmp_path / "ghost", mode=teacher_mode, grad_sample_mode="ghost")[1]
    other = _teacher(splits, tiny_model_dir, tmp_path / mode, mode=teacher_mode, grad_sample_mode=mode)[1]
    assert f"{mode} clipping" in other.ledger.note
    assert other.ledger.epsilon == ghost.ledger.epsilon and other.ledger.steps == ghost.ledger.steps
    want, got = _weights(ghost.checkpoint), _weights(other.checkpoint)
    # Adam moves each weight by about lr (1e-3) a step whatever its gradient's size, so where a
    # coordinate's gradient is near zero, float-order differences between the modes (threaded
    # reductions) can move it by a few % of a step: 4.4e-5 once in one of 4,096 weights. At a
    # tenth of a step, bk with its per-example norms 2 % off still fails (2.3e-3 in the head).
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert any(not torch.equal(want[k], v) for k, v in _weights(tiny_model_dir).items() if k in want)


class _Crash(Exception):
    pass


@pytest.mark.parametrize("secure_mode", [False, True])
def test_resume_after_crash_continues_the_same_budget(splits, tiny_model_dir, tmp_path, fixed_noise, secure_mode):
    """A run killed after step 3 (checkpoint at 2) resumes at step 2 and ends exactly as an
    uninterrupted run: same ledger (ε, σ, q, steps) and the same weights. The noise is fixed
    by the test hook for both runs, so equality needs the resumed run to restore the noise
    and sampling generators from the checkpoint (re-seeding would replay steps 1-2's noise).
    Also with secure_mode (ChaCha20 noise). The checkpoint is 0600 even under umask 0.
    ε is logged before the checkpoint (log_every=1): the accountant's numpy float once made
    every such checkpoint unloadable (found by bench/faults.py)."""
    opts = dict(batch_size=10, physical_batch_size=10, epochs=1, checkpoint_every=2, secure_mode=secure_mode,
                log_every=1)
    _, whole = _teacher(splits, tiny_model_dir, tmp_path / "whole", **opts)

    def crash_at_3(record):
        if record["step"] == 3:
            raise _Crash

    old_umask = os.umask(0)
    try:
        with pytest.raises(_Crash):
            _teacher(splits, tiny_model_dir, tmp_path / "cut", on_progress=crash_at_3, **opts)
    finally:
        os.umask(old_umask)
    state = tmp_path / "cut" / "checkpoint" / "state.pt"
    assert state.is_file()
    assert stat.S_IMODE(state.stat().st_mode) == 0o600  # it holds the secret generators' states
    assert not (tmp_path / "cut" / "manifest.json").exists()  # not finished, and does not look it

    _, resumed = _teacher(splits, tiny_model_dir, tmp_path / "cut", **opts)
    assert resumed.resumed_from_step == 2
    assert resumed.ledger.model_dump() == whole.ledger.model_dump()
    a, b = _weights(whole.checkpoint), _weights(resumed.checkpoint)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert not (tmp_path / "cut" / "checkpoint").exists()  # removed once the stage finished
    assert whole.ledger.noise_source.startswith("TEST HOOK")  # and the ledger says so


def test_a_checkpoint_from_before_whole_keying_resumes_and_the_ledger_says_so(splits, tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """Checkpoints record what their generators came from. One written before the mt19937
    generators were keyed whole (pipeline/privacy/noise.py; no `noise_source` in it) holds
    streams seeded from 32 secret bits: the resumed run's ledger says that, not today's keying."""
    monkeypatch.delenv(TEST_SEED_ENV, raising=False)

    def crash_at_2(record):
        if record["step"] == 2:
            raise _Crash

    opts = dict(batch_size=10, physical_batch_size=10, epochs=1, checkpoint_every=1, monitor="dp", log_every=1)
    with pytest.raises(_Crash):
        _teacher(splits, tiny_model_dir, tmp_path, on_progress=crash_at_2, **opts)
    path = tmp_path / "checkpoint" / "state.pt"
    state = torch.load(path, weights_only=True)
    assert state["noise_source"] == noise.source(False)
    del state["noise_source"]
    torch.save(state, path)
    _, resumed = _teacher(splits, tiny_model_dir, tmp_path, **opts)
    assert resumed.resumed_from_step >= 1
    assert resumed.ledger.noise_source == noise.legacy_source(False) != noise.source(False)
    assert "32 secret bits" in resumed.ledger.noise_source
    assert resumed.monitor_ledger.noise_source == noise.legacy_source(False)


def test_same_seed_gives_other_noise_unless_the_test_hook_fixes_it(splits, tiny_model_dir, tmp_path, monkeypatch):
    """The config's seed is published: two runs with the same seed must not draw the same DP
    noise (or anyone could regenerate it). Only the test hook makes them identical, and the
    ledger of such a run says so."""
    monkeypatch.delenv(TEST_SEED_ENV, raising=False)
    _, a = _teacher(splits, tiny_model_dir, tmp_path / "a")
    _, b = _teacher(splits, tiny_model_dir, tmp_path / "b")
    wa, wb = _weights(a.checkpoint), _weights(b.checkpoint)
    assert not any(torch.equal(wa[k], wb[k]) for k in wa if k.endswith(".weight"))
    assert a.ledger.noise_source.startswith("os-entropy")

    monkeypatch.setenv(TEST_SEED_ENV, "7")
    _, c = _teacher(splits, tiny_model_dir, tmp_path / "c")
    _, d = _teacher(splits, tiny_model_dir, tmp_path / "d")
    wc, wd = _weights(c.checkpoint), _weights(d.checkpoint)
    assert all(torch.equal(wc[k], wd[k]) for k in wc)
    assert c.ledger.noise_source.startswith("TEST HOOK") and "NOT private" in c.ledger.noise_source


def test_secure_mode_trains_without_torchcsprng(splits, tiny_model_dir, tmp_path):
    """secure_mode=true: ChaCha20 noise (no torchcsprng needed), recorded in the ledger."""
    _, result = _teacher(splits, tiny_model_dir, tmp_path, secure_mode=True)
    assert result.ledger.noise_source.startswith("csprng: ChaCha20")
    before, after = _weights(tiny_model_dir), _weights(result.checkpoint)
    assert all(torch.isfinite(w).all() for w in after.values())
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2


def test_a_planted_pickle_checkpoint_is_refused_without_running_it(splits, tiny_model_dir, tmp_path):
    """Opacus' load_checkpoint unpickles anything (weights_only=False): a state.pt planted in
    the run directory could run code. Ours loads tensors only and refuses the file."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return open, (str(marker), "w")

    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    torch.save({"fingerprint": Payload()}, tmp_path / "run" / "checkpoint" / "state.pt")
    with pytest.raises(TeacherError, match="refusing to load it"):
        _teacher(splits, tiny_model_dir, tmp_path / "run")
    assert not marker.exists()


# teacher.monitor=none, the default
PUBLIC_STEP_KEYS = {"step", "done", "total", "epsilon", "epsilon_replace_one", "seconds"}


def _publications(splits, model_dir, out, caplog):
    """Everything a teacher run publishes: progress records, log lines, training log, manifest."""
    progress = []
    caplog.clear()
    with caplog.at_level("INFO", logger="pipeline"):
        _teacher(splits, model_dir, out, on_progress=progress.append, log_every=2)
    logs = [r.getMessage() for r in caplog.records if r.name.startswith("pipeline")]
    history = json.loads((out / "training_log.json").read_text())["history"]
    manifest = json.loads((out / "manifest.json").read_text())
    return progress, logs, history, manifest


def test_nothing_published_is_computed_from_a_private_batch(splits, tiny_model_dir, tmp_path, caplog, fixed_noise):
    """The attack: read every record, log line, training log and manifest a run publishes.
    Per step there are only public quantities (no batch loss, no batch size, and under the
    default teacher.monitor=none no validation loss: tests/privacy/test_monitor.py), and with
    the noise fixed, replacing one training record changes nothing published but the clock."""
    progress, logs, history, manifest = _publications(splits, tiny_model_dir, tmp_path / "a", caplog)
    assert progress and all(set(p) <= PUBLIC_STEP_KEYS for p in progress)
    assert history and all(set(h) <= PUBLIC_STEP_KEYS for h in history)
    assert any("epsilon" in p for p in progress)
    assert not re.search(r'"(loss|records)"', json.dumps(manifest))
    for line in logs:
        assert not re.search(r"\bloss\b", line), line

    other = first_record_rewritten(splits.train, tmp_path / "other_train.parquet", "zzzz qqqq " * 20)
    changed = dataclasses.replace(splits, train=other)
    progress2, _, history2, _ = _publications(changed, tiny_model_dir, tmp_path / "b", caplog)

    def public(records):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in records]

    assert public(progress2) == public(progress) and public(history2) == public(history)


def test_resume_refuses_a_checkpoint_of_another_config(splits, tiny_model_dir, tmp_path):
    """A checkpoint written with another config is never silently continued or discarded."""
    def crash(record):
        raise _Crash

    cfg = TeacherConfig(target_epsilon=3.0, max_length=48, batch_size=10, physical_batch_size=10,
                        epochs=1, checkpoint_every=1)
    with pytest.raises(_Crash):
        train_teacher(cfg, train_path=splits.train, validation_path=splits.validation,
                      base_model=str(tiny_model_dir), out_dir=tmp_path, seed=0, on_progress=crash)
    with pytest.raises(TeacherError, match="another config"):
        _teacher(splits, tiny_model_dir, tmp_path, batch_size=10, physical_batch_size=10,
                 epochs=1, checkpoint_every=1, target_epsilon=4.0)


def test_finished_teacher_is_reused_not_retrained(splits, tiny_model_dir, tmp_path):
    """A finished teacher is found by its manifest; a changed output is refused."""
    from pipeline.stages.teacher.recipe import finished_teacher

    assert finished_teacher(tmp_path) is None
    _, result = _teacher(splits, tiny_model_dir, tmp_path)
    again = finished_teacher(tmp_path)
    assert again.ledger == result.ledger and again.checkpoint == result.checkpoint
    (tmp_path / "accountant_state.pt").write_bytes(b"tampered")
    with pytest.raises(TeacherError, match="missing or changed"):
        finished_teacher(tmp_path)


def test_budget_the_accountant_cannot_meet_is_refused_with_advice(splits, tiny_model_dir, tmp_path):
    """An ε too small for any σ (Opacus: 'The privacy budget is too low') names what to change."""
    with pytest.raises(TeacherError) as err:
        _teacher(splits, tiny_model_dir, tmp_path, target_epsilon=1e-6, target_delta=1e-8)
    msg = str(err.value)
    assert "teacher.target_epsilon" in msg and "teacher.epochs" in msg and "teacher.batch_size" in msg


def test_a_handed_plan_gives_the_sigma_the_stage_calibrates_itself(splits, tiny_model_dir, tmp_path, monkeypatch,
                                                                   caplog):
    """The flow hands the stage σ, q, steps and δ from the run's one plan (issue 39): the stage uses
    them without calibrating again, and they are exactly what it calibrates when called without
    one (one function, `plan_dp_sgd`). A plan made for other units than the split has is not used."""
    from pipeline.privacy.dpsgd import plan_dp_sgd
    from pipeline.stages.teacher import recipe

    calls = []
    monkeypatch.setattr(recipe, "plan_dp_sgd", lambda *a, **k: calls.append(a) or plan_dp_sgd(*a, **k))
    cfg, own = _teacher(splits, tiny_model_dir, tmp_path / "own")
    assert len(calls) == 1  # the stage's own calibration
    handed = plan_dp_sgd(cfg, splits.n_train, "record", cfg.target_epsilon / 2)  # a DPKD share, say
    result = train_teacher(cfg, train_path=splits.train, validation_path=splits.validation,
                           base_model=str(tiny_model_dir), out_dir=tmp_path / "handed", seed=0, dp_sgd=handed)
    assert len(calls) == 1  # none: the handed plan is used as it is
    e = result.ledger
    assert (e.noise_multiplier, e.sample_rate, e.steps, e.delta) == (
        handed.sigma, handed.sample_rate, handed.steps_allowed, handed.delta)
    assert e.epsilon <= handed.target_epsilon and f"target ε={handed.target_epsilon}" in e.note
    assert handed.sigma > own.ledger.noise_multiplier  # half the budget, more noise
    mine = plan_dp_sgd(cfg, splits.n_train)  # the plan of the stage's own budget: its own σ, to the bit
    assert (mine.sigma, mine.sample_rate, mine.steps_allowed, mine.delta) == (
        own.ledger.noise_multiplier, own.ledger.sample_rate, own.ledger.steps, own.ledger.delta)

    stale = dataclasses.replace(mine, n=mine.n + 1, sigma=123.0)
    assert recipe._schedule(cfg, splits.n_train, "record", stale, "teacher") == mine
    n = splits.n_train
    assert f"plan was made for {n + 1} records, but the training split has {n} records" in caplog.text


def test_the_learning_rate_schedule_warms_up_then_decays(splits, tiny_model_dir, tmp_path, monkeypatch):
    """Issue 59 item 3: teacher.lr_schedule linear or cosine sets each logical step's rate, a
    function of the step alone (a resumed run needs no scheduler state); constant leaves it."""
    from pipeline.stages.teacher import recipe
    from pipeline.stages.teacher.recipe import lr_factor

    cfg = TeacherConfig(lr_schedule="linear", lr_warmup_fraction=0.1)
    assert [round(lr_factor(cfg, s, 20), 3) for s in (0, 1, 2, 11, 19)] == [0.5, 1.0, 1.0, 0.5, 0.056]
    cosine = cfg.model_copy(update={"lr_schedule": "cosine"})
    assert lr_factor(cosine, 2, 20) == 1.0 and lr_factor(cosine, 11, 20) == pytest.approx(0.5)
    assert lr_factor(TeacherConfig(), 7, 20) == 1.0
    seen = []
    real = recipe.set_learning_rate

    def spy(run, step):
        real(run, step)
        seen.append((step, run.optimizer.param_groups[0]["lr"]))
    monkeypatch.setattr(recipe, "set_learning_rate", spy)
    cfg, result = _teacher(splits, tiny_model_dir, tmp_path, lr_schedule="cosine", lr_warmup_fraction=0.2)
    steps = result.ledger.steps
    assert [s for s, _ in seen] == list(range(steps + 1))  # before each step, and after the last
    rates = [lr for _, lr in seen[:steps]]
    assert rates == [pytest.approx(cfg.learning_rate * lr_factor(cfg, s, steps)) for s in range(steps)]
    assert max(rates) == pytest.approx(cfg.learning_rate) and rates[-1] < rates[len(rates) // 2]


def test_a_schedule_at_its_default_leaves_the_teacher_key_as_it_was(tiny_config):
    from flows.tasks import teacher_task

    key = teacher_task.cache_policy.config_of(tiny_config)["teacher"]
    assert "lr_schedule" not in key and "lr_warmup_fraction" not in key
    linear = tiny_config.model_copy(update={"teacher": tiny_config.teacher.model_copy(update={"lr_schedule": "linear"})})
    assert teacher_task.cache_policy.config_of(linear)["teacher"]["lr_schedule"] == "linear"
