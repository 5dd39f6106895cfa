"""The privacy ledger: one entry per stage, saying what touched private data and at what cost.

ε values in the ledger come from an Opacus accountant, never from our arithmetic.
Stages after the teacher are post-processing of the DP teacher (ε = 0). The exact
control-code distribution is *not* protected in this version, and the ledger says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pipeline.manifest import atomic_write_json

LEDGER = "ledger.json"


class LedgerEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: str
    private: bool
    """True when this stage's release is covered by a DP guarantee (or spends nothing)."""
    epsilon: float | None
    """ε spent by this stage; None where the release is not differentially private."""
    delta: float | None = None
    accountant: str | None = None
    noise_multiplier: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    max_grad_norm: float | None = None
    privacy_unit: str | None = None
    note: str


def post_processing(stage: str, note: str) -> LedgerEntry:
    """A stage that only reads DP outputs: no privacy cost (post-processing theorem)."""
    return LedgerEntry(stage=stage, private=True, epsilon=0.0, note=f"post-processing: {note}")


def write_ledger(path: Path, entries: list[LedgerEntry]) -> None:
    stages = [e.stage for e in entries]
    if len(set(stages)) != len(stages):
        raise ValueError(f"ledger has duplicate stages: {stages}")
    atomic_write_json(Path(path), {"entries": [e.model_dump() for e in entries]})


def read_ledger(path: Path) -> list[LedgerEntry]:
    data = json.loads(Path(path).read_text())
    return [LedgerEntry.model_validate(e) for e in data["entries"]]
