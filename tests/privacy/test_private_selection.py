"""Choosing the student on the private validation split (distill.select_by=private_validation,
issue 20's second route): only noisy scores leave the stage, as a ledger entry of their own."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DistillConfig, config_from_dict
from pipeline.models.base import load_causal_lm, load_tokenizer
from pipeline.models.scoring import nll_by_owner
from pipeline.plan import make_plan
from pipeline.privacy import private_selection
from pipeline.privacy.accountant import epsilon_of
from pipeline.privacy.ledger import compose
from pipeline.privacy.monitor import MonitorError
from pipeline.privacy.private_selection import PrivateValidation
from pipeline.stages.distill import DistillError, distill
from pipeline.tokenized import TokenIds, token_column, tokenized_split
from conftest import tiny_pipeline_dict


def _validation_split(synthetic, path: Path) -> Path:
    """A 'private' validation split of texts the teacher wrote, as the data stage writes one:
    a student that stays the teacher scores far better on it than one driven away from it."""
    table = pq.read_table(synthetic.shards[0])
    codes = table["control_code"].to_pylist()
    pq.write_table(pa.table({"control_code": codes, "text": table["text"].to_pylist()}), path)
    return path


def test_the_planted_best_candidate_is_chosen_from_noisy_private_scores(synthetic, tiny_model_dir, tmp_path):
    """The student starts as a copy of the teacher; 'learning_rate=1e-09' stays it, the other is
    driven away. On texts the teacher wrote, the copy's validation loss is lower by many noise
    sds: it is chosen. Only noisy scores are published, the entry is the accountant's."""
    student = tmp_path / "student"
    shutil.copytree(tiny_model_dir, student)
    validation = _validation_split(synthetic, tmp_path / "validation.parquet")
    cfg = DistillConfig(candidates=[{"learning_rate": 5.0, "epochs": 3}, {"learning_rate": 1e-9}], batch_size=8,
                        eval_every=1000, log_every=1000, selection_samples=8, select_by="private_validation",
                        selection_epsilon=8.0)
    spec = PrivateValidation(path=validation, delta=1e-5, accountant="prv", max_length=64)
    result = distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir, student_model=str(student),
                     out_dir=tmp_path / "out", seed=0, private_validation=spec)
    sel = json.loads((tmp_path / "out" / "selection.json").read_text())
    assert sel["chosen"] == "learning_rate=1e-09" == result.selection["chosen"]
    noisy = {r["candidate"]: r["private_validation"] for r in sel["candidates"]}
    sd = sel["private_validation"]["noise_sd"]
    assert noisy["epochs=3,learning_rate=5.0"] - noisy["learning_rate=1e-09"] > 5 * sd > 0

    # The published score is the exact clipped mean plus noise, never the exact mean itself.
    tok = load_tokenizer(str(tiny_model_dir))
    records = TokenIds(token_column(tokenized_split(validation, tok)), 64, tok.pad_token_id)
    nll, count = nll_by_owner(load_causal_lm(str(result.checkpoint)), records, list(range(len(records))),
                              len(records), 8)
    exact = float((nll / count).clip(0, cfg.selection_clip).mean())
    assert noisy["learning_rate=1e-09"] != exact and abs(noisy["learning_rate=1e-09"] - exact) < 6 * sd

    entry = result.selection_ledger
    assert entry.stage == private_selection.STAGE and entry.private and entry.mechanism == "gaussian"
    assert entry.history == [(entry.noise_multiplier, 1.0, 2)] and entry.steps == 2
    assert entry.epsilon == pytest.approx(epsilon_of("prv", entry.history, 1e-5)) and entry.epsilon <= 8.0 + 1e-6
    assert sd == pytest.approx(entry.noise_multiplier * cfg.selection_clip / len(records))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["selection_ledger"]["stage"] == private_selection.STAGE


def test_the_training_split_scores_too_and_a_user_is_one_unit_across_the_splits(synthetic, tiny_model_dir, tmp_path):
    """selection_split=train+validation: the validation units, then the training units, in one
    mean, with the noise multiplier of the same ε and k, so a noise sd n_val/n as large. The
    accounting rests on one unit moving each score by at most C/n: at user level a user is one
    unit whichever split holds their records, so a user on both sides (which the data stage never
    writes) is not counted twice; splits that disagree on the unit are refused."""
    validation = _validation_split(synthetic, tmp_path / "validation.parquet")
    train = _validation_split(synthetic, tmp_path / "train.parquet")
    tok = load_tokenizer(str(tiny_model_dir))
    spec = PrivateValidation(path=validation, delta=1e-5, accountant="prv", max_length=64, train=train)
    n_val = pq.read_metadata(validation).num_rows

    def scorer(limit=None, **change):
        return private_selection.setup(dataclasses.replace(spec, **change), tok, candidates=2, epsilon=0.2, clip=10.0,
                                       limit=limit)

    only, both = scorer(train=None), scorer()
    assert (only.n, both.n, both.owners) == (n_val, 2 * n_val, list(range(2 * n_val)))
    assert both.z == only.z and f"over the first {2 * n_val} validation and training records" in both.entry.note
    assert [both.records[i][0].tolist() for i in (0, n_val)] == [only.records[0][0].tolist()] * 2
    assert (scorer(limit=n_val + 3).n, scorer(limit=n_val - 1).n) == (n_val + 3, n_val - 1)

    for path, users in ((validation, ["a", "a", "b"]), (train, ["b", "c", "c"])):
        pq.write_table(pq.read_table(path).slice(0, 3).append_column("user", pa.array(users)), path)
    by_user = scorer()
    assert (by_user.n, by_user.owners) == (3, [0, 0, 1, 1, 2, 2]) and "3 validation and training users" in by_user.entry.note
    pq.write_table(pq.read_table(train).drop(["user"]), train)
    with pytest.raises(MonitorError, match="disagree on the privacy unit"):
        scorer()


def test_the_private_route_needs_the_split_and_refuses_before_training(synthetic, tiny_model_dir, tmp_path):
    cfg = DistillConfig(candidates=[{"alpha": 0.0}, {"alpha": 1.0}], select_by="private_validation")
    with pytest.raises(DistillError, match="private validation split"):
        distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir, student_model=str(tiny_model_dir),
                out_dir=tmp_path, seed=0)
    assert not (tmp_path / "candidates").exists()  # refused before any student trained


def test_the_planned_release_composes_into_the_run_total(tmp_path):
    """`dpdistill plan` (and the flow's max_epsilon pre-check) sees the selection's release: one
    more Gaussian history, composed by the accountant with the codes' and the teacher's."""
    tree = tiny_pipeline_dict(tmp_path)
    plain = make_plan(config_from_dict(tree))
    tree["distill"] |= {"select_by": "private_validation", "selection_epsilon": 0.5,
                        "candidates": [{"alpha": 0.4}, {"alpha": 1.0}]}
    plan = make_plan(config_from_dict(tree))
    stages = [e.stage for e in plan.entries]
    assert stages == [*(e.stage for e in plain.entries), private_selection.STAGE]
    selected = plan.entries[-1]
    assert selected.epsilon == pytest.approx(0.5, rel=0.05) and selected.history[0][1:] == (1.0, 2)
    joint = [h for e in plan.entries for h in e.history]
    assert plan.total.epsilon == pytest.approx(epsilon_of("prv", joint, plan.total.delta))
    assert plain.total.epsilon < plan.total.epsilon < plain.total.epsilon + selected.epsilon
    assert compose(plan.entries, "prv", plan.total.delta).epsilon == pytest.approx(plan.total.epsilon)
    # DP-Syn trains one student: nothing to choose, nothing released.
    tree["distill"]["method"] = "dp_syn"
    assert private_selection.STAGE not in [e.stage for e in make_plan(config_from_dict(tree)).entries]
