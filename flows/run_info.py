"""What a run directory says about itself (run.json, stages.json) and the stage names.

Kept apart from flows/pipeline_flow.py and flows/caching.py, which import Prefect and the
pipeline (torch, transformers, Opacus): `dpdistill --help`, `status`, `ledger show` and
`report` read only these, so they answer in a second instead of tens of seconds (issue 10).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

# In the order they run; `--from STAGE` reruns a stage and every stage after it.
STAGES = (
    "base-models", "data", "control-codes", "teacher", "dp-student", "generation", "distillation", "evaluation",
)
RUN_INFO = "run.json"
STAGES_INFO = "stages.json"
TOOL = "dpdistill"  # run.json's mark that dpdistill made the directory (see checked_run_dir)
RUN_LOCK = ".lock"  # flocked by the process writing the run directory, for the whole flow (pipeline/locks.py)


class RunDirError(ValueError):
    """A run directory the flow must not write into; the message says why and what to do."""


def stages_to_rerun(rerun_from: str | None, force: list[str] | None) -> list[str]:
    """`--from STAGE` → that stage and every later one; `--force STAGE` → that stage."""
    for name in [rerun_from, *(force or [])]:
        if name is not None and name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages are: {', '.join(STAGES)}")
    chosen = set(force or [])
    if rerun_from is not None:
        chosen |= set(STAGES[STAGES.index(rerun_from):])
    return [s for s in STAGES if s in chosen]


def read_run_info(run_dir: Path) -> dict:
    """A run directory's run.json, or {} when it has none (or not a readable one)."""
    try:
        info = json.loads((Path(run_dir) / RUN_INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


def run_alive(info: dict) -> bool:
    """Whether the process that wrote a run.json may still be running."""
    if info.get("host") != socket.gethostname():
        return True  # another machine's run: assume it is alive
    try:
        os.kill(int(info["pid"]), 0)
    except (ProcessLookupError, ValueError, KeyError):
        return False
    except PermissionError:
        return True
    return True


def stop_reason(err: BaseException) -> tuple[str, str]:
    """(run.json status, reason) for an exception that ended a run: "interrupted" for a
    signal (SIGINT's KeyboardInterrupt, Prefect's TerminationSignal for SIGTERM), else
    "failed" with the error's type and first line (errors name rows and fields, never
    record text)."""
    signum = getattr(err, "signal", None)
    if isinstance(err, KeyboardInterrupt) or isinstance(signum, int):
        return "interrupted", f"stopped by {_signal_name(signum or 2)}"
    first = str(err).splitlines()[0] if str(err) else ""
    return "failed", f"{type(err).__name__}: {first}" if first else type(err).__name__


def _signal_name(signum) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def mark_stopped(run_dir: Path, status: str, reason: str, replacing: tuple[str, ...] = ("running",)) -> None:
    """Record in run.json why a run stopped, and in stages.json that its running stage did
    not finish: what `dpdistill status` shows and what the next run continues from. Only a
    run.json whose status is in `replacing` (by default still "running": a finished run, or
    one already marked, is kept), and only the stages whose status is."""
    from pipeline.manifest import atomic_write_json

    info = read_run_info(run_dir)
    if info.get("status") not in replacing:
        return
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    atomic_write_json(Path(run_dir) / RUN_INFO, info | {"status": status, "reason": reason, "stopped_at": when})
    try:
        stages = json.loads((Path(run_dir) / STAGES_INFO).read_text())
    except (OSError, ValueError):
        return
    running = [s for s, v in stages.items() if isinstance(v, dict) and v.get("status") in replacing]
    if running:
        atomic_write_json(Path(run_dir) / STAGES_INFO, stages | {s: stages[s] | {"status": status} for s in running})
