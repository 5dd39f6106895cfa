"""A user error inside the flow ends `dpdistill run` with one line, last, and exit code 2;
its traceback is in the run's run.log, not on the terminal (issue 10)."""

from __future__ import annotations

import csv
import logging
import os
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import ROOT, YELP_TRAIN, tiny_pipeline_dict
from cli_probe import child_pythonpath
from flows.run_log import QuietExpectedErrors
from pipeline.records import DataError


def cli_env(tmp_path: Path) -> dict:
    """The caller's environment without its Prefect settings: the run starts its own
    temporary server, on a database of its own (other runs may use the default one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return env | {"PREFECT_HOME": str(tmp_path / "prefect_home"), "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}


def _run(tmp_path: Path, tree: dict, api_url: str | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`dpdistill run` in a subprocess: its own temporary server, or the one at `api_url`."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tree))
    env = cli_env(tmp_path) | ({"PREFECT_API_URL": api_url} if api_url else {})
    p = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(config)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    return p, [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]


def test_a_bad_record_is_one_line_before_any_server_starts(tmp_path):
    """A control-code value outside the declared domain, in row 5: found by reading every row
    before the run starts (the plan splits the data as the data stage will), so no Prefect
    server and no run directory; one error line, last, naming the row and never the value."""
    rows = list(csv.reader(YELP_TRAIN.open()))[:60]
    rows[5][1] = "Business Category: Spaceships"  # data row 5
    bad = tmp_path / "bad.csv"
    with bad.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    tree = tiny_pipeline_dict(tmp_path)
    tree["data"]["path"] = str(bad)
    p, lines = _run(tmp_path, tree)
    assert p.returncode == 2, p.stderr[-3000:]
    assert lines[-1].startswith("dpdistill: error: data.path ") and "row 5, column 'label1'" in lines[-1], lines
    assert sum("dpdistill: error:" in line for line in lines) == 1
    assert "Traceback" not in p.stdout + p.stderr and len(lines) < 15, "\n".join(lines)
    assert "Spaceships" not in p.stdout + p.stderr  # a row is named, its value never quoted
    assert not list((tmp_path / "prefect_home").glob("*.db"))  # no Prefect server ever started (its SQLite)
    assert not list(Path(tree["run_root"]).glob("tiny-*"))


def test_a_stage_error_in_the_flow_is_one_last_line(prefect_server, tmp_path):
    """A teacher longer than the built-in model's positions: found when the teacher stage
    loads it, inside the flow. The terminal shows the progress and one error line at the end;
    the traceback is in run.log. (On the session's server: a temporary one is not the point.)"""
    tree = tiny_pipeline_dict(tmp_path)
    tree["teacher"]["max_length"] = 120  # the built-in models have 96 positions
    p, lines = _run(tmp_path, tree, api_url=prefect_server)
    assert p.returncode == 2, p.stderr[-3000:]
    assert lines[-1].startswith("dpdistill: error: teacher.max_length=120 exceeds"), lines
    assert sum("dpdistill: error:" in line for line in lines) == 1
    assert "Traceback" not in p.stdout + p.stderr
    assert len(lines) < 27, "\n".join(lines)  # the progress lines, the plan, one error line

    (run,) = Path(tree["run_root"]).glob("tiny-*")
    log = run / "run.log"
    assert log.stat().st_mode & 0o777 == 0o600
    text = log.read_text()
    assert "Traceback" in text and "pipeline.privacy.dpsgd.TeacherError" in text and "teacher.max_length=120" in text
    assert "base models" in text  # the progress lines are there too
    # and what the terminal showed before the run directory existed: the plan (issue 24)
    assert "plan of run 'tiny'" in text and text.index("plan of run") < text.index("base models")
    info = yaml.safe_load((run / "run.json").read_text())
    assert info["status"] == "failed" and info["reason"].startswith("TeacherError: teacher.max_length")


def _record(exc: BaseException, name: str = "prefect.task_runs", msg: str = "Task run failed with exception: %r"):
    try:
        raise exc
    except BaseException:
        return logging.LogRecord(name, logging.ERROR, __file__, 0, msg, (exc,), sys.exc_info())


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


def test_terminal_filter_keeps_tracebacks_of_bugs_only():
    terminal = _Lines()
    terminal.addFilter(QuietExpectedErrors((DataError,), terminal))
    terminal.handle(_record(DataError("row 3: bad")))  # dropped: the CLI prints its message
    terminal.handle(_record(RuntimeError("a bug")))  # a bug keeps its traceback
    assert len(terminal.lines) == 1 and "RuntimeError: a bug" in terminal.lines[0] and "Traceback" in terminal.lines[0]

    failed = logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 0, "Finished in state %s",
                               ("Failed('Flow run encountered an exception: DataError: row 3:\\n bad')",), None)
    terminal.handle(failed)
    assert terminal.lines[-1] == "Finished in state Failed (DataError)"
    assert "row 3" in failed.getMessage()  # the record itself (run.log's) is unchanged
    terminal.handle(logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 0,
                                      "Finished in state Failed('Flow run encountered an exception: KeyError: 3')",
                                      (), None))
    assert "KeyError: 3" in terminal.lines[-1]
