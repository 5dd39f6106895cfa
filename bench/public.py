"""The public data some benchmarks read from outside the checkout: `../shared/data` beside it
(or `$DPDISTILL_SHARED/data`), which is not shipped: the ELTeC-eng novels (too large; see their
README for the license) and the airline tweets (CC BY-NC-SA). A benchmark that needs them says
so in its docstring and, when they are absent, exits with one line (exit code 2) before any work."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shared_root() -> Path:
    """The folder holding `data/`: $DPDISTILL_SHARED, else ../shared beside the checkout."""
    return Path(os.environ.get("DPDISTILL_SHARED") or ROOT.parent / "shared")


def shared_data(relative: str, what: str, pattern: str = "*") -> Path:
    """`<shared>/data/<relative>`, or exit 2 with one line saying what is missing and where."""
    path = shared_root() / "data" / relative
    if not (path.is_dir() and any(path.glob(pattern))) and not path.is_file():
        script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else ROOT / "bench"
        script = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script.name
        print(f"{script}: needs {what} at {path}, which is not there: this benchmark reads ../shared/data "
              "beside the checkout (not shipped), or $DPDISTILL_SHARED/data", file=sys.stderr)
        sys.exit(2)
    return path


def eltec() -> Path:
    """The ELTeC-eng novels (plain text), which the benchmarks build tokenizers and models from."""
    return shared_data("eltec-eng/text", "the ELTeC-eng novels", "*.txt")


def has_airline() -> bool:
    """Whether the airline tweets are there (bench/length_batches.py measures them when they are)."""
    return (shared_root() / "data" / "airline-tweets").is_dir()
