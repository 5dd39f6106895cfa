"""Distillation stage: validation split, early stopping, hidden-state projection, tokenizer check."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny_model
from pipeline.config import DistillConfig, GenerateConfig
from pipeline.distill import DistillError, distill
from pipeline.generate import generate_synthetic
from pipeline.models import train_tokenizer


@pytest.fixture(scope="module")
def synthetic(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("syn")
    codes = out / "codes.json"
    codes.write_text(json.dumps({"counts": {"Category: A": 3, "Category: B": 1}}))
    cfg = GenerateConfig(num_samples=60, batch_size=30, max_length=32, validation_fraction=0.2)
    return generate_synthetic(cfg, teacher_dir=tiny_model_dir, control_codes_path=codes, ledger=[],
                              out_dir=out / "synthetic", seed=0)


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
    cfg = DistillConfig(epochs=20, batch_size=8, learning_rate=0.05, eval_every=2, patience=1, log_every=100)
    distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir, student_model=str(wide_student),
            out_dir=tmp_path, seed=0)
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["stopped_early"] and len(log["history"]) < 20 * 6
    losses = [e["validation_loss"] for e in log["validation"]]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["best_validation_loss"] == min(losses)
    assert losses[-1] > min(losses)  # stopped after a worse evaluation, kept the better one


def test_beta_with_different_widths_learns_a_projection(synthetic, tiny_model_dir, wide_student, tmp_path):
    """β > 0 with hidden sizes 16 (student) and 32 (teacher) trains through a projection."""
    cfg = DistillConfig(epochs=1, batch_size=16, learning_rate=1e-3, beta=1.0, eval_every=100)
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
    from pipeline.evaluate import OTHER, perplexity, text_properties
    from pipeline.models import load_causal_lm

    codes = ["Stars: 5"] * 6 + ["Stars: 1"] * 2
    texts = [f"Review number {i} of the place, fine." for i in range(8)]
    ppl = perplexity(load_causal_lm(str(tiny_model_dir)), tiny_tokenizer, codes, texts, window=32, batch_size=4)
    assert set(ppl.per_code) == {"Stars: 5", OTHER}
    props = text_properties(tiny_tokenizer, ["a a a a", "b c d"])
    assert props["distinct_1"] < 1 and props["texts"] == 2 and props["tokens"]["mean"] > 0
    assert text_properties(tiny_tokenizer, ["x y z"])["distinct_2"] == 1.0
