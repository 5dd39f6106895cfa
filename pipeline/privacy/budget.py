"""The privacy budget spent on one private dataset across every run, not just one run's.

Each run's ledger shows what that run released. But every `--force teacher`, and every run
with a changed config, trains a new DP model on the same records: the guarantee for a
person in the data is the composition of *all* those releases. This module keeps one
ledger per dataset, keyed by the sha256 of the private training file, under
`run_root/.privacy/<sha256>.json` (0600), and composes it the way a run's total is composed
(`pipeline.privacy.ledger.compose`: Gaussian histories jointly through the accountant, pure ε added).

A release is identified by its stage's manifest digest (the sha256 of its outputs): a
cached or reused stage is the same release and is recorded once; a retrained teacher (new
DP noise) is a new one.

    budget = record_release(run_root, sha, release_id=digest, stage="teacher", run_dir=run, entry=entry)
    total = dataset_total(budget, accountant="prv", delta=1e-5)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pipeline.privacy.ledger import LedgerEntry, LedgerTotal, compose, fmt_value
from pipeline.locks import file_lock
from pipeline.manifest import atomic_write_json, private_dir

BUDGET_DIR = ".privacy"


class Release(BaseModel):
    model_config = ConfigDict(extra="forbid")

    release_id: str
    """The releasing stage's manifest digest: the same outputs are the same release."""
    stage: str
    run_dir: str
    recorded_at: str
    entry: LedgerEntry
    """The stage's ledger entry: δ, the (σ, q, steps) history or the pure ε, privacy unit."""


class StoredTotal(BaseModel):
    """A total the accountant composed at the end of a run, kept so that `ledger show`
    answers without importing Opacus (and torch): valid while the releases are the same."""

    model_config = ConfigDict(extra="forbid")

    accountant: str
    delta: float
    release_ids: list[str]
    total: LedgerTotal


class DatasetBudget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset_sha256: str
    releases: list[Release] = []
    totals: list[StoredTotal] = []


def budget_path(run_root: Path, dataset_sha256: str) -> Path:
    if len(dataset_sha256) != 64 or any(c not in "0123456789abcdef" for c in dataset_sha256):
        raise ValueError(f"not a sha256: {dataset_sha256!r}")
    return Path(run_root) / BUDGET_DIR / f"{dataset_sha256}.json"


def read_budget(run_root: Path, dataset_sha256: str) -> DatasetBudget:
    """Every release recorded on this dataset (none yet: an empty budget)."""
    path = budget_path(run_root, dataset_sha256)
    if not path.is_file():
        return DatasetBudget(dataset_sha256=dataset_sha256)
    return DatasetBudget.model_validate(json.loads(path.read_text()))


def record_release(
    run_root: Path, dataset_sha256: str, *, release_id: str, stage: str, run_dir: Path, entry: LedgerEntry
) -> tuple[DatasetBudget, bool]:
    """Add one DP release to the dataset's budget, unless it is there already (same
    `release_id`). Returns the budget after the call and whether the release was new."""
    if not (entry.private and entry.epsilon):
        raise ValueError(f"{stage}: only a DP release with ε > 0 spends budget (got ε = {entry.epsilon})")
    path = budget_path(run_root, dataset_sha256)
    private_dir(path.parent)
    # One writer at a time (pipeline/locks.py): read-modify-write; the write itself is atomic (0600).
    with file_lock(path.with_suffix(".lock")):
        budget = read_budget(run_root, dataset_sha256)
        if any(r.release_id == release_id for r in budget.releases):
            return budget, False
        budget.releases.append(Release(
            release_id=release_id, stage=stage, run_dir=str(run_dir),
            recorded_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), entry=entry,
        ))
        atomic_write_json(path, budget.model_dump(mode="json"))
    return budget, True


def dataset_total(budget: DatasetBudget, accountant: str, delta: float) -> LedgerTotal | None:
    """All releases on the dataset composed at `delta` (the current run's δ), as a run's
    ledger total is. None when nothing was released."""
    if not budget.releases:
        return None
    # Named by run, so that the composition names which runs' releases it composes.
    entries = [r.entry.model_copy(update={"stage": f"{r.stage} ({Path(r.run_dir).name})"}) for r in budget.releases]
    note = ""
    if len({e.privacy_unit for e in entries}) > 1:
        # A user-level guarantee implies the same record-level one (a record is part of a
        # user's data), so mixed releases compose at record level.
        entries = [e.model_copy(update={"privacy_unit": "record"}) for e in entries]
        note = "; user-level releases counted at record level"
    total = compose(entries, accountant, delta)
    n = len(budget.releases)
    return total.model_copy(update={
        "note": f"{n} DP release{'s' * (n != 1)} on this dataset, every run together{note}",
    })


def format_budget(budget: DatasetBudget, total: LedgerTotal | None) -> str:
    """The dataset's releases as text, newest last, and their composed total."""
    if not budget.releases:
        return "no DP release recorded on this dataset"
    rows = [("stage", "epsilon", "epsilon_replace_one", "delta", "mechanism", "recorded_at", "run_dir")]
    for r in budget.releases:
        e = r.entry
        rows.append((r.stage, fmt_value(e.epsilon), fmt_value(e.epsilon_replace_one), fmt_value(e.delta),
                     e.mechanism or "-", r.recorded_at, r.run_dir))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[6] for row in rows]
    if total is not None:
        out.append(f"TOTAL: ε = {total.epsilon:.4f}, replace-one ε = {fmt_value(total.epsilon_replace_one)}, "
                   f"δ = {total.delta:.3g} ({total.composition}). {total.note}")
    return "\n".join(out)


def stored_total(budget: DatasetBudget, accountant: str, delta: float) -> LedgerTotal | None:
    """The total kept by `store_total` for exactly these releases, accountant and δ, if any."""
    ids = [r.release_id for r in budget.releases]
    # One stored before the replace-one ε was kept lacks it: composed again (and stored) instead.
    return next((t.total for t in budget.totals if t.accountant == accountant and t.delta == delta
                 and t.release_ids == ids and t.total.epsilon_replace_one is not None), None)


def store_total(run_root: Path, dataset_sha256: str, accountant: str, delta: float, total: LedgerTotal) -> None:
    """Keep the accountant's total of the dataset's current releases (one per accountant and δ)."""
    path = budget_path(run_root, dataset_sha256)
    with file_lock(path.with_suffix(".lock")):
        budget = read_budget(run_root, dataset_sha256)
        kept = [t for t in budget.totals if (t.accountant, t.delta) != (accountant, delta)]
        ids = [r.release_id for r in budget.releases]
        budget.totals = [*kept, StoredTotal(accountant=accountant, delta=delta, release_ids=ids, total=total)]
        atomic_write_json(path, budget.model_dump(mode="json"))
