"""Two runs at once: the locks on run directories and cache entries (pipeline/locks.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from conftest import tiny_pipeline_dict
from cli_probe import child_pythonpath

from flows.cli import main
from flows.run_dirs import claim_run_dir, prepare_run_root
from flows.run_info import RUN_INFO, RUN_LOCK, TOOL, RunDirError
from pipeline.config import config_from_dict
from pipeline.privacy.ledger import read_ledger
from pipeline.locks import file_lock, try_lock, unlock
from pipeline.manifest import atomic_write_json

ROOT = Path(__file__).resolve().parents[2]

# A second process that waits for the lock, says when it has it, and holds it until killed.
_WAITER = """
import sys, time
from pipeline.locks import file_lock
with file_lock(sys.argv[1], on_wait=lambda: print("waiting", flush=True)):
    print("locked", flush=True)
    time.sleep(600)
"""


def _waiter(path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WAITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env=os.environ | {"PYTHONPATH": child_pythonpath()})


def test_a_second_process_waits_for_the_lock_and_gets_it_when_the_holder_dies(tmp_path):
    path = tmp_path / "locks" / "k.lock"
    with file_lock(path):
        waiter = _waiter(path)
        try:
            assert waiter.stdout.readline() == "waiting\n"  # it found the lock held and blocks
            time.sleep(0.5)
            assert waiter.poll() is None
        except BaseException:
            waiter.kill()
            raise
    try:  # released: the waiter gets it, and then holds it against this process
        assert waiter.stdout.readline() == "locked\n"
        assert try_lock(path) is None
    finally:
        waiter.send_signal(signal.SIGKILL)
        waiter.wait()
    fd = try_lock(path)  # the kernel dropped the killed holder's lock: no stale lock file
    assert fd is not None
    unlock(fd)


def test_a_locked_run_directory_is_never_continued_nor_named(tmp_path):
    """A killed run whose lock is free is continued; the same directory while another
    process holds its lock is skipped (a new one is made), and `--run-dir` naming it fails
    with one message."""
    cfg = config_from_dict(tiny_pipeline_dict(tmp_path))
    root = prepare_run_root(cfg)
    killed = root / "tiny-20250101-000000"
    killed.mkdir()
    out, fd, why = claim_run_dir(cfg, None, None)  # a new directory: nothing to continue yet
    unlock(fd)
    from flows.run_dirs import config_sha

    info = {"tool": TOOL, "status": "running", "config_sha256": config_sha(cfg), "pid": 1, "host": "h"}
    atomic_write_json(killed / RUN_INFO, info)
    os.utime(killed / RUN_INFO, (time.time() + 10, time.time() + 10))  # the newest run
    out, fd, why = claim_run_dir(cfg, None, None)
    assert out == killed.resolve() and "killed" in why
    try:
        # Held by this claim, as a live run would hold it: another claim makes a new directory...
        other, other_fd, other_why = claim_run_dir(cfg, None, None)
        unlock(other_fd)
        assert other != killed.resolve() and other_why is None
        # ...and naming it is refused, with the reason and the fix.
        with pytest.raises(RunDirError, match=r"in use by another dpdistill run .*pass another --run-dir"):
            claim_run_dir(cfg, killed, None)
    finally:
        unlock(fd)
    out, fd, _ = claim_run_dir(cfg, killed, None)  # free again
    unlock(fd)
    assert out == killed.resolve()


def test_a_run_directory_holding_only_its_lock_counts_as_empty(tmp_path):
    """A run killed between locking a named directory and writing run.json leaves only
    `.lock`: the same --run-dir is accepted again."""
    cfg = config_from_dict(tiny_pipeline_dict(tmp_path))
    root = prepare_run_root(cfg)
    (root / "mine").mkdir()
    (root / "mine" / RUN_LOCK).touch()
    out, fd, _ = claim_run_dir(cfg, root / "mine", None)
    unlock(fd)
    assert out == (root / "mine").resolve()


def _time(stamp: str) -> datetime:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S")


def _stage_info(run: Path) -> dict[str, dict]:
    return json.loads((run / "stages.json").read_text())


def _stages(run: Path) -> dict[str, str]:
    return {name: s["status"] for name, s in json.loads((run / "stages.json").read_text()).items()}


def test_two_runs_of_the_same_config_started_together(prefect_server, tmp_path, capsys):
    """Both succeed in their own run directory; every stage is computed once (the second
    run waits for it and reuses it), so the teacher trains once and the ledgers match."""
    tree = tiny_pipeline_dict(tmp_path)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tree))
    command = [sys.executable, "-m", "flows.cli", "run", "--config", str(config)]
    env = os.environ | {"PREFECT_API_URL": prefect_server, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]
    runs = sorted(Path(tree["run_root"]).glob("tiny-*"))
    assert len(runs) == 2  # not one shared directory
    statuses = [_stages(run) for run in runs]
    assert sorted(s["teacher"] for s in statuses) == ["cached", "ran"]
    assert sorted(s["control-codes"] for s in statuses) == ["cached", "ran"]  # one DP histogram
    assert [e.model_dump() for e in read_ledger(runs[0] / "ledger.json").entries] == [
        e.model_dump() for e in read_ledger(runs[1] / "ledger.json").entries]
    # The run that found a stage cached said why it waited, whenever it reached the stage while the
    # other was computing it (under load the second may only arrive after the first is done).
    by_dir = {run: next(o for o in outputs if f"finished: {run}" in o) for run in runs}
    for stage in ("control-codes", "teacher", "generation", "distillation"):
        ran = next(r for r in runs if _stage_info(r)[stage]["status"] == "ran")
        cached = next(r for r in runs if r != ran)
        # times have 1 s resolution, and started_at is written just before the lock is asked for
        arrived, done = (_time(_stage_info(cached)[stage]["started_at"]), _time(_stage_info(ran)[stage]["finished_at"]))
        if (done - arrived).total_seconds() >= 2:
            assert f"{stage}: another run is computing this stage" in by_dir[cached], stage
    assert main(["status", str(runs[0])]) == 0 and "completed" in capsys.readouterr().out
