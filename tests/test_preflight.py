"""Pre-flight (issue 10): a bad input stops `dpdistill run` in seconds with one error line naming
the field and the fix, before any Prefect server starts, and leaves no run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT, tiny_pipeline_dict
from cli_probe import child_pythonpath
from flows.cli import main
from pipeline.config import config_from_dict
from pipeline.preflight import check_inputs

HEADER = "text,label1,label2\n"


def _write_config(tmp_path: Path, **data) -> Path:
    tree = tiny_pipeline_dict(tmp_path)
    tree["data"].update(data.pop("data", {}))
    for key, value in data.items():  # a section's fields, or a top-level value
        if isinstance(value, dict):
            tree[key].update(value)
        else:
            tree[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _assert_one_error_line(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert [line for line in lines if line.startswith("dpdistill: error:")] == lines[-1:], err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[-1], lines[-1]


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[dict, list[str]]]:
    """Each bad input: (config changes, words its error must hold)."""
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "header.csv").write_text(HEADER)
    (tmp_path / "nolabel.csv").write_text("text,label1\nSECRET-RECORD one,a\nSECRET-RECORD two,b\n")
    pq.write_table(pa.table({"text": ["SECRET-RECORD"] * 2, "label1": [["a"], ["b"]], "label2": ["1", "2"]}),
                   tmp_path / "listed.parquet")
    rows = [{"text": f"SECRET-RECORD {i}", "label1": "a", "label2": "b"} for i in range(6)]
    rows[3]["text"] = 12345  # row 4: a number among texts
    (tmp_path / "number.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a_file").write_text("not a directory")
    return {
        "missing file": ({"data": {"path": str(tmp_path / "nope.csv")}}, ["data.path", "not found"]),
        "directory": ({"data": {"path": str(tmp_path)}}, ["data.path", "is a directory"]),
        "empty file": ({"data": {"path": str(tmp_path / "empty.csv")}}, ["data.path", "is empty"]),
        "header only": ({"data": {"path": str(tmp_path / "header.csv")}}, ["data.path", "no records"]),
        "missing column": ({"data": {"path": str(tmp_path / "nolabel.csv")}}, ["'label2'", "data.code_columns"]),
        "list-typed parquet column": ({"data": {"path": str(tmp_path / "listed.parquet")}},
                                      ["column 'label1'", "list", "single string"]),
        "JSONL number in text": ({"data": {"path": str(tmp_path / "number.jsonl")}},
                                 ["row 4, column 'text'", "a number", "string"]),
        "unknown builtin": ({"teacher": {"model": "builtin:teachr"}}, ["teacher.model", "'builtin:teacher'"]),
        "missing model dir": ({"distill": {"student_model": str(tmp_path / "no_model")}},
                              ["distill.student_model", "not found"]),
        "unwritable run_root": ({"run_root": str(tmp_path / "a_file" / "runs")}, ["run_root", "cannot be created"]),
    }


def test_each_bad_input_stops_the_run_in_one_line_leaving_no_run_directory(tmp_path, capsys):
    for name, (changes, words) in _bad_inputs(tmp_path).items():
        cfg_path = _write_config(tmp_path, **changes)
        problems = check_inputs(config_from_dict(yaml.safe_load(cfg_path.read_text())))
        assert len(problems) == 1, (name, problems)
        t0 = time.time()
        rc = main(["run", "--config", str(cfg_path)])
        err = capsys.readouterr().err
        assert rc == 2, name
        assert time.time() - t0 < 10, name  # no Prefect server, no torch
        _assert_one_error_line(err, *words)
        assert "SECRET-RECORD" not in err and "12345" not in err  # names rows, never content
        assert not (tmp_path / "runs").exists(), name


def test_the_tiny_config_passes(tiny_config):
    assert check_inputs(tiny_config) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_run_root_in_a_read_only_directory_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)
    cfg = config_from_dict(tiny_pipeline_dict(tmp_path) | {"run_root": str(tmp_path / "ro" / "runs")})
    assert any("cannot be created" in p for p in check_inputs(cfg))


def test_cli_subprocess_fails_fast_before_prefect(tmp_path):
    """The real command line: exit 2, the error as the last stderr line, Prefect never imported."""
    cfg_path = _write_config(tmp_path, data={"path": str(tmp_path)})
    probe = ("import runpy, sys; sys.argv = ['dpdistill', 'run', '--config', %r]\n"
             "try:\n    runpy.run_module('flows.cli', run_name='__main__')\n"
             "except SystemExit as e:\n    print('PREFECT' if 'prefect' in sys.modules else 'NO-PREFECT'); raise\n"
             % str(cfg_path))
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": child_pythonpath()})
    assert p.returncode == 2 and p.stdout.strip() == "NO-PREFECT", (p.stdout, p.stderr)
    _assert_one_error_line(p.stderr, "is a directory")
    assert not (tmp_path / "runs").exists()


def test_the_flow_checks_too_before_making_its_run_directory(prefect_server, tmp_path):
    """A scheduled run calls the flow without the CLI: it stops at the same check, nothing made."""
    from flows.pipeline_flow import dp_distill
    from pipeline.preflight import PreflightError

    cfg = config_from_dict(tiny_pipeline_dict(tmp_path))
    cfg.data.path = tmp_path / "missing.csv"
    with pytest.raises(PreflightError, match="data.path .* not found"):
        dp_distill(cfg)
    assert not (tmp_path / "runs").exists()
