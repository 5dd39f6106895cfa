"""The public corpus the benchmarks build their tokenizers and models from: the ELTeC-eng
novels in ../shared/data/eltec-eng (too large to ship; see its README for the license)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ELTEC = ROOT.parent / "shared" / "data" / "eltec-eng" / "text"


def eltec() -> Path:
    """The corpus directory, or exit with one line saying where it was looked for."""
    if not any(ELTEC.glob("*.txt")):
        sys.exit(f"bench: the public corpus is not at {ELTEC}; the benchmarks read the ELTeC-eng novels "
                 "from ../shared/data/eltec-eng beside the checkout")
    return ELTEC
