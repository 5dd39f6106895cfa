"""The privacy budget spent on one dataset's records across every run, not just one run's.

Each run's ledger shows what that run released. But every `--force teacher`, and every run
with a changed config, trains a new DP model on the same records: the guarantee for a
person in the data is the composition of *all* those releases. This module keeps one
ledger per set of training records under `run_root/.privacy/` (0600, in a 0700 directory) and
composes it the way a run's total is composed (`pipeline.privacy.ledger.compose`: Gaussian
histories jointly through the accountant, pure ε added), always at the δ its first release fixed.

Keyed by the records, not the file's bytes (issue 21 item 4): a copy of the data with one
byte changed past the rows used trains on the same records and lands in the same budget.
Each training record (control code and text) is hashed with HMAC-SHA256 under a secret key
made once per run_root, so the stored digests tell nothing about the records to someone
without the key (no dictionary of guessed reviews can be tested against them). The key lives
outside the run_root (`key_dir`: ~/.config/dpdistill/keys or $DPDISTILL_KEY_DIR, 0600 in
0700), `.privacy/key-id` naming which one: beside the digests, both outliving the deleted
splits, it made any copy of `.privacy/` a membership oracle (issue 38 item 5). A budget is
named by the keyed digest of its record set; its digests are kept beside it
(`<id>.records`). A release is charged to every budget whose records overlap the ones it
trained on, and a new budget starts with every earlier release on records it shares: a
subset, a superset or an overlapping sample of the same data is never a fresh budget.

A release is identified by its stage's manifest digest (the sha256 of its outputs): a
cached or reused stage is the same release and is recorded once; a retrained teacher (new
DP noise) is a new one. `privacy.max_epsilon` (`check_max_epsilon`) refuses a run whose
releases would take a budget past it.

    budget_id = register_records(run_root, split_digests(train_path, records_key(run_root)))
    budget, new = record_release(run_root, budget_id, release_id=digest, stage="teacher", run_dir=run, entry=entry)
    total = dataset_total(budget, accountant="prv", run_delta=1e-5)  # at the δ its first release fixed
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.config import ConfigError
from pipeline.privacy.ledger import (LedgerEntry, LedgerTotal, compose, current_stage_name, fmt_value,
                                     with_pld_epsilons)
from pipeline.locks import file_lock
from pipeline.manifest import atomic_write_chunks, atomic_write_json, atomic_write_text, private_dir

BUDGET_DIR = ".privacy"
KEY_DIR_ENV = "DPDISTILL_KEY_DIR"
KEY_ID_FILE = "key-id"
"""In `.privacy/`: which key of `key_dir` is the run_root's. It names the key and is no secret."""
OLD_KEY_FILE = "records.key"
"""Where the key was kept before issue 38, beside the digests: moved to `key_dir` on first use."""
LOCK_FILE = "budgets.lock"
"""One lock for every budget of a run_root: a release may be charged to several at once."""


class Release(BaseModel):
    model_config = ConfigDict(extra="forbid")

    release_id: str
    """The releasing stage's manifest digest: the same outputs are the same release."""
    records_id: str | None = None
    """The budget of the records it trained on (a release charged to an overlapping budget keeps it)."""
    stage: str
    run_dir: str
    recorded_at: str
    entry: LedgerEntry
    """The stage's ledger entry: δ, the (σ, q, steps) history or the pure ε, privacy unit."""

    @field_validator("stage")
    @classmethod
    def _current_name(cls, stage: str) -> str:  # a budget written before a stage was renamed
        return current_stage_name(stage)


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

    records_id: str = Field(validation_alias=AliasChoices("records_id", "dataset_sha256"))
    """Keyed digest of the record set (budgets written before issue 21: the training file's sha256)."""
    n_records: int | None = None
    releases: list[Release] = []
    delta: float | None = None
    """The δ every total of these records is composed and checked at: the first release's, fixed by
    the first run that spent on them (a set overlapping earlier ones: its oldest inherited release's).
    A later run's own δ may differ (a subset's N is smaller, so its δ = 1/(10N) is larger), and the
    same releases composed at it counted less: 1.798 at δ = 2.63e-4 where the demo's spent 2.066 at
    δ = 7.0e-5 (issue 38 item 4). None until a release with a δ is recorded."""
    totals: list[StoredTotal] = []

    @model_validator(mode="after")
    def _first_release_fixes_delta(self) -> "DatasetBudget":
        # Releases are only ever appended, oldest first: the first one's δ never changes.
        # Budgets written before the field get it the same way.
        if self.delta is None:
            self.delta = next((r.entry.delta for r in self.releases if r.entry.delta), None)
        return self


def budget_path(run_root: Path, budget_id: str) -> Path:
    if len(budget_id) != 64 or any(c not in "0123456789abcdef" for c in budget_id):
        raise ValueError(f"not a budget id (64 hex digits): {budget_id!r}")
    return Path(run_root) / BUDGET_DIR / f"{budget_id}.json"


log = logging.getLogger(__name__)


class RecordsKeyError(ConfigError):
    """The run_root's records key cannot be read where its `.privacy/key-id` says it is."""


def key_dir() -> Path:
    """The folder of the records keys, one `<key id>.key` per run_root: $DPDISTILL_KEY_DIR, else
    ~/.config/dpdistill/keys. Never under a run_root: a copy of one (a backup, a shared folder)
    then holds the record digests without the key that tests a record against them."""
    return Path(os.environ.get(KEY_DIR_ENV) or Path.home() / ".config" / "dpdistill" / "keys")


def _key_path(key_id: str) -> Path:
    if len(key_id) != 32 or any(c not in "0123456789abcdef" for c in key_id):
        raise RecordsKeyError(f"{BUDGET_DIR}/{KEY_ID_FILE} holds {key_id[:40]!r}, not a key id (32 hex digits)")
    return key_dir() / f"{key_id}.key"


def _read_key(folder: Path) -> bytes:
    key_id = (folder / KEY_ID_FILE).read_text().strip()
    path = _key_path(key_id)
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as e:
        raise RecordsKeyError(
            f"the secret key of the privacy budgets in {folder} cannot be read at {path} ({type(e).__name__}); without "
            "it their records cannot be recognised, so no release can be recorded or checked against "
            f"privacy.max_epsilon. Fix: restore {path.name} (mode 0600) into {path.parent}, or set {KEY_DIR_ENV} to "
            "the folder that holds it (on another machine or in a container: copy it there, never into the run_root)"
        ) from e


def _new_key(folder: Path, key_hex: str) -> None:
    """Keep `key_hex` in `key_dir` (0600 in 0700), under a new id that `folder`'s key-id names."""
    key_id = secrets.token_hex(16)
    path = _key_path(key_id)
    private_dir(path.parent)
    atomic_write_text(path, key_hex)  # mkstemp: 0600 whatever the umask
    atomic_write_text(folder / KEY_ID_FILE, key_id)  # after the key: a key-id always names a written key


def records_key(run_root: Path) -> bytes:
    """The run_root's secret key for record digests, made on first use, kept in `key_dir`.
    A run_root whose key sits beside the digests (made before issue 38) has it moved out, once."""
    folder = private_dir(Path(run_root) / BUDGET_DIR)
    old = folder / OLD_KEY_FILE
    with file_lock(folder / LOCK_FILE):
        if not (folder / KEY_ID_FILE).is_file():
            _new_key(folder, old.read_text().strip() if old.is_file() else secrets.token_hex(32))
        key = _read_key(folder)
        if old.is_file():
            old.unlink()
            log.warning("privacy budget: the records key of %s sat beside the record digests, where a copy of "
                        "%s/ could test any record for membership; moved to %s (issue 38). Back that folder up apart "
                        "from the run_root; copies of %s/ made before hold the key: delete them or keep them as "
                        "private as the data", run_root, BUDGET_DIR, key_dir(), BUDGET_DIR)
    return key


def existing_records_key(run_root: Path) -> bytes | None:
    """The key if the run_root has one (nothing recorded yet otherwise); creates and moves nothing (`plan`)."""
    folder = Path(run_root) / BUDGET_DIR
    if (folder / KEY_ID_FILE).is_file():
        return _read_key(folder)
    old = folder / OLD_KEY_FILE  # moved out by the next run that records
    return bytes.fromhex(old.read_text().strip()) if old.is_file() else None


DIGEST = np.dtype("S16")
"""A record's digest: the first 128 bits of HMAC-SHA256(key, json [code, text]), stored as 32 hex
digits a line in `<id>.records`. Held as sorted numpy arrays (16 bytes a record: 160 MB at 10 M
records), never as sets of Python strings (~110 bytes a record)."""
LINE = 33  # bytes of one stored digest: 32 hex digits and a newline
CHUNK = 1 << 16  # digests read, hashed or written at a time


def _digest(key: bytes, code: str, text: str) -> bytes:
    return hmac.new(key, json.dumps([code, text]).encode(), hashlib.sha256).digest()[:16]


def _sorted_unique(digests: np.ndarray) -> np.ndarray:
    digests.sort()  # in place: no second copy of the split's digests
    if len(digests) < 2:
        return digests
    keep = np.empty(len(digests), bool)
    keep[0] = True
    np.not_equal(digests[1:], digests[:-1], out=keep[1:])
    return digests if keep.all() else digests[keep]


def record_digests(codes: list[str], texts: list[str], key: bytes) -> np.ndarray:
    """Keyed digests of the training records (each its control code and text), sorted and
    distinct: the same record gives the same digest under one run_root, whatever file it came from."""
    return _sorted_unique(np.array([_digest(key, c, t) for c, t in zip(codes, texts, strict=True)], DIGEST))


def split_digests(path: Path, key: bytes) -> np.ndarray:
    """`record_digests` of a split file, streamed: its texts are never all in memory."""
    from pipeline.records import parquet_batches  # pyarrow: not for `ledger show`, which only reads

    out, n = np.empty(_num_rows(path), DIGEST), 0
    for batch in parquet_batches(path, columns=["control_code", "text"], batch_size=CHUNK):
        codes, texts = batch.column(0).to_pylist(), batch.column(1).to_pylist()
        out[n:n + len(codes)] = [_digest(key, c, t) for c, t in zip(codes, texts)]
        n += len(codes)
    return _sorted_unique(out[:n])


def _num_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def _records_path(run_root: Path, budget_id: str) -> Path:
    return budget_path(run_root, budget_id).with_suffix(".records")


def _stored_chunks(path: Path) -> Iterator[np.ndarray]:
    """The digests of a `.records` file, CHUNK at a time."""
    with open(path, "rb") as f:
        while block := f.read(LINE * CHUNK):
            yield np.frombuffer(bytes.fromhex(block.replace(b"\n", b"").decode("ascii")), DIGEST)


def _read_stored(path: Path) -> np.ndarray:
    return np.concatenate([np.empty(0, DIGEST), *_stored_chunks(path)])


def _hex_lines(digests: np.ndarray) -> Iterator[bytes]:
    for i in range(0, len(digests), CHUNK):
        # tobytes, not tolist: numpy drops a bytes item's trailing zero bytes
        h = digests[i:i + CHUNK].tobytes().hex()
        yield "".join(h[j:j + 32] + "\n" for j in range(0, len(h), 32)).encode()


def _shares(chunks: Iterable[np.ndarray], digests: np.ndarray) -> bool:
    """Whether any digest of `chunks` is in the sorted `digests`."""
    if len(digests) == 0:
        return False
    for chunk in chunks:
        at = np.minimum(np.searchsorted(digests, chunk), len(digests) - 1)
        if (digests[at] == chunk).any():
            return True
    return False


def _overlapping(run_root: Path, digests: np.ndarray) -> list[str]:
    """Every budget under run_root whose records share one with `digests` (sorted), by id; each
    budget's stored digests streamed, never all budgets in memory at once."""
    folder = Path(run_root) / BUDGET_DIR
    return [p.stem for p in sorted(folder.glob("*.records")) if _shares(_stored_chunks(p), digests)]


def _releases_on(run_root: Path, digests: np.ndarray) -> list[Release]:
    """Every release made on records that overlap `digests`, oldest first, each once."""
    found: dict[str, Release] = {}
    for other in _overlapping(run_root, digests):
        for r in read_budget(run_root, other).releases:
            if r.records_id == other:  # made on that set; the ones charged to it come from their own
                found.setdefault(r.release_id, r)
    return sorted(found.values(), key=lambda r: r.recorded_at)


def _budget_id(key: bytes, digests: np.ndarray) -> str:
    """HMAC of the sorted hex digests joined by newlines (as budgets were always named)."""
    mac, pending = hmac.new(key, digestmod=hashlib.sha256), b""
    for block in _hex_lines(digests):
        mac.update(pending)
        pending = block
    mac.update(pending[:-1])  # no newline after the last digest
    return mac.hexdigest()


def budget_of(run_root: Path, train_path: Path) -> DatasetBudget:
    """The budget the records of this training split would have, as it stands, writing nothing
    (`dpdistill plan`, `privacy.max_epsilon`)."""
    key = existing_records_key(run_root)
    if key is None:  # no release was ever recorded under this run_root
        return DatasetBudget(records_id="0" * 64, n_records=_num_rows(train_path))
    digests = split_digests(train_path, key)
    return DatasetBudget(records_id=_budget_id(key, digests), n_records=len(digests),
                         releases=_releases_on(run_root, digests))


def register_records(run_root: Path, digests: np.ndarray) -> str:
    """The id of the budget of exactly these records (`record_digests`, `split_digests`), made if
    new with every earlier release on records they share (a subset, superset or overlap of an
    earlier run's training split)."""
    budget_id = _budget_id(records_key(run_root), digests)
    path = budget_path(run_root, budget_id)
    with file_lock(path.parent / LOCK_FILE):
        if _records_path(run_root, budget_id).is_file():
            return budget_id
        budget = DatasetBudget(records_id=budget_id, n_records=len(digests), releases=_releases_on(run_root, digests))
        atomic_write_json(path, budget.model_dump(mode="json"))
        atomic_write_chunks(_records_path(run_root, budget_id), _hex_lines(digests))  # 0600
    return budget_id


def read_budget(run_root: Path, budget_id: str) -> DatasetBudget:
    """Every release charged to this budget (none yet: an empty budget)."""
    path = budget_path(run_root, budget_id)
    if not path.is_file():
        return DatasetBudget(records_id=budget_id)
    return DatasetBudget.model_validate(json.loads(path.read_text()))


def record_release(
    run_root: Path, budget_id: str, *, release_id: str, stage: str, run_dir: Path, entry: LedgerEntry
) -> tuple[DatasetBudget, bool]:
    """Charge one DP release on the records of `budget_id` to that budget and to every budget whose
    records overlap them, unless it is there already (same `release_id`). Returns this budget
    after the call and whether the release was new to it."""
    if not (entry.private and entry.epsilon):
        raise ValueError(f"{stage}: only a DP release with ε > 0 spends budget (got ε = {entry.epsilon})")
    if entry.epsilon_replace_one is None:
        # A stage may hand back an entry before its replace-one ε is computed (the validation
        # monitor's: the run's ledger fills it in when it composes); the budget keeps it whole,
        # else `ledger show` printed "-" for it (issue 62 item 4).
        entry = with_pld_epsilons(entry)
    return _append(run_root, budget_id, release_id, stage, run_dir, entry)


def record_non_dp_release(run_root: Path, budget_id: str, *, release_id: str, stage: str, run_dir: Path,
                          unit: str, note: str) -> DatasetBudget:
    """Record a release computed from the records without DP (the empirical audit's noise-off
    training, made only on request: issue 62 item 6), on this budget and every overlapping one,
    so that every later total of these records says that their guarantee no longer covers
    everything released from them (`compose` marks it NOT DP)."""
    entry = LedgerEntry(stage=stage, private=False, epsilon=None, privacy_unit=unit, note=note)
    return _append(run_root, budget_id, release_id, stage, run_dir, entry)[0]


def _append(run_root: Path, budget_id: str, release_id: str, stage: str, run_dir: Path,
            entry: LedgerEntry) -> tuple[DatasetBudget, bool]:
    path = budget_path(run_root, budget_id)
    private_dir(path.parent)
    release = Release(release_id=release_id, records_id=budget_id, stage=stage, run_dir=str(run_dir),
                      recorded_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), entry=entry)
    # One writer at a time (pipeline/locks.py): read-modify-write; each write is atomic (0600).
    with file_lock(path.parent / LOCK_FILE):
        records = _records_path(run_root, budget_id)
        charged = _overlapping(run_root, _read_stored(records)) if records.is_file() else []
        new = False
        for bid in dict.fromkeys([budget_id, *charged]):
            budget = read_budget(run_root, bid)
            if any(r.release_id == release_id for r in budget.releases):
                continue
            new |= bid == budget_id
            budget.releases.append(release)
            atomic_write_json(budget_path(run_root, bid), budget.model_dump(mode="json"))
    return read_budget(run_root, budget_id), new


def dataset_total(
    budget: DatasetBudget, accountant: str, run_delta: float, planned: list[LedgerEntry] = ()
) -> LedgerTotal | None:
    """All releases charged to the budget, and the `planned` ones not made yet, composed as a
    run's ledger total is, at the budget's δ (`DatasetBudget.delta`); at `run_delta`, the current
    run's, only while no release has fixed it. None when there is none."""
    # Named by run, so that the composition names which runs' releases it composes.
    entries = [r.entry.model_copy(update={"stage": f"{r.stage} ({Path(r.run_dir).name})"}) for r in budget.releases]
    entries += [e.model_copy(update={"stage": f"{e.stage} (planned)"}) for e in planned if e.private and e.epsilon]
    if not entries:
        return None
    note = ""
    if len({e.privacy_unit for e in entries}) > 1:
        # A user-level guarantee implies the same record-level one (a record is part of a
        # user's data), so mixed releases compose at record level.
        entries = [e.model_copy(update={"privacy_unit": "record"}) for e in entries]
        note = "; user-level releases counted at record level"
    total = compose(entries, accountant, budget.delta if budget.delta is not None else run_delta)
    n = sum(r.entry.private for r in budget.releases)
    return total.model_copy(update={
        "note": f"{n} DP release{'s' * (n != 1)} on these records or records overlapping them, every run "
        f"together{' and this run planned' if planned else ''}{note}"
        + ("" if total.complete else f"; {total.note}"),  # a release without DP: the guarantee says so
    })


class BudgetExceeded(ConfigError):
    """A run whose DP releases would take its records' budget past `privacy.max_epsilon`."""


def check_max_epsilon(
    budget: DatasetBudget, planned: list[LedgerEntry], max_epsilon: float | None, accountant: str, run_delta: float
) -> LedgerTotal | None:
    """The budget's total with the `planned` releases added, at the budget's δ (`dataset_total`);
    BudgetExceeded past `max_epsilon` (add/remove ε, the unit of teacher.target_epsilon)."""
    total = dataset_total(budget, accountant, run_delta, planned)
    if max_epsilon is None or total is None or total.epsilon <= max_epsilon:
        return total
    spent = dataset_total(budget, accountant, run_delta)
    now = "nothing yet" if spent is None else (
        f"ε = {spent.epsilon:.4f} (replace-one {fmt_value(spent.epsilon_replace_one)}) over "
        f"{len(budget.releases)} DP release(s) by earlier runs")
    this_run = ", ".join(f"{e.stage} ε = {e.epsilon:.4f}" for e in planned if e.private and e.epsilon)
    at = f"δ = {total.delta:.3g}"
    if total.accountant_delta() != run_delta:
        at += (f", the δ of these records' budget, fixed by the first run that spent on them (this run's own δ is "
               f"{run_delta:.3g}: every run is checked at the budget's, so the same releases always count the same)")
    fix = ("lower teacher.target_epsilon (or control_codes.epsilon, base_models.tokenizer_epsilon) so that the "
           "total stays within it, reuse a finished run's outputs instead of training again, or raise "
           "privacy.max_epsilon if spending more on these records is intended")
    if spent is not None and spent.epsilon >= max_epsilon:
        fix = ("this budget is spent: train on other records, or raise privacy.max_epsilon if spending more on "
               "these records is intended")
    raise BudgetExceeded(
        f"privacy.max_epsilon={max_epsilon}: the training records of this run have spent {now} under this "
        f"run_root, and this run ({this_run}) would bring the total to ε = {total.epsilon:.4f} at {at}; "
        f"refused before training. Fix: {fix} (`dpdistill ledger show RUN_DIR` lists the releases)"
    )


def format_budget(budget: DatasetBudget, total: LedgerTotal | None) -> str:
    """The dataset's releases as text, newest last, and their composed total."""
    if not budget.releases:
        return "no DP release recorded on this dataset"
    rows = [("stage", "epsilon", "epsilon_replace_one", "delta", "mechanism", "recorded_at", "run_dir")]
    for r in budget.releases:
        # Recorded without its replace-one ε by a version before issue 62 (a monitor's entry):
        # computed here, by dp-accounting alone (no Opacus, no torch).
        e = r.entry if r.entry.epsilon_replace_one is not None else with_pld_epsilons(r.entry)
        rows.append((r.stage, fmt_value(e.epsilon), fmt_value(e.epsilon_replace_one), fmt_value(e.delta),
                     e.mechanism or ("-" if e.private else "NOT DP"), r.recorded_at, r.run_dir))
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


def store_total(run_root: Path, budget_id: str, accountant: str, delta: float, total: LedgerTotal) -> None:
    """Keep the accountant's total of the dataset's current releases (one per accountant and δ)."""
    path = budget_path(run_root, budget_id)
    with file_lock(path.parent / LOCK_FILE):
        budget = read_budget(run_root, budget_id)
        kept = [t for t in budget.totals if (t.accountant, t.delta) != (accountant, delta)]
        ids = [r.release_id for r in budget.releases]
        budget.totals = [*kept, StoredTotal(accountant=accountant, delta=delta, release_ids=ids, total=total)]
        atomic_write_json(path, budget.model_dump(mode="json"))
