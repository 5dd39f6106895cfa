"""`empirical_audit` end to end on a tiny model: with noise off the canaries are told apart, with DP
the bound stays below the ledger's ε, and the figures stay in a 0600 private file."""

import json
import stat

import pytest
import yaml

from conftest import tiny_pipeline_dict
from pipeline.audits.empirical_run import EMPIRICAL, EmpiricalAuditError, empirical_audit, format_summary
from pipeline.config import config_from_dict
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


def test_needs_private_copies(tmp_path, tiny_model_dir):
    run = make_run(tmp_path, tiny_model_dir, keep=False)
    for f in ("train", "validation", "test"):
        (run / "data" / f"{f}.parquet").unlink()
    with pytest.raises(EmpiricalAuditError, match="data.keep_private_copies=true"):
        empirical_audit(run)


def test_noise_off_is_caught_and_dp_stays_below_its_epsilon(tmp_path, tiny_model_dir, capsys):
    run = make_run(tmp_path, tiny_model_dir)
    path, report = empirical_audit(run, canaries=128, records=40,
                                   teacher_overrides={"epochs": 30, "learning_rate": 1e-2})
    dp, off = report["models"]["dp"]["one_run"], report["models"]["noise_off"]["one_run"]
    print(format_summary(report))
    assert off["epsilon_lower_bound"] > 0.5, off
    assert dp["epsilon_lower_bound"] < report["audit_training_epsilon"] <= 1.0 + 1e-6, dp
    assert report["models"]["noise_off"]["membership"]["auc"] > report["models"]["dp"]["membership"]["auc"] - 0.1
    assert path == run / "private" / EMPIRICAL
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == [EMPIRICAL]  # the data copy and models are gone
    printed = capsys.readouterr().out
    texts = __import__("pyarrow.parquet", fromlist=["x"]).read_table(run / "data" / "train.parquet")["text"].to_pylist()
    assert not any(t[:40] in printed for t in texts if len(t) >= 40)
