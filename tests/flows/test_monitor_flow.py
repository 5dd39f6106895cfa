"""teacher.monitor=dp through the real flow: the validation-loss release is in the ledger, the
run's total and the budget spent on the dataset across runs (issue 21 item 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.pipeline_flow import dp_distill
from pipeline.privacy.accountant import epsilon_of
from pipeline.privacy.budget import read_budget
from pipeline.privacy.ledger import read_ledger


def test_a_dp_monitor_release_is_composed_into_the_total_and_the_budget(prefect_server, tmp_path):
    """The DP-SGD baseline (the cheapest flow with a DP-SGD stage) with monitor=dp: its ledger
    lists the student's validation-loss release beside its training, the total composes both
    histories through the accountant, and the dataset's budget records both releases."""
    from conftest import tiny_pipeline_dict
    from pipeline.config import config_from_dict

    tree = tiny_pipeline_dict(tmp_path)
    tree["distill"]["method"] = "dp_sgd"
    tree["teacher"] |= {"monitor": "dp", "monitor_epsilon": 1.0, "log_every": 1}
    cfg = config_from_dict(tree)
    run = Path(dp_distill(cfg))
    ledger = read_ledger(run / "ledger.json")
    # one name for the student's DP-SGD stage: the flow's, the ledger's and the budget's (issue 37)
    assert [e.stage for e in ledger.entries] == ["dp-student", "dp-student-validation", "evaluation"]
    trained, released = ledger.entry("dp-student"), ledger.entry("dp-student-validation")
    assert released.steps == trained.steps and released.sample_rate == 1.0  # log_every=1: every step releases
    joint = epsilon_of("prv", trained.history + released.history, trained.delta)
    assert ledger.total.epsilon == pytest.approx(joint) and ledger.total.epsilon > trained.epsilon
    assert "dp-student-validation" in ledger.total.note
    history = json.loads((run / "student" / "training_log.json").read_text())["history"]
    assert sum("validation_loss" in h for h in history) == released.steps
    records_id = json.loads((run / "run.json").read_text())["records_id"]  # the budget of the records used
    budget = read_budget(Path(cfg.run_root).resolve(), records_id)
    assert sorted(r.stage for r in budget.releases) == ["dp-student", "dp-student-validation"]
    card = (run / "student" / "model" / "README.md").read_text()
    assert "teacher.monitor=dp" in card and "validation records are covered" in card
