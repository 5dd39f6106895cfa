"""The CLI's light commands answer without torch, transformers, Opacus or Prefect, and a
damaged run file or a slow Prefect server ends in one line, not a traceback (issue 10).

Each command runs in a fresh interpreter, which then reports which heavy modules it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.privacy.ledger import LedgerEntry, LedgerTotal, PrivacyLedger, post_processing, write_ledger

from cli_probe import _cli, child_pythonpath

ROOT = Path(__file__).resolve().parents[2]


def _run_dir(root: Path) -> Path:
    """A finished run directory with the files status, ledger show and report read (by hand)."""
    run = root / "run-tiny"
    run.mkdir()
    (run / "config.yaml").write_text("name: tiny\n")
    (run / "run.json").write_text(json.dumps({
        "tool": "dpdistill", "status": "completed", "started_at": "2026-11-21T09:00:00+0000",
        "finished_at": "2026-11-21T09:05:00+0000", "host": "elsewhere", "pid": 1}))
    (run / "stages.json").write_text(json.dumps({
        "teacher": {"status": "completed", "seconds": 12.5, "epsilon": 2.0, "output": str(run.resolve() / "teacher")},
        "evaluation": {"status": "completed", "seconds": 1.0, "output": str(run.resolve() / "evaluation")}}))
    entries = [LedgerEntry(stage="teacher", private=True, epsilon=2.0, delta=1e-3, accountant="prv",
                           mechanism="subsampled_gaussian", noise_multiplier=1.4, sample_rate=0.1, steps=12,
                           max_grad_norm=1.0, privacy_unit="record", history=[(1.4, 0.1, 12)], note="DP-SGD"),
               post_processing("evaluation", "post-processing")]
    total = LedgerTotal(epsilon=2.0, delta=1e-3, accountant="prv", composition="prv accountant",
                        complete=True, note="(ε, δ)-DP per record")
    write_ledger(run / "ledger.json", PrivacyLedger(entries=entries, total=total))
    (run / "metrics.json").write_text(json.dumps({"seconds": {"teacher": 12.5, "evaluation": 1.0}}))
    return run


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return _run_dir(tmp_path)


def test_help_imports_nothing_heavy():
    rc, out, err, heavy = _cli("--help")
    assert rc == 0 and "ledger" in out and "status" in out
    assert heavy == []


def test_status_ledger_report_import_nothing_heavy(run_dir):
    rc, out, err, heavy = _cli("status", str(run_dir))
    assert (rc, heavy) == (0, []), err
    assert "status: completed" in out and "teacher" in out and "12.5" in out and "ε = 2.0000" in out

    rc, out, err, heavy = _cli("ledger", "show", str(run_dir))
    assert (rc, heavy) == (0, []), err
    assert "TOTAL" in out and "teacher" in out and "2" in out

    rc, out, err, heavy = _cli("report", str(run_dir))
    assert (rc, heavy) == (0, []), err
    assert out.strip().endswith("report.html") and (run_dir / "report.html").is_file()


def test_config_errors_import_nothing_heavy(tmp_path):
    rc, out, err, heavy = _cli("run", "--config", "configs/demo.yaml", "bad.key=1")
    assert (rc, heavy) == (2, [])
    assert err.startswith("dpdistill: error: invalid config") and "bad" in err and "Traceback" not in err

    rc, out, err, heavy = _cli("run", "--config", str(tmp_path / "missing.yaml"))
    assert (rc, heavy) == (2, [])
    assert err.strip() == f"dpdistill: error: config file {str(tmp_path / 'missing.yaml')!r} not found; " \
                          "pass an existing YAML file"


HINTS = {  # what the flow accepts on a rerun (flows/pipeline_flow.py)
    "run.json": "run the same config again without --run-dir",
    "stages.json": "delete it and run the same command with --run-dir {run_dir}",
    "ledger.json": "run the same command with --run-dir {run_dir}",
    "metrics.json": "with --run-dir {run_dir} --from evaluation",
}


@pytest.mark.parametrize("name,commands", [
    ("run.json", [("status",), ("report",)]),
    ("stages.json", [("status",), ("report",)]),
    ("ledger.json", [("status",), ("ledger", "show"), ("report",)]),
    ("metrics.json", [("report",)]),
])
def test_damaged_json_is_named_in_one_line(run_dir, name, commands):
    path = run_dir / name
    path.write_text(path.read_text()[:25])  # truncated mid-write
    for command in commands:
        rc, out, err, heavy = _cli(*command, str(run_dir))
        assert rc == 2, (command, err)
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err, (command, err)
        assert err.startswith(f"dpdistill: error: {path} is damaged ("), (command, err)
        assert HINTS[name].format(run_dir=run_dir) in err
        assert heavy == []


def test_ledger_that_is_json_but_not_a_ledger_is_damaged(run_dir):
    (run_dir / "ledger.json").write_text('{"entries": "oops"}')
    rc, out, err, heavy = _cli("ledger", "show", str(run_dir))
    assert rc == 2 and err.startswith(f"dpdistill: error: {run_dir / 'ledger.json'} is damaged (")
    assert err.count("\n") == 1


def test_report_on_missing_directory(tmp_path):
    rc, out, err, heavy = _cli("report", str(tmp_path / "nope"))
    assert rc == 2 and heavy == []
    assert err.startswith(f"dpdistill: error: run directory {tmp_path / 'nope'} does not exist")
    assert err.count("\n") == 1


def _startup_timeout_env(env: dict) -> str:
    code = "import os, sys, flows; print(os.environ['PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS'], 'prefect' in sys.modules)"
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                       env={**base, "PYTHONPATH": child_pythonpath(), **env})
    return p.stdout.strip()


def test_ephemeral_server_timeout_defaults_to_180_unless_set():
    assert _startup_timeout_env({}) == "180 False"  # and importing flows imports no Prefect
    assert _startup_timeout_env({"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "42"}) == "42 False"


def test_ephemeral_server_timeout_is_one_line(monkeypatch, capsys, tmp_path):
    import types

    from flows import cli, cli_run

    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    timeout = RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")
    message = cli_run.prefect_server_error(timeout)
    assert "\n" not in message and "within 180 s" in message
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher" in message
    assert "prefect server start" in message and "PREFECT_API_URL=" in message
    assert cli_run.prefect_server_error(RuntimeError("something else")) is None
    assert cli_run.prefect_server_error(ValueError("ephemeral Prefect API server")) is None

    # `run` catches it where the temporary server's start is awaited, before the flow: a
    # stand-in server raises it (no real one started), a stand-in flow is never reached.
    class TimedOutServer:
        def start(self):
            pass

        def wait(self):
            raise timeout

    def dp_distill(cfg, run_dir=None, rerun=None, plan=None, split=None):
        raise AssertionError("the flow ran without a server")

    monkeypatch.setattr(cli_run, "EarlyServer", TimedOutServer)
    monkeypatch.setitem(sys.modules, "flows.pipeline_flow", types.SimpleNamespace(dp_distill=dp_distill))
    monkeypatch.setattr(cli_run, "quiet_libraries", lambda: None)
    monkeypatch.setattr(cli_run, "user_errors", lambda: (cli_run.ConfigError,))
    assert cli.main(["run", "--config", str(ROOT / "configs" / "demo.yaml"), f"run_root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"dpdistill: error: {message}" and "Traceback" not in err
    assert not list((tmp_path / ".cache").glob("*split-ahead*"))  # the split made for the plan: deleted

    def other(cfg, run_dir=None, rerun=None, plan=None, split=None):
        raise RuntimeError("a real bug")

    class Server(TimedOutServer):
        def wait(self):
            pass

    monkeypatch.setattr(cli_run, "EarlyServer", Server)

    monkeypatch.setitem(sys.modules, "flows.pipeline_flow", types.SimpleNamespace(dp_distill=other))
    assert cli.main(["run", "--config", str(ROOT / "configs" / "demo.yaml"), f"run_root={tmp_path}"]) == 1
    err = capsys.readouterr().err  # any other error keeps its traceback, then one line points at it
    assert "Traceback" in err and "RuntimeError: a real bug" in err
    assert err.splitlines()[-1].startswith("dpdistill: error: unexpected RuntimeError: a real bug (a bug: ")
    assert not list((tmp_path / ".cache").glob("*split-ahead*"))


def test_status_and_the_report_say_a_stage_ran_in_the_same_words(run_dir):
    """Issue 24: the report said "finished" where `status` said "ran" for the same stage."""
    from pipeline.reports import STAGE_WORDS

    info = json.loads((run_dir / "stages.json").read_text())
    info["teacher"]["status"], info["evaluation"]["status"] = "ran", "cached"
    (run_dir / "stages.json").write_text(json.dumps(info))
    rc, out, err, _ = _cli("status", str(run_dir))
    assert rc == 0, err
    teacher = next(line for line in out.splitlines() if line.startswith("teacher"))
    evaluation = next(line for line in out.splitlines() if line.startswith("evaluation"))
    assert STAGE_WORDS["ran"] == "finished" and " finished " in teacher and " ran " not in teacher
    assert " cached " in evaluation
    rc, out, err, _ = _cli("report", str(run_dir))
    assert rc == 0, err
    page = (run_dir / "report.html").read_text()
    assert "<td>teacher</td><td>finished</td>" in page and "<td>evaluation</td><td>cached</td>" in page


def test_ledger_show_on_a_run_stopped_before_its_ledger_says_why(run_dir, tmp_path):
    """Issue 24: it said "ledger.json not found; pass a run directory" about a run directory."""
    (run_dir / "ledger.json").unlink()
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps(info | {"status": "interrupted"}))
    rc, out, err, heavy = _cli("ledger", "show", str(run_dir))
    assert (rc, heavy) == (2, [])
    assert "has no ledger.json yet: the run stopped (interrupted)" in err and "dpdistill status" in err
    rc, out, err, _ = _cli("ledger", "show", str(tmp_path))
    assert rc == 2 and "is not a run directory" in err


def test_overrides_are_taken_anywhere_on_the_line_and_unknown_options_still_refused(capsys):
    """Issue 37: `run --config c.yaml a=1 --force generation b=2` failed with "unrecognized
    arguments: b=2". Every key=value word is an override, in the order given."""
    from flows.cli import parse_args

    args = parse_args(["run", "--config", "c.yaml", "a=1", "--force", "generation", "b=2", "--from", "evaluation",
                       "c.d=x=y"])
    assert args.overrides == ["a=1", "b=2", "c.d=x=y"] and args.force == ["generation"]
    assert args.rerun_from == "evaluation" and args.config == "c.yaml"
    assert parse_args(["plan", "--config", "c.yaml", "a=1"]).overrides == ["a=1"]
    for line in (["run", "--config", "c.yaml", "a=1", "--bogus", "b=2"],  # an unknown option
                 ["run", "--config", "c.yaml", "--bogus=1"],
                 ["status", "RUN", "a=1"]):  # status takes no overrides
        with pytest.raises(SystemExit) as e:
            parse_args(line)
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_status_shows_each_stage_s_replace_one_epsilon_beside_its_epsilon(run_dir):
    """Issue 38 item 6: the stage column had the add/remove ε only. stages.json keeps both; one
    written before keeps ε alone, and the ledger's replace-one ε fills in for it."""
    info = json.loads((run_dir / "stages.json").read_text())
    info["teacher"]["epsilon_replace_one"] = 3.04
    (run_dir / "stages.json").write_text(json.dumps(info))
    rc, out, err, heavy = _cli("status", str(run_dir))
    assert (rc, heavy) == (0, []), err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("stage"))
    assert header.split()[:5] == ["stage", "status", "seconds", "epsilon", "replace-one"]
    assert next(line for line in lines if line.startswith("teacher")).split()[2:5] == ["12.5", "2.0000", "3.0400"]
    assert next(line for line in lines if line.startswith("evaluation")).split()[2:4] == ["1.0", "evaluation"]

    del info["teacher"]["epsilon_replace_one"]
    (run_dir / "stages.json").write_text(json.dumps(info))
    ledger = json.loads((run_dir / "ledger.json").read_text())
    ledger["entries"][0]["epsilon_replace_one"] = 3.05
    (run_dir / "ledger.json").write_text(json.dumps(ledger))
    rc, out, err, _ = _cli("status", str(run_dir))
    assert rc == 0, err
    assert next(line for line in out.splitlines() if line.startswith("teacher")).split()[3:5] == ["2.0000", "3.0500"]
