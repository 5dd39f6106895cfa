"""Data-parallel DP teacher (teacher.processes=2): Opacus DPDDP under torchrun, 2 CPU processes, gloo."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from pipeline.config import TeacherConfig
from pipeline.privacy.noise import TEST_SEED_ENV
from pipeline.stages import teacher_ddp
from pipeline.stages.teacher import TeacherError, train_teacher


def _cfg(**overrides) -> TeacherConfig:
    return TeacherConfig(**{
        "target_epsilon": 3.0, "epochs": 1, "batch_size": 25, "physical_batch_size": 10, "max_length": 48,
        "learning_rate": 1e-3, "accountant": "rdp", **overrides,
    })


def _run(cfg, splits, model_dir, out, **kwargs):
    return train_teacher(cfg, train_path=splits.train, validation_path=splits.validation,
                         base_model=str(model_dir), out_dir=out, seed=0, **kwargs)


def test_two_gloo_processes_account_and_train_like_one(splits, tiny_model_dir, tmp_path, monkeypatch):
    """The accountant sees the global batch: q, σ, steps and ε are those of one process. With
    the noise fixed by the test hook (inherited by the torchrun workers), the ranks' shares add
    up to the single-process Poisson draws and rank 0 draws the noise from the same stream, so
    the weights match one process up to float summation order."""
    monkeypatch.setenv(TEST_SEED_ENV, "5")
    one = _run(_cfg(), splits, tiny_model_dir, tmp_path / "one")
    progress = []
    two = _run(_cfg(processes=2), splits, tiny_model_dir, tmp_path / "two", on_progress=progress.append)

    a, b = one.ledger, two.ledger
    assert (b.sample_rate, b.noise_multiplier, b.steps, b.epsilon, b.delta) == (
        a.sample_rate, a.noise_multiplier, a.steps, a.epsilon, a.delta)
    assert b.sample_rate == pytest.approx(1 / 4) and 0 < b.epsilon <= 3.0
    assert "data-parallel over 2 processes" in b.note
    logs = [json.loads((tmp_path / d / "training_log.json").read_text())["history"] for d in ("one", "two")]
    assert [h["step"] for h in logs[1]] == [h["step"] for h in logs[0]]
    assert b.noise_source == a.noise_source and b.noise_source.startswith("TEST HOOK")
    assert [p["done"] for p in progress] == list(range(1, b.steps + 1))  # relayed from rank 0
    assert (tmp_path / "two" / "ddp" / "rank1.log").is_file()
    assert not (tmp_path / "two" / "checkpoint").exists()

    base = load_file(tiny_model_dir / "model.safetensors")
    w1, w2 = load_file(one.checkpoint / "model.safetensors"), load_file(two.checkpoint / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in w2.values())
    assert max((w2[k] - base[k]).abs().max().item() for k in base) > 1e-3  # it trained
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5)


def test_a_failing_rank_raises_with_rank0_log(splits, tiny_model_dir, tmp_path):
    """A worker's error comes back as a TeacherError quoting the end of the log of the rank that
    failed first: every rank fails here, and torchrun stops the others once one has, so rank 0
    may be stopped before it logs anything (issue 22)."""
    with pytest.raises(TeacherError, match=r"(?s)rank [01]'s log.*teacher.max_length=100 exceeds"):
        _run(_cfg(processes=2, max_length=100), splits, tiny_model_dir, tmp_path)
    assert not (tmp_path / "manifest.json").exists()


def rank1_fails_while_rank0_works(args: dict, on_progress) -> None:
    """A torchrun target (imported by name in the ranks): rank 1 fails at once, rank 0 is still
    at work, without a line logged, when torchrun stops it."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    time.sleep(120)


def test_the_error_quotes_the_rank_that_failed_first(tmp_path, monkeypatch):
    """The race behind an empty quoted log (issue 22), made certain: rank 0 is stopped before it
    logs anything, and the error quotes rank 1's log, which holds the cause."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1's log .*ValueError: rank 1 cannot go on"):
        teacher_ddp.launch({}, target=f"{Path(__file__).stem}:rank1_fails_while_rank0_works", processes=2,
                           backend="gloo", work=tmp_path, threads=1, stage="test")
    assert time.monotonic() - started < 100  # rank 0 was stopped, not waited for
    assert "Error" not in (tmp_path / "rank0.log").read_text()  # stopped, not failed: its log has no cause


def test_teacher_ddp_does_not_import_the_teacher():
    """One direction only: teacher.py imports teacher_ddp.py, which runs the worker it is
    named (`pipeline.stages.teacher:ddp_worker` in the job file) and imports no pipeline stage."""
    import ast
    from pathlib import Path

    import pipeline.stages.teacher_ddp as ddp

    tree = ast.parse(Path(ddp.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "pipeline.stages.teacher" not in imported and not any(m.startswith("pipeline.stages.teacher.") for m in imported)
    assert imported & {"pipeline.manifest"}  # the parse saw the module's own imports
