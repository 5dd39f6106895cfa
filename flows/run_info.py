"""What a run directory says about itself (run.json, stages.json) and the stage names.

Kept apart from flows/pipeline_flow.py and flows/caching.py, which import Prefect and the
pipeline (torch, transformers, Opacus): `dpdistill --help`, `status`, `ledger show` and
`report` read only these, so they answer in a second instead of tens of seconds (issue 10).
"""

from __future__ import annotations

import json
import os
import socket
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
