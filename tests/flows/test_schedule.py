"""Scheduled runs run (issue 10): `dpdistill serve --cron` against a real `prefect server start`.

The session `prefect_server` fixture is not enough here: the failure of issue 10 (SQLAlchemy
2.1 against Prefect 3.8.8: "Can't evaluate bulk DML statement") is in the server's scheduler
services, and `prefect_test_harness` starts an ephemeral server, which runs no scheduler
(Prefect's scheduler services are not `run_in_ephemeral`). The deployment registers either
way. So this test starts a server of its own, with its scheduler, and waits for a scheduled
run of the tiny pipeline to be created and to complete; the first run, due at the next
minute boundary, is brought forward to now rather than waited for (docs/operations.md).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from conftest import tiny_pipeline_dict
from pipeline.stages.teacher.ddp import stop_group

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _wait_for(what: str, check, timeout: float, logs: list[Path], procs: list[subprocess.Popen]):
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        for p in procs:
            assert p.poll() is None, f"{p.args[:4]} exited ({p.returncode}) while waiting for {what}:\n" + \
                "\n".join(_tail(log) for log in logs)
        assert time.time() < deadline, f"no {what} after {timeout:.0f} s:\n" + \
            "\n".join(f"--- {log.name}\n{_tail(log)}" for log in logs)
        time.sleep(2)


def test_served_cron_deployment_runs_the_pipeline(tmp_path, prefect_home):
    """`dpdistill serve --cron "* * * * *"`: the server's scheduler creates a run of the
    deployment, the serve process executes it, and it completes with a finished run
    directory. The deployment has a concurrency limit of 1 (later runs wait, ENQUEUE), read
    back from the server, and no two of its runs are ever Running at once."""
    tree = tiny_pipeline_dict(tmp_path)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tree))
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = os.environ | {
        "PREFECT_HOME": str(prefect_home),  # its own SQLite database (migrated: conftest.py)
        "PREFECT_API_URL": api,
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",  # the runner looks for due runs every 2 s, not 10
    }
    server_log, serve_log = tmp_path / "server.log", tmp_path / "serve.log"
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    procs: list[subprocess.Popen] = []
    try:
        with server_log.open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                cwd=tmp_path, env=server_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        client = httpx.Client(base_url=api, timeout=10)

        def healthy():
            try:
                return client.get("/health").status_code == 200
            except httpx.TransportError:
                return False

        _wait_for("healthy server", healthy, 300, [server_log], procs)  # slow starts under load
        with serve_log.open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "serve", "--config", str(config), "--cron", "* * * * *"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        logs = [server_log, serve_log]

        def deployment():
            r = client.get("/deployments/name/dp-distill/tiny-scheduled")
            return r.json() if r.status_code == 200 else None

        dep = _wait_for("registered deployment", deployment, 120, logs, procs)
        assert dep["schedules"] and dep["schedules"][0]["schedule"]["cron"] == "* * * * *"
        assert dep["global_concurrency_limit"]["limit"] == 1  # ("concurrency_limit" is deprecated, always None)
        assert dep["concurrency_options"]["collision_strategy"] == "ENQUEUE"

        def runs():
            r = client.post("/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}})
            r.raise_for_status()
            found = r.json()
            running = [f["name"] for f in found if f["state_type"] == "RUNNING"]
            assert len(running) <= 1, f"runs of one deployment overlap: {running}"
            failed = [(f["name"], f["state"]["message"]) for f in found if f["state_type"] in ("FAILED", "CRASHED")]
            assert not failed, f"a scheduled run failed: {failed}\n{_tail(serve_log)}"
            return found

        # The scheduler creates runs within seconds of registration (its recent-deployments
        # loop runs every 5 s); the first is due at the next minute.
        scheduled = _wait_for("scheduled flow run", runs, 90, logs, procs)
        assert all(f["auto_scheduled"] for f in scheduled)
        # The scheduler made the runs; the first is due at the next minute boundary, up to 60 s
        # away. Brought forward to now (its own state, its idempotency key kept: the scheduler makes
        # no second run for that minute), the serve process takes it at its next poll: serve runs
        # what the scheduler made, without the test waiting for the clock.
        first = min(scheduled, key=lambda f: f["expected_start_time"])
        if first["state_type"] == "SCHEDULED":
            now = datetime.datetime.now(datetime.timezone.utc).isoformat()
            moved = client.post(f"/flow_runs/{first['id']}/set_state", json={
                "state": {"type": "SCHEDULED", "name": "Scheduled", "state_details": {"scheduled_time": now}},
                "force": True})
            moved.raise_for_status()
            assert moved.json()["status"] == "ACCEPT", moved.json()

        def completed():
            return [f for f in runs() if f["state_type"] == "COMPLETED"]

        (done, *_) = _wait_for("completed scheduled run", completed, 240, logs, procs)
        assert done["parameters"]["config"] == str(config.resolve())
    finally:
        for p in reversed(procs):
            stop_group(p)
    # The next minute's run may have started since; the completed one finished its directory.
    statuses = [json.loads((run / "run.json").read_text())["status"] for run in Path(tree["run_root"]).glob("tiny-*")]
    assert "completed" in statuses
