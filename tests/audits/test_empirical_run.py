"""`empirical_audit` end to end on a tiny model: with noise off the canaries are told apart, with DP
the bound stays below the ledger's ε, and the figures stay in a 0600 private file."""

import json
import stat

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import tiny_pipeline_dict
from flows.cli import main
from pipeline.audits.empirical_run import EMPIRICAL, EmpiricalAuditError, empirical_audit
from pipeline.config import config_from_dict
from pipeline.privacy.budget import dataset_total, read_budget
from pipeline.stages.data import prepare_data


def make_run(tmp_path, model_dir, keep=True):
    tree = tiny_pipeline_dict(tmp_path)
    tree["data"]["keep_private_copies"] = keep
    tree["teacher"].update(target_epsilon=1.0, max_length=48, physical_batch_size=32)
    cfg = config_from_dict(tree)
    run = tmp_path / "run"
    (run / "teacher").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    prepare_data(cfg.data, run / "data")
    (run / "teacher" / "manifest.json").write_text(json.dumps({"base_model": str(model_dir)}))
    return run


def test_needs_private_copies(tmp_path, tiny_model_dir, capsys):
    run = make_run(tmp_path, tiny_model_dir, keep=False)
    for f in ("train", "validation", "test"):
        (run / "data" / f"{f}.parquet").unlink()
    with pytest.raises(EmpiricalAuditError, match="data.keep_private_copies=true"):
        empirical_audit(run)
    assert main(["audit", "--empirical", str(run)]) == 2
    assert "data.keep_private_copies=true" in capsys.readouterr().err
    assert main(["audit", "--empirical", str(run), "generate.num_samples=3"]) == 2


def test_noise_off_is_caught_and_dp_stays_below_its_epsilon(tmp_path, tiny_model_dir, capsys):
    """With --noise-off: both trainings, the noise-off one's power measured, and the records'
    budget holds the DP training as its own entry and the noise-off one as a release without DP."""
    run = make_run(tmp_path, tiny_model_dir)
    assert main(["audit", "--empirical", "--noise-off", str(run), "--canaries", "128", "teacher.epochs=30",
                 "teacher.learning_rate=0.01"]) == 0
    path = run / "private" / EMPIRICAL
    report = json.loads(path.read_text())
    budget = read_budget(tmp_path / "runs", report["records_budget"])
    assert [(r.stage, r.entry.private) for r in budget.releases] == [("empirical-audit", True),
                                                                     ("empirical-audit-noise-off", False)]
    assert budget.releases[0].entry.epsilon == pytest.approx(report["audit_training_epsilon"])
    total = dataset_total(budget, "prv", report["delta"])
    assert not total.complete and "NOT differentially private: empirical-audit-noise-off" in total.note
    assert report["power"]["noise_off_lower_bound"] == report["models"]["noise_off"]["one_run"]["epsilon_lower_bound"]
    dp, off = report["models"]["dp"]["one_run"], report["models"]["noise_off"]["one_run"]
    assert report["teacher_overrides"] == {"epochs": 30, "learning_rate": 0.01}
    assert off["epsilon_lower_bound"] > 0.5, off  # 1.0 in a trial: 119 of 128 guesses right
    assert dp["epsilon_lower_bound"] < report["audit_training_epsilon"] <= 1.0 + 1e-6, dp
    assert report["models"]["noise_off"]["membership"]["auc"] > report["models"]["dp"]["membership"]["auc"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == [EMPIRICAL]  # the data copy and models are gone
    printed = capsys.readouterr().out
    assert "ε lower bound" in printed and "noise_off (NO DP" in printed and "power" in printed.lower()
    texts = pq.read_table(run / "data" / "train.parquet")["text"].to_pylist()
    assert not any(t[:30] in printed for t in texts if len(t) >= 30)
    def lists(x):  # no per-canary or per-record values (texts, coins, scores) in the file: aggregates only
        return isinstance(x, list) or isinstance(x, dict) and any(map(lists, x.values()))
    assert not lists(report)
    assert not (run / "report.html").exists()


def test_by_default_only_the_dp_training_runs_charged_to_the_records_budget(tmp_path, tiny_model_dir, capsys):
    """Issue 62 item 6: the audit's trainings on the private split were charged to no budget, and
    the noise-off figures (no DP guarantee) were computed and printed by default. Now the DP
    training is the budget's `empirical-audit` entry, and nothing without DP runs unasked."""
    run = make_run(tmp_path, tiny_model_dir)
    assert main(["audit", "--empirical", str(run), "--canaries", "16", "teacher.epochs=2"]) == 0
    report = json.loads((run / "private" / EMPIRICAL).read_text())
    printed = capsys.readouterr().out
    assert list(report["models"]) == ["dp"] and "noise_off" not in printed
    [release] = read_budget(tmp_path / "runs", report["records_budget"]).releases
    assert release.stage == "empirical-audit" and release.entry.private
    assert release.entry.epsilon == pytest.approx(report["audit_training_epsilon"]) and release.run_dir == str(run)
    # 16 canaries cannot show ε = 1 even with every guess right: said, with the m that could
    assert report["power"]["has_power"] is False and report["power"]["canaries_for_power"] > 16
    assert "NO POWER: 16 canaries" in printed and f"--canaries {report['power']['canaries_for_power']} " in printed


def test_privacy_max_epsilon_refuses_the_audit_training_before_it_trains(tmp_path, tiny_model_dir, capsys):
    """The audit's DP training is one more release on the records: past privacy.max_epsilon it is
    refused, with the budget named, and nothing is trained or recorded."""
    run = make_run(tmp_path, tiny_model_dir)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["privacy"] = {**cfg.get("privacy", {}), "max_epsilon": 0.5}  # below the training's target ε = 1
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["audit", "--empirical", str(run), "--canaries", "16"]) == 2
    err = capsys.readouterr().err
    assert "privacy.max_epsilon=0.5" in err and "refused before training" in err
    assert not (run / "private" / EMPIRICAL).exists() and list((run / "private").iterdir()) == []
    budgets = list((tmp_path / "runs" / ".privacy").glob("*.json"))
    assert [json.loads(b.read_text())["releases"] for b in budgets] == [[]]
