"""Benchmarks and studies that read ../shared/data (outside the checkout, not shipped) say so in
their docstring and, without it, exit with one line (exit code 2) before any work."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDS_SHARED = ("eltec()", "shared_data(", "has_airline(", "require_data(")


def _run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DPDISTILL_SHARED": str(tmp_path / "shared"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_benchmark_without_the_novels_says_where_it_looked(tmp_path):
    line = _one_line(_run(tmp_path, "bench/teacher_ddp.py"))
    assert line.startswith("bench/teacher_ddp.py: needs the ELTeC-eng novels at ")
    assert str(tmp_path / "shared" / "data" / "eltec-eng" / "text") in line and "../shared/data" in line


def test_a_study_without_its_data_says_so_and_starts_nothing(tmp_path):
    data = tmp_path / "shared" / "data" / "yelp"
    done = _run(tmp_path, "experiments/reference.py", "--only", "table", "--rows", "ours",
                f"data.path={data / 'dev.csv'}", f"data.test_path={data / 'test.csv'}", f"run_root={tmp_path / 'runs'}")
    line = _one_line(done)
    assert line.startswith(f"experiments/reference.py: data.path {data / 'dev.csv'} (configs/reference.yaml) is not there")
    assert "../shared/data" in line and "not shipped" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script", sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("experiments/*.py")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_script_that_reads_shared_data_says_so_in_its_docstring(script):
    source = script.read_text(encoding="utf-8")
    if script.name in ("public.py", "shared.py") or not any(call in source for call in NEEDS_SHARED):
        return
    doc = ast.get_docstring(ast.parse(source)) or ""
    assert "../shared" in doc, f"{script.relative_to(ROOT)} reads ../shared/data: its docstring should say so"
