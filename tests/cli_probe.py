"""`_cli`: run the dpdistill CLI in a fresh interpreter and report which heavy modules it
imported (tests/flows/test_cli_fast.py, tests/privacy/test_budget.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "opacus", "prefect")


def child_pythonpath() -> str:
    """The project first, then the caller's PYTHONPATH (packages installed beside the environment,
    e.g. a `pip install --target` folder), so that a child imports what this process imports."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
_PROBE = """
import runpy, sys
sys.argv = ["dpdistill", *{argv!r}]
try:
    runpy.run_module("flows.cli", run_name="__main__")
    rc = 0
except SystemExit as e:
    rc = e.code
print("HEAVY:" + ",".join(m for m in {heavy!r} if m in sys.modules))
sys.exit(rc)
"""


def _cli(*argv: str, env: dict | None = None) -> tuple[int, str, str, list[str]]:
    """(exit code, stdout without the probe line, stderr, heavy modules imported)."""
    code = _PROBE.format(argv=list(argv), heavy=HEAVY)
    run_env = {**os.environ, "PYTHONPATH": child_pythonpath(), **(env or {})}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=run_env,
                       timeout=120)
    out, _, probe = p.stdout.rpartition("HEAVY:")
    return p.returncode, out, p.stderr, [m for m in probe.strip().split(",") if m]
