"""Choosing the student among distillation candidates from DP outputs only (issue 20)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, DistillConfig, config_from_dict
from pipeline.models.base import load_causal_lm
from pipeline.stages.distill import distill
from pipeline.stages.generate import sample_untruncated
from pipeline.stages.selection import choose, criterion_study, score_students, spearman
from pipeline.tokenized import ListIds
from conftest import make_tiny_model, tiny_pipeline_dict


def test_untruncated_samples_follow_the_whole_distribution(tiny_model_dir, tiny_tokenizer):
    """No top-k, no top-p: the first generated token lands outside the model's 50 most likely
    tokens as often as its softmax says (HF's generate would apply its default top_k=50 if the
    truncation were merely left unset)."""
    model = load_causal_lm(str(tiny_model_dir)).eval()
    prompt = "Category: A\n\n"
    ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)  # (V,)
    top50 = set(torch.topk(p, 50).indices.tolist())
    tail_mass = float(1 - p[list(top50)].sum())
    assert tail_mass > 0.2  # a random tiny model: the tail is large, so truncation would show
    n = 600
    seqs = sample_untruncated(model, tiny_tokenizer, {"Category: A": 1.0}, n, len(ids) + 1, seed=0, batch_size=200)
    first = [s[len(ids)] for s in seqs]
    outside = sum(t not in top50 for t in first) / n
    sd = (tail_mass * (1 - tail_mass) / n) ** 0.5
    assert abs(outside - tail_mass) < 4 * sd, (outside, tail_mass)


def test_a_student_equal_to_the_teacher_scores_zero_kl_and_is_chosen(tiny_model_dir, tiny_tokenizer):
    teacher = load_causal_lm(str(tiny_model_dir))
    torch.manual_seed(1)
    other = make_tiny_model(tiny_tokenizer)
    seqs = sample_untruncated(teacher, tiny_tokenizer, {"Category: A": 1.0}, 12, 24, seed=0)
    scores = score_students(teacher, {"other": other, "copy": load_causal_lm(str(tiny_model_dir))},
                            ListIds(seqs, tiny_tokenizer.pad_token_id), len(tiny_tokenizer), batch_size=5)
    assert scores["copy"]["teacher_kl"] == pytest.approx(0.0, abs=1e-5)
    assert scores["other"]["teacher_kl"] > 0.01
    # The CE equals the KL plus the teacher's entropy only in expectation: on 12 samples its
    # gap can even have the wrong sign, which is why teacher_kl is the default criterion.
    assert all(s["untruncated_ce"] > 0 for s in scores.values())
    rows = [{"candidate": k, **v} for k, v in scores.items()]
    assert choose(rows, "teacher_kl") == "copy"


def test_distill_keeps_the_planted_best_candidate(synthetic, tiny_model_dir, tmp_path):
    """The student starts as a copy of the teacher. Candidate 'learning_rate=1e-09' barely
    moves it (KL ~ 0), the other is driven away by a large learning rate: the first is kept,
    its weights are the stage's model, and the selection table is written."""
    student = tmp_path / "student"
    shutil.copytree(tiny_model_dir, student)
    cfg = DistillConfig(candidates=[{"learning_rate": 0.5, "epochs": 3}, {"learning_rate": 1e-9}], batch_size=8,
                        eval_every=1000, log_every=1000, selection_samples=16)
    result = distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir, student_model=str(student),
                     out_dir=tmp_path / "out", seed=0)
    sel = json.loads((tmp_path / "out" / "selection.json").read_text())
    assert sel["chosen"] == "learning_rate=1e-09" == result.selection["chosen"]
    kl = {r["candidate"]: r["teacher_kl"] for r in sel["candidates"]}
    assert kl["learning_rate=1e-09"] < 1e-3 < kl["epochs=3,learning_rate=0.5"]
    assert {r["candidate"] for r in sel["candidates"]} == {"epochs=3,learning_rate=0.5", "learning_rate=1e-09"}
    assert all(r["untruncated_ce"] > 0 and r["synthetic_validation_ce"] is not None for r in sel["candidates"])
    kept = load_causal_lm(str(result.checkpoint)).state_dict()
    base = load_causal_lm(str(tiny_model_dir)).state_dict()
    assert all(torch.allclose(kept[k], base[k], atol=1e-5) for k in base)
    assert not (tmp_path / "out" / "candidates").exists() and result.candidates is None
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["chosen"] == "learning_rate=1e-09" and "selection" in manifest["outputs"]


def test_keep_candidates_keeps_every_student(synthetic, tiny_model_dir, tmp_path):
    cfg = DistillConfig(candidates=[{"alpha": 0.0}, {"alpha": 1.0}], batch_size=8, epochs=1, eval_every=1000,
                        selection_samples=8, keep_candidates=True, select_by="untruncated_ce")
    result = distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir,
                     student_model=str(tiny_model_dir), out_dir=tmp_path, seed=0)
    assert set(result.candidates) == {"alpha=0.0", "alpha=1.0"}
    assert all((p / "model.safetensors").is_file() for p in result.candidates.values())
    rows = result.selection["candidates"]
    assert result.selection["chosen"] == min(rows, key=lambda r: r["untruncated_ce"])["candidate"]


def test_candidates_are_checked_when_the_config_loads(tmp_path):
    with pytest.raises(ValueError, match=r"candidates\[1\] sets \['alpah'\]"):
        DistillConfig(candidates=[{"alpha": 1.0}, {"alpah": 1.0}])
    with pytest.raises(ValueError, match=r"(?s)candidates\[0\].*alpha = 2"):
        DistillConfig(candidates=[{"alpha": 2}, {"alpha": 1.0}])
    with pytest.raises(ValueError, match="same settings"):
        DistillConfig(candidates=[{"alpha": 1.0}, {"alpha": 1.0}])
    tree = tiny_pipeline_dict(tmp_path)
    tree["distill"]["candidates"] = [{"alpha": 0.5}, {"beta": -1}]
    with pytest.raises(ConfigError, match="beta"):
        config_from_dict(tree)


def test_a_setting_every_candidate_overrides_is_warned_about(caplog):
    with caplog.at_level("WARNING", logger="pipeline.config"):
        DistillConfig(alpha=0.7)
        DistillConfig(alpha=0.7, candidates=[])  # one setting: alpha is used, nothing to say
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "distill.alpha set, but distill.candidates sets it too" in warned[0]


def test_dpkd_says_it_reads_alpha_not_the_candidates(caplog):
    """DPKD's KD loss takes distill.alpha: the candidates' warning must not claim they are used."""
    with caplog.at_level("WARNING", logger="pipeline.config"):
        DistillConfig(method="dpkd", alpha=0.7)  # the default candidates, not set: nothing to say
        DistillConfig(method="dpkd", alpha=0.7, candidates=[{"alpha": 0.4}, {"alpha": 1.0}])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "distill.method=dpkd trains one DP-SGD student and never reads it" in warned[0]
    assert "distill.alpha" in warned[0] and "each candidate's value is used" not in warned[0]


def test_spearman_and_the_criterion_study():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 1, 2], [3, 3, 5]) == pytest.approx(1.0)  # ties share their rank
    rows = [{"candidate": "a", "teacher_kl": 0.1, "untruncated_ce": 3.0, "synthetic_validation_ce": 2.9,
             "test_perplexity": 160.0},
            {"candidate": "b", "teacher_kl": 0.3, "untruncated_ce": 3.2, "synthetic_validation_ce": 2.3,
             "test_perplexity": 190.0},
            {"candidate": "c", "teacher_kl": 0.2, "untruncated_ce": 3.1, "synthetic_validation_ce": 2.5,
             "test_perplexity": 170.0}]
    study = criterion_study(rows)
    assert study["teacher_kl"] == {"spearman": pytest.approx(1.0), "chooses": "a", "regret": 0.0}
    assert study["synthetic_validation_ce"]["chooses"] == "b"
    assert study["synthetic_validation_ce"]["regret"] == pytest.approx(30.0)
    assert study["synthetic_validation_ce"]["spearman"] == pytest.approx(-1.0)
    assert np.isfinite(study["untruncated_ce"]["spearman"])
