"""Data-parallel DP teacher (teacher.processes=2): Opacus DPDDP under torchrun, 2 CPU processes, gloo."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from pipeline.config import TeacherConfig
from pipeline.privacy.noise import TEST_SEED_ENV
from pipeline.stages.teacher import ddp as teacher_ddp
from pipeline.privacy.dpsgd import TeacherError, plan_dp_sgd
from pipeline.stages.teacher.recipe import train_teacher

PROJECT = Path(__file__).resolve().parents[2]


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
    planned = plan_dp_sgd(_cfg(), splits.n_train)  # as the flow hands it down: every rank takes it, none calibrates
    two = _run(_cfg(processes=2), splits, tiny_model_dir, tmp_path / "two", on_progress=progress.append,
               dp_sgd=planned)

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
    assert json.loads((tmp_path / "two" / "ddp" / "args.json").read_text())["args"]["dp_sgd_plan"]["sigma"] == planned.sigma
    assert not (tmp_path / "two" / "checkpoint").exists()

    base = load_file(tiny_model_dir / "model.safetensors")
    w1, w2 = load_file(one.checkpoint / "model.safetensors"), load_file(two.checkpoint / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in w2.values())
    assert max((w2[k] - base[k]).abs().max().item() for k in base) > 1e-3  # it trained
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5)

    # Two machines (issue 23): two torchrun agents on 127.0.0.1, one rank each, meeting at a c10d
    # rendezvous; node 1 joins through the CLI with its own copy of the config. Same ledger, same weights.
    nodes = _two_nodes(tmp_path, splits)
    with open(tmp_path / "node1.log", "w+") as out:
        joiner = subprocess.Popen([sys.executable, "-m", "flows.cli", "join-teacher", "--config", str(nodes["joiner"])],
                                  cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            across = _run(_cfg(**nodes["launcher"]), splits, tiny_model_dir, tmp_path / "nodes")
            joiner.wait(timeout=120)
        finally:
            teacher_ddp.stop_group(joiner, timeout=5)
            out.seek(0)
            print("node 1:", out.read())  # shown when the test fails
    assert joiner.returncode == 0
    c = across.ledger
    assert (c.sample_rate, c.noise_multiplier, c.steps, c.epsilon, c.delta) == (
        a.sample_rate, a.noise_multiplier, a.steps, a.epsilon, a.delta)
    assert "data-parallel over 2 processes" in c.note
    assert {p.name for p in (tmp_path / "nodes" / "ddp").glob("rank*.log")} == {"rank0.log", "rank1.log"}
    w3 = load_file(across.checkpoint / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w3[k], w1[k], rtol=0, atol=1e-5)


def _two_nodes(tmp_path: Path, splits) -> dict:
    """Teacher settings of node 0 (runs the stage) and a pipeline config file for node 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = {"processes": 1, "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_timeout": 120}
    joiner = tmp_path / "node1.yaml"
    joiner.write_text(json.dumps({  # YAML is a superset of JSON
        "name": "node1", "threads": 1, "data": {"path": str(splits.train)}, "control_codes": {"mechanism": "exact"},
        "teacher": {**_cfg().model_dump(mode="json", exclude_defaults=True), **launcher, "node_rank": 1}}))
    return {"launcher": launcher, "joiner": joiner}


def test_a_node_that_cannot_join_is_told_why(tmp_path, capsys):
    """join-teacher on node 0, or without nodes, is refused with the command node 0 runs instead."""
    from flows.cli import main

    (tmp_path / "c.yaml").write_text(json.dumps({"data": {"path": "x.csv"}, "control_codes": {"mechanism": "exact"}, "teacher": {"processes": 2}}))
    assert main(["join-teacher", "--config", str(tmp_path / "c.yaml")]) == 2
    assert "teacher.nnodes=1, teacher.node_rank=0); node 0 runs `dpdistill run`" in capsys.readouterr().err
    with pytest.raises(ValueError, match="teacher.nnodes=2 needs teacher.rdzv_endpoint"):
        TeacherConfig(nnodes=2)
    with pytest.raises(ValueError, match="node_rank=2 must be below"):
        TeacherConfig(nnodes=2, node_rank=2, rdzv_endpoint="h:1")
    with pytest.raises(TeacherError, match="the flow runs on node 0 only"):
        train_teacher(TeacherConfig(nnodes=2, node_rank=1, rdzv_endpoint="h:1"), train_path=tmp_path / "t",
                      validation_path=tmp_path / "v", base_model="x", out_dir=tmp_path / "o", seed=0)


def test_a_failing_rank_raises_with_rank0_log(splits, tiny_model_dir, tmp_path):
    """A worker's error comes back as a TeacherError quoting the end of the log of the rank that
    failed first: every rank fails here, and torchrun stops the others once one has, so rank 0
    may be stopped before it logs anything (issue 22)."""
    with pytest.raises(TeacherError, match=r"(?s)rank [01]'s log.*teacher.max_length=100 exceeds"):
        _run(_cfg(processes=2, max_length=100), splits, tiny_model_dir, tmp_path)
    assert not (tmp_path / "manifest.json").exists()


def test_the_error_quotes_the_rank_that_failed_first(tmp_path, monkeypatch):
    """The race behind an empty quoted log (issue 22), made certain: rank 0 is stopped before it
    logs anything, and the error quotes rank 1's log, which holds the cause."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1's log .*ValueError: rank 1 cannot go on"):
        teacher_ddp.launch({}, target="ddp_targets:rank1_fails_while_rank0_works", processes=2,
                           backend="gloo", work=tmp_path, threads=1, stage="test")
    assert time.monotonic() - started < 100  # rank 0 was stopped, not waited for
    assert "Error" not in (tmp_path / "rank0.log").read_text()  # stopped, not failed: its log has no cause


def test_teacher_ddp_does_not_import_the_teacher():
    """One direction only: recipe.py imports ddp.py, which runs the worker it is
    named (`pipeline.stages.teacher.recipe:ddp_worker` in the job file) and imports no pipeline stage."""
    import ast
    from pathlib import Path

    import pipeline.stages.teacher.ddp as ddp

    tree = ast.parse(Path(ddp.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "pipeline.stages.teacher" not in imported and not any(m.startswith("pipeline.stages.teacher.") for m in imported)
    assert imported & {"pipeline.manifest"}  # the parse saw the module's own imports


def test_a_node_without_the_shared_storage_fails_naming_what_it_misses(tmp_path):
    """Across nodes every rank checks it sees the job's work directory and data (one rank's
    group here) before training, and the error names the rank, host and path."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        job = {"work": str(tmp_path), "args": {"train_path": str(tmp_path / "elsewhere.parquet"), "monitor_path": None}}
        with pytest.raises(FileNotFoundError, match=r"rank 0 on .* cannot see .*elsewhere\.parquet: .*same path"):
            teacher_ddp._check_shared_storage(job)
        (tmp_path / "elsewhere.parquet").touch()
        teacher_ddp._check_shared_storage(job)
    finally:
        dist.destroy_process_group()


def test_a_joining_node_runs_only_the_teacher_and_node_0_keeps_its_own_job():
    """The rendezvous has no authentication: a job offered by another rank is run only if its
    target is the teacher's worker, and a launching rank never takes another's job."""
    teacher = {"target": "pipeline.stages.teacher.recipe:ddp_worker", "args": {}}
    planted = {"target": "shutil:rmtree", "args": "/"}
    assert teacher_ddp._adopt(None, [None, teacher]) is teacher
    assert teacher_ddp._adopt(teacher, [planted, teacher]) is teacher
    with pytest.raises(ValueError, match="refusing to join a job whose target is 'shutil:rmtree'"):
        teacher_ddp._adopt(None, [planted, teacher])
