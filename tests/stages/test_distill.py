"""Distillation stage: validation split, early stopping, hidden-state projection, tokenizer check."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import make_synthetic, make_tiny_model
from pipeline.config import DistillConfig, GenerateConfig
from pipeline.stages.distill import DistillError, distill
from pipeline.stages.generate import generate_synthetic
from pipeline.models.base import train_tokenizer


@pytest.fixture(scope="module")
def synthetic(tiny_model_dir, tmp_path_factory):
    """60 samples here, as these tests were written for (the shared fixture has 40)."""
    return make_synthetic(tiny_model_dir, tmp_path_factory.mktemp("syn"), 60)


@pytest.fixture(scope="module")
def wide_student(tiny_tokenizer, tmp_path_factory):
    """A student of another width than the teacher (16 vs 32), same tokenizer."""
    path = tmp_path_factory.mktemp("student")
    make_tiny_model(tiny_tokenizer, n_embd=16).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_early_stopping_keeps_the_best_validation_student(synthetic, tiny_model_dir, wide_student, tmp_path):
    """With patience 1 and a learning rate that overshoots, training stops early; the saved
    student is the one with the best validation loss."""
    cfg = DistillConfig(candidates=[], epochs=20, batch_size=8, learning_rate=0.05, eval_every=2, patience=1, log_every=100)
    distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir, student_model=str(wide_student),
            out_dir=tmp_path, seed=0)
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["stopped_early"] and len(log["history"]) < 20 * 6
    losses = [e["validation_loss"] for e in log["validation"]]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["best_validation_loss"] == min(losses)
    assert losses[-1] > min(losses)  # stopped after a worse evaluation, kept the better one


def test_candidates_stepped_together_train_as_each_would_alone_with_one_teacher_pass_a_batch(
    synthetic, sharp_teacher, tiny_tokenizer, tmp_path, monkeypatch
):
    """Two candidates on the same batches step side by side: each one's losses and validation are
    those of the same setting trained alone (bit for bit, with dropout drawing from the random
    state), and the teacher runs once per batch for both (3 model passes a batch, not 4). A
    candidate that stops early drops out while the other goes on (patience 1, one overshooting)."""
    from pipeline.stages import distill as distill_stage

    student = tmp_path / "dropout_student"
    model = make_tiny_model(tiny_tokenizer, n_embd=16)
    model.config.resid_pdrop = model.config.attn_pdrop = 0.2  # draws from the random state, if not reseeded right
    model.save_pretrained(student)
    tiny_tokenizer.save_pretrained(student)
    common = dict(epochs=4, batch_size=8, eval_every=2, log_every=100, patience=1)
    run = dict(synthetic_path=synthetic.path, teacher_dir=sharp_teacher, student_model=str(student), seed=0)
    alone = {}
    for lr, alpha in ((1e-3, 0.4), (0.08, 1.0)):
        out = tmp_path / f"alone-{alpha}"
        distill(DistillConfig(candidates=[], alpha=alpha, learning_rate=lr, **common), out_dir=out, **run)
        alone[alpha] = json.loads((out / "training_log.json").read_text())
    passes = []
    real_hidden = distill_stage._real_hidden
    monkeypatch.setattr(distill_stage, "_real_hidden", lambda model, batches: passes.append(1) or real_hidden(model, batches))
    distill(DistillConfig(candidates=[{"alpha": 0.4, "learning_rate": 1e-3}, {"alpha": 1.0, "learning_rate": 0.08}],
                          **common), out_dir=tmp_path / "together", **run)
    together = json.loads((tmp_path / "together" / "training_log.json").read_text())["candidates"]
    for (alpha, solo), run_log in zip(alone.items(), together.values()):
        assert [h["loss"] for h in run_log["history"]] == [h["loss"] for h in solo["history"]], alpha
        assert run_log["validation"] == solo["validation"] and run_log["stopped_early"] == solo["stopped_early"]
    steps = {name: r["steps"] for name, r in together.items()}
    assert together["alpha=1.0,learning_rate=0.08"]["stopped_early"] and len(set(steps.values())) == 2
    assert len(passes) == sum(steps.values()) + max(steps.values())  # each student's, and the teacher's once a batch


def test_beta_with_different_widths_learns_a_projection(synthetic, tiny_model_dir, wide_student, tmp_path):
    """β > 0 with hidden sizes 16 (student) and 32 (teacher) trains through a projection."""
    cfg = DistillConfig(candidates=[], epochs=1, batch_size=16, learning_rate=1e-3, beta=1.0, eval_every=100)
    result = distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir,
                     student_model=str(wide_student), out_dir=tmp_path, seed=0)
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert all(h["mse"] > 0 for h in log["history"])
    assert (result.checkpoint / "model.safetensors").is_file()


def test_student_with_another_tokenizer_is_refused_before_training(synthetic, tiny_model_dir, tmp_path):
    """A student whose vocabulary differs from the teacher's is a clear error, before any step."""
    other_tok = train_tokenizer(["completely different text " * 20, "another corpus entirely"] * 50, 280)
    path = tmp_path / "other"
    make_tiny_model(other_tok).save_pretrained(path)
    other_tok.save_pretrained(path)
    with pytest.raises(DistillError, match="different tokenizers"):
        distill(DistillConfig(), synthetic_path=synthetic.path, teacher_dir=tiny_model_dir,
                student_model=str(path), out_dir=tmp_path / "out", seed=0)
    assert not (tmp_path / "out" / "training_log.json").exists()


def test_per_code_perplexity_pools_small_codes_and_text_properties(tiny_tokenizer, tiny_model_dir):
    """Per-code perplexity never rests on fewer than 5 records; distinct-n is a share in (0, 1]."""
    from pipeline.stages.evaluate import OTHER, perplexity, text_properties
    from pipeline.models.base import load_causal_lm

    codes = ["Stars: 5"] * 6 + ["Stars: 1"] * 2
    texts = [f"Review number {i} of the place, fine." for i in range(8)]
    ppl = perplexity(load_causal_lm(str(tiny_model_dir)), tiny_tokenizer, codes, texts, window=32, batch_size=4)
    assert set(ppl.per_code) == {"Stars: 5", OTHER}
    props = text_properties(tiny_tokenizer, ["a a a a", "b c d"])
    assert props["distinct_1"] < 1 and props["texts"] == 2 and props["tokens"]["mean"] > 0
    assert text_properties(tiny_tokenizer, ["x y z"])["distinct_2"] == 1.0


def test_token_kinds_split_the_evaluation_windows(tiny_tokenizer, tiny_model_dir):
    """experiments/token_kinds.py splits the evaluation's windowed perplexity by token kind: its
    kinds cover every scored token and recombine to the stage's own figures, full and text-only."""
    import math

    from experiments.token_kinds import nll_by_kind, token_kinds
    from pipeline.records import encode_record
    from pipeline.stages.evaluate import perplexity
    from pipeline.models.base import load_causal_lm

    codes, texts = ["Stars: 5", "Stars: 1"] * 3, [f"Review {i}: fine, though the soup was cold." for i in range(6)]
    ids, kinds = token_kinds(tiny_tokenizer, codes, texts)
    assert ids == [t for c, x in zip(codes, texts) for t in encode_record(tiny_tokenizer, c, x)]
    assert kinds.count(2) == len(texts) and 0 < kinds.count(0) < kinds.count(1)
    model = load_causal_lm(str(tiny_model_dir))
    nll, count = nll_by_kind(model, ids, kinds, window=16)
    ppl = perplexity(model, tiny_tokenizer, codes, texts, window=16, batch_size=4)
    assert sum(count) == ppl.tokens and math.exp(sum(nll) / sum(count)) == pytest.approx(ppl.windowed, rel=1e-4)
    # the stage's text-only figure is the text and eos kinds of the same windows (issue 37)
    assert count[1] + count[2] == ppl.text_only["tokens"]
    assert math.exp((nll[1] + nll[2]) / (count[1] + count[2])) == pytest.approx(ppl.text_only["windowed"], rel=1e-4)


@pytest.fixture(scope="module")
def sharp_teacher(tiny_tokenizer, tmp_path_factory):
    """A teacher whose logits are 10x those of a random init (top-1 ~14% instead of ~0.5%), so
    the KL term weighs in the loss."""
    import torch

    path = tmp_path_factory.mktemp("sharp_teacher")
    model = make_tiny_model(tiny_tokenizer)
    with torch.no_grad():
        model.transformer.ln_f.weight.mul_(10.0)
        model.transformer.ln_f.bias.mul_(10.0)
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def _mtimes(cache_dir):
    return {p.name: p.stat().st_mtime_ns for p in cache_dir.iterdir()}


def test_teacher_cache_holds_the_teacher_top_k_and_is_reused_until_the_teacher_changes(
    synthetic, tiny_tokenizer, tiny_model_dir, tmp_path, caplog
):
    """The cache holds the teacher's top-k logits of every sample (both splits) and the logsumexp
    of all its logits; a second call reuses it untouched; another teacher (or k beyond the
    vocabulary) never reads it."""
    import torch

    from pipeline.stages.generate import read_synthetic
    from pipeline.stages.logit_cache import CachedTopK, LogitCacheError, build_teacher_cache
    from pipeline.models.base import load_causal_lm

    cache_dir = tmp_path / "cache"
    first = build_teacher_cache(tiny_model_dir, synthetic.path, k=5, cache_dir=cache_dir, batch_size=16)
    assert not first.reused and (cache_dir / "manifest.json").is_file()
    samples = read_synthetic(synthetic.path)
    ids = samples["sample_id"].to_pylist()
    assert set(samples["split"].to_pylist()) == {"train", "validation"}
    cached = CachedTopK(first, ids)  # every sample of both splits is there
    row = 3
    tokens = torch.tensor([samples["token_ids"][row].as_py()])
    with torch.no_grad():
        logits = load_causal_lm(str(tiny_model_dir))(tokens).logits[0, :-1, : len(tiny_tokenizer)]
    expected = logits.topk(5)
    got = cached.batch(torch.tensor([row]), torch.tensor([tokens.shape[1]]))
    torch.testing.assert_close(got.logits[0], expected.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logsumexp[0], logits.logsumexp(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.indices[0], expected.indices)

    before = _mtimes(cache_dir)
    second = build_teacher_cache(tiny_model_dir, synthetic.path, k=5, cache_dir=cache_dir, batch_size=16)
    assert second.reused and second.fingerprint == first.fingerprint and _mtimes(cache_dir) == before

    other = tmp_path / "other_teacher"
    torch.manual_seed(1)
    make_tiny_model(tiny_tokenizer).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    with caplog.at_level("WARNING", logger="pipeline.stages.logit_cache"):
        third = build_teacher_cache(other, synthetic.path, k=5, cache_dir=cache_dir, batch_size=16)
    assert not third.reused and third.fingerprint != first.fingerprint
    assert "stale (changed: teacher_sha256)" in caplog.text
    with pytest.raises(LogitCacheError, match="does not belong"):
        CachedTopK(first, ids)  # the old handle cannot read the new teacher's shards
    assert not torch.equal(CachedTopK(third, ids).batch(torch.tensor([row]), torch.tensor([tokens.shape[1]])).logits,
                           got.logits)
    with pytest.raises(LogitCacheError, match="at most 300"):
        build_teacher_cache(tiny_model_dir, synthetic.path, k=301, cache_dir=tmp_path / "big")


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distilling_from_the_full_vocabulary_cache_matches_on_the_fly(
    synthetic, tiny_tokenizer, sharp_teacher, wide_student, tmp_path, temperature
):
    """k = V cached logits give the on-the-fly loss history (to float tolerance), at T = 1 (the
    rest bucket's logsumexp read from the cache) and T = 2 (renormalised); a second student
    reuses the cache in the default place, next to the synthetic data."""
    kwargs = dict(candidates=[], epochs=1, batch_size=8, learning_rate=1e-3, eval_every=100, log_every=100, alpha=0.7,
                  temperature=temperature)
    run = dict(synthetic_path=synthetic.path, teacher_dir=sharp_teacher, student_model=str(wide_student), seed=0)
    fly = distill(DistillConfig(**kwargs), out_dir=tmp_path / "fly", **run)
    cfg = DistillConfig(teacher_top_k=len(tiny_tokenizer), **kwargs)
    first = distill(cfg, out_dir=tmp_path / "cached", **run)
    assert first.teacher_cache == synthetic.path / f"teacher_topk_k{len(tiny_tokenizer)}"
    assert len(first.train_loss) == len(fly.train_loss) > 1
    assert first.train_loss == pytest.approx(fly.train_loss, rel=1e-5)
    history = json.loads((tmp_path / "cached" / "training_log.json").read_text())["history"]
    assert all(0.7 * temperature**2 * h["kl"] > 0.1 * h["loss"] for h in history)  # the KL weighs in the loss
    again = distill(cfg, out_dir=tmp_path / "cached2", **run)
    manifest = json.loads((tmp_path / "cached2" / "manifest.json").read_text())
    assert manifest["teacher_cache_reused"] is True and again.train_loss == first.train_loss


def test_top_k_cache_with_hidden_state_mse_is_refused():
    """β > 0 needs teacher hidden states per step, which the logit cache does not hold."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="set distill.beta=0 or distill.teacher_top_k=null"):
        DistillConfig(teacher_top_k=20, beta=0.5)


def test_no_synthetic_validation_samples_is_said(tiny_model_dir, tmp_path, caplog):
    """Shards of one sample hold no validation sample (a shard of 2 or more keeps at least
    one): training goes on with the last student kept, and the log says so instead of
    silently skipping every evaluation."""
    codes = tmp_path / "codes.json"
    codes.write_text(json.dumps({"counts": {"Category: A": 1}}))
    gen = GenerateConfig(num_samples=6, batch_size=6, max_length=20, validation_fraction=0.01, shard_size=1)
    synthetic = generate_synthetic(gen, teacher_dir=tiny_model_dir, control_codes_path=codes, ledger=[],
                                   out_dir=tmp_path / "synthetic", seed=0)
    assert synthetic.n_validation == 0
    cfg = DistillConfig(candidates=[], epochs=1, batch_size=4, eval_every=1, log_every=100)
    with caplog.at_level("WARNING", logger="pipeline.stages.distill"):
        distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir, student_model=str(tiny_model_dir),
                out_dir=tmp_path / "student", seed=0)
    assert any("no validation samples" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "student" / "model" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def sharded(tiny_model_dir, tmp_path_factory):
    """30 synthetic samples in 3 shards of 10 (2 validation samples each): 24 train samples."""
    out = tmp_path_factory.mktemp("sharded")
    codes = out / "codes.json"
    codes.write_text(json.dumps({"counts": {"Category: A": 1, "Category: B": 1}}))
    cfg = GenerateConfig(num_samples=30, batch_size=10, max_length=20, validation_fraction=0.2, shard_size=10)
    return generate_synthetic(cfg, teacher_dir=tiny_model_dir, control_codes_path=codes, ledger=[],
                              out_dir=out / "synthetic", seed=0)


def test_num_synthetic_trains_on_the_first_n_train_samples(sharded, tiny_model_dir, tmp_path, caplog):
    """distill.num_synthetic=n: n samples train (the manifest and the result say so, and the log);
    the first n are those of the shards' order, so each size is a prefix of the larger ones."""
    from pipeline.stages.generate import read_synthetic, synthetic_ids

    available = sharded.n_samples - sharded.n_validation
    assert len(sharded.shards) == 3 and available > 10
    ids = synthetic_ids(sharded.path, "train", tmp_path / "ids.arrow")["sample_id"]
    assert ids == read_synthetic(sharded.path, "train")["sample_id"].to_pylist() == sorted(ids)

    cfg = DistillConfig(candidates=[], epochs=1, batch_size=4, num_synthetic=10, eval_every=100, log_every=100)
    with caplog.at_level("INFO", logger="pipeline.stages.distill"):
        result = distill(cfg, synthetic_path=sharded.path, teacher_dir=tiny_model_dir,
                         student_model=str(tiny_model_dir), out_dir=tmp_path / "student", seed=0)
    manifest = json.loads((tmp_path / "student" / "manifest.json").read_text())
    assert (manifest["train_samples"], manifest["available_samples"]) == (10, available)
    assert (result.train_samples, manifest["steps"]) == (10, 3)  # ceil(10 / 4) steps in one epoch
    assert any(f"training on 10 of the {available} synthetic train samples" in r.getMessage() for r in caplog.records)


def test_num_synthetic_beyond_the_generation_is_one_clear_error(sharded, tiny_model_dir, tmp_path):
    """More samples than were generated: refused by the config before anything runs, and, where
    only the stage knows the exact count (validation split, dropped samples), before training."""
    from conftest import tiny_pipeline_dict
    from pipeline.config import ConfigError, config_from_dict

    tree = tiny_pipeline_dict(tmp_path)
    tree["distill"]["num_synthetic"] = 25  # generate.num_samples is 24
    with pytest.raises(ConfigError, match=r"distill.num_synthetic=25 .* generate.num_samples=24"):
        config_from_dict(tree)

    available = sharded.n_samples - sharded.n_validation
    cfg = DistillConfig(candidates=[], epochs=1, batch_size=4, num_synthetic=available + 1)
    with pytest.raises(DistillError, match=rf"num_synthetic={available + 1} exceeds the {available} synthetic "
                                           rf"train samples .* at most {available}"):
        distill(cfg, synthetic_path=sharded.path, teacher_dir=tiny_model_dir, student_model=str(tiny_model_dir),
                out_dir=tmp_path / "student", seed=0)
    assert not (tmp_path / "student" / "training_log.json").exists()


def test_num_synthetic_changes_only_the_distillation_key(tiny_config):
    """Every size reuses one teacher and one generation; only the student is new. Unset, the
    keys are those from before the setting existed (earlier cached students stay hits)."""
    from flows.tasks import dp_student_task, distillation_task, generation_task

    plan = SimpleNamespace(dp_sgd={"dp-student": SimpleNamespace(target_epsilon=1.0)})  # what the key reads of it

    def keys(cfg):
        inputs = {"cfg": cfg, "synthetic": None, "teacher": None, "codes": None, "ledger": [], "base": None,
                  "data": None, "plan": plan, "run_dir": "x"}
        return {t.name: t.cache_policy.compute_key(None, inputs, {})
                for t in (generation_task, distillation_task, dp_student_task)}

    small = tiny_config.model_copy(update={"distill": tiny_config.distill.model_copy(update={"num_synthetic": 8})})
    before, after = keys(tiny_config), keys(small)
    assert before["generation"] == after["generation"] and before["dp-student"] == after["dp-student"]
    assert before["distillation"] != after["distillation"]
    assert "num_synthetic" not in distillation_task.cache_policy.config_of(tiny_config)["distill"]


@pytest.mark.parametrize("groups", [1, 2, 3, 8])
def test_the_step_in_length_groups_is_the_padded_loss(tiny_tokenizer, tiny_model_dir, wide_student, groups):
    """The step, its models run in length groups and its heads and losses on the real tokens
    only, gives the loss parts and the gradient of the padded (B, L-1, V) batch."""
    import torch

    from pipeline.batching import lm_batch
    from pipeline.devices import CPU_FP32
    from pipeline.models.base import load_causal_lm
    from pipeline.models.losses import distillation_loss, prompt_mask
    from pipeline.stages.distill import step_loss

    torch.manual_seed(0)
    teacher, student = load_causal_lm(str(tiny_model_dir)).eval(), load_causal_lm(str(wide_student))
    lengths = torch.tensor([20, 7, 13, 2, 9])
    ids = torch.randint(1, 300, (5, 20)) * (torch.arange(20) < lengths.unsqueeze(1))  # (B, L), padded with 0
    skip = torch.tensor([3, 2, 5, 0, 4])
    cfg = DistillConfig(candidates=[], alpha=0.6, temperature=2.0, length_groups=groups)
    ours = step_loss(cfg, teacher, len(tiny_tokenizer), student, None, None, ids, lengths, skip, CPU_FP32)
    ours.loss.backward()
    grad = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    batch = lm_batch(ids, lengths)
    labels = batch.pop("labels")
    with torch.no_grad():
        t_logits = teacher(**batch).logits[:, :-1]
    padded = distillation_loss(student(**batch).logits[:, :-1], t_logits, labels, prompt_mask(labels.shape[1], skip),
                               alpha=0.6, temperature=2.0)
    padded.loss.backward()
    for name in ("loss", "ce", "kl"):
        torch.testing.assert_close(getattr(ours, name), getattr(padded, name))
    for g, p in zip(grad, student.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-4)


def test_keep_samples_code_adherent_trains_on_what_the_teacher_recognises(synthetic, tiny_model_dir, tmp_path, caplog):
    """Issue 59 item 4: distill.keep_samples=code_adherent keeps exactly the train samples the
    teacher that wrote them scores highest under their requested code, and trains on those."""
    from pipeline.models.base import load_causal_lm, load_tokenizer
    from pipeline.stages.adherence import adherent_samples

    values = {"Category": {"A": "Category: A", "B": "Category: B"}}  # make_synthetic's two codes
    teacher, tok = load_causal_lm(str(tiny_model_dir)).eval(), load_tokenizer(str(tiny_model_dir))
    available = synthetic.n_samples - synthetic.n_validation
    kept = adherent_samples(teacher, tok, synthetic.path, values, available, 8)
    assert 0 < len(kept) < available  # a random teacher recognises some of its samples, not all
    cfg = DistillConfig(candidates=[], epochs=1, batch_size=4, keep_samples="code_adherent", eval_every=100,
                        log_every=100)
    with caplog.at_level("INFO", logger="pipeline.stages.distill"):
        result = distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir,
                         student_model=str(tiny_model_dir), out_dir=tmp_path / "student", seed=0, code_values=values)
    assert result.train_samples == result.available_samples == len(kept)
    assert any(f"keeping {len(kept)} of the {available} synthetic train samples" in r.getMessage()
               for r in caplog.records)
    # The ids kept are published beside the student, and the evaluation's classifier can learn from them alone.
    assert set(json.loads(result.kept_samples.read_text())["sample_ids"]) == set(kept)
    from pipeline.stages.evaluate import _downstream
    from pipeline.stages.generate import synthetic_head

    head = synthetic_head(synthetic.path, available, "train")
    codes, texts = head["control_code"].to_pylist(), head["text"].to_pylist()
    every, only_kept = (_downstream(synthetic.path, codes, texts, ["Category"], 0, ids) for ids in (None, set(kept)))
    assert every["columns"]["Category"]["synthetic_train"] == available
    assert only_kept["columns"]["Category"]["synthetic_train"] == len(kept)
