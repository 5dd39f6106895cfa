"""`dpdistill plan` shows the numbers a run will record (N, q, σ, steps, each ε and the total)
without training or writing anything, and without Prefect (issue 10)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, tiny_pipeline_dict
from pipeline.privacy.control_codes import release_control_codes
from pipeline.config import config_from_dict
from pipeline.stages.data import prepare_data
from pipeline.privacy.ledger import compose
from pipeline.plan import make_plan
from pipeline.stages.teacher import train_teacher


def _tree(tmp_path: Path, model_dir: Path) -> dict:
    tree = tiny_pipeline_dict(tmp_path)
    tree["teacher"].update(model=str(model_dir), max_length=64)  # the tiny model has 64 positions
    tree["distill"].update(student_model=str(model_dir))
    return tree


def _files(root: Path) -> set[tuple[str, float]]:
    return {(str(p), p.stat().st_mtime) for p in root.rglob("*")}


def test_plan_gives_the_numbers_a_real_teacher_run_records(tmp_path, tiny_model_dir):
    cfg = config_from_dict(_tree(tmp_path, tiny_model_dir))
    before = _files(tmp_path)
    plan = make_plan(cfg, timing=False)
    assert _files(tmp_path) == before and not cfg.run_root.exists()  # nothing written

    data = prepare_data(cfg.data, tmp_path / "data", seed=cfg.seed, code_domain=cfg.control_codes.domain)
    codes = release_control_codes(cfg.control_codes, cfg.data, train_path=data.train, out_dir=tmp_path / "codes",
                                  delta=cfg.teacher.target_delta, accountant=cfg.teacher.accountant)
    teacher = train_teacher(cfg.teacher, train_path=data.train, validation_path=data.validation,
                            base_model=str(tiny_model_dir), out_dir=tmp_path / "teacher", seed=cfg.seed).ledger
    planned = {e.stage: e for e in plan.entries}
    assert plan.n == data.n_train and plan.unit == "record" and plan.n_test == data.n_test
    p = planned["teacher"]
    assert (p.noise_multiplier, p.sample_rate, p.steps, p.delta) == (
        teacher.noise_multiplier, teacher.sample_rate, teacher.steps, teacher.delta)
    assert p.epsilon == pytest.approx(teacher.epsilon, rel=1e-9)
    assert planned["control_codes"].epsilon == pytest.approx(codes.ledger.epsilon, rel=1e-9)
    total = compose([codes.ledger, teacher], cfg.teacher.accountant, teacher.delta)
    assert plan.total.epsilon == pytest.approx(total.epsilon, rel=1e-9)


def test_plan_command_prints_them_with_a_time_estimate_and_writes_nothing(tmp_path, tiny_model_dir):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(_tree(tmp_path, tiny_model_dir)))
    before = _files(tmp_path)
    probe = ("import runpy, sys; sys.argv = ['dpdistill', 'plan', '--config', %r]\n"
             "try:\n    runpy.run_module('flows.cli', run_name='__main__')\n"
             "finally:\n    print('PREFECT' if 'prefect' in sys.modules else 'NO-PREFECT')\n"
             % str(tmp_path / "config.yaml"))
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("NO-PREFECT")
    # The numbers are make_plan's (checked against a real run above); here, that they are printed.
    assert re.search(r"N = 108 training records", p.stdout), p.stdout
    assert re.search(r"teacher: DP-SGD, batch size 32 .*q = 0\.25 .*σ = \d+\.\d{4}, 4 steps, ε = \d\.\d{4} at δ", p.stdout)
    assert re.search(r"control codes: Gaussian histogram, σ = \d+\.\d{4}, ε = \d\.\d{4}", p.stdout)
    assert re.search(r"total: ε = \d\.\d{4}", p.stdout)
    for stage in ("teacher", "generation", "distillation", "evaluation"):
        assert f"    {stage}: ~" in p.stdout, p.stdout
    assert "estimated" in p.stdout
    assert _files(tmp_path) == before  # run_root never made, no cache, no model built
