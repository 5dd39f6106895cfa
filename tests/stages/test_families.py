"""Every decoder family of the matrix through every stage (issue 35 item 6, CONVENTIONS 15):
a tiny random-init teacher of each family trains one DP-SGD step in bk, ghost and LoRA (bk)
with its ledger entry, writes synthetic samples with the fast engine and the hf reference,
distils a student of its own family, half as wide, for one epoch (the teacher's logits and the hidden-state MSE
across widths), and is evaluated. bk's exactness per family is tests/privacy/test_bk_families.py,
the engine's per family tests/models/test_decoding_families.py; this checks the stages run them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from families import FAMILIES
from pipeline.config import DistillConfig, EvalConfig, GenerateConfig, TeacherConfig
from pipeline.stages.distill import distill
from pipeline.stages.evaluate import evaluate_models
from pipeline.stages.generate import generate_synthetic, read_synthetic
from pipeline.stages.teacher.recipe import train_teacher

NAMES = sorted(FAMILIES)
STEP = dict(target_epsilon=8.0, epochs=1, batch_size=50, physical_batch_size=25, max_length=48, learning_rate=1e-3)


@pytest.fixture(scope="module")
def family_dirs(tiny_tokenizer, tmp_path_factory):
    """Per family: a teacher (2 layers × 64, FAMILIES) and a student half as wide, saved."""
    root = tmp_path_factory.mktemp("families")

    def save(name: str) -> dict:
        torch.manual_seed(0)
        teacher = FAMILIES[name](len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
        text = teacher.config.get_text_config()
        fields = {k: v for k, v in text.to_dict().items() if k != "layer_types"}  # rebuilt for one layer
        small = type(text)(**{**fields, **_narrower(text)})
        student = type(teacher)(small)
        dirs = {}
        for role, model in (("teacher", teacher), ("student", student)):
            dirs[role] = root / name / role
            model.save_pretrained(dirs[role])
            tiny_tokenizer.save_pretrained(dirs[role])
        return dirs
    return {name: save(name) for name in NAMES}


def _narrower(config) -> dict:
    """One layer, half the width (the head size kept), for a student of the teacher's family."""
    wide = {"n_embd": 32, "n_layer": 1, "n_head": 2} if config.model_type == "gpt2" else {
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        **({"num_key_value_heads": 1} if hasattr(config, "num_key_value_heads") else {}),
        **({"word_embed_proj_dim": 32} if config.model_type == "opt" else {})}
    return wide


@pytest.mark.parametrize("family", NAMES)
def test_a_family_goes_through_every_stage(family, family_dirs, splits, tmp_path):
    dirs = family_dirs[family]
    results = {}
    modes = (("bk", {}), ("ghost", {"grad_sample_mode": "ghost"}), ("lora", {"mode": "lora"}))
    if family in ("gemma", "opt"):  # layers Opacus' hooks cannot wrap: preflight refuses ghost (its test)
        modes = modes[::2]
    for label, extra in modes:
        results[label] = train_teacher(TeacherConfig(**STEP, **extra), train_path=splits.train,
                                       validation_path=splits.validation, base_model=str(dirs["teacher"]),
                                       out_dir=tmp_path / f"teacher-{label}", seed=0)
        entry = results[label].ledger
        assert entry.private and entry.steps >= 1 and 0 < entry.epsilon <= 8.0, (label, entry)
        assert entry.mechanism == "subsampled_gaussian" and entry.history
    teacher = results["bk"].checkpoint
    codes = tmp_path / "codes.json"
    codes.write_text(json.dumps({"counts": {"Category: A": 3, "Category: B": 1}}))
    synthetic = {}
    for engine in ("fast", "hf"):  # empty samples are dropped: up to 16
        synthetic[engine] = generate_synthetic(
            GenerateConfig(num_samples=16, batch_size=8, max_length=32, validation_fraction=0.25, engine=engine),
            teacher_dir=teacher, control_codes_path=codes, ledger=[], out_dir=tmp_path / f"synthetic-{engine}", seed=0)
        samples = read_synthetic(synthetic[engine].path)
        assert 0 < samples.num_rows <= 16 and set(samples["control_code"].to_pylist()) <= {"Category: A", "Category: B"}
    student = distill(DistillConfig(candidates=[], epochs=1, batch_size=8, learning_rate=1e-3, teacher_top_k=None,
                                    beta=0.5, eval_every=2),
                      synthetic_path=synthetic["fast"].path, teacher_dir=teacher, student_model=str(dirs["student"]),
                      out_dir=tmp_path / "student", seed=0)
    metrics = evaluate_models(EvalConfig(window=32, batch_size=8),
                              models={"dp_teacher": str(teacher), "student": str(student.checkpoint)},
                              test_path=splits.test, out_dir=tmp_path / "evaluation", seed=0,
                              synthetic_path=synthetic["fast"].path)
    for name in ("dp_teacher", "student"):
        assert math.isfinite(metrics["perplexity"][name]["windowed"]), (name, metrics["perplexity"])
