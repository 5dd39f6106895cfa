"""Stage 0: read the private dataset, build control-coded records, split them.

A record is `"\t".join(codes) + "\n\n" + text + eos` (pipeline/records.py reads, encodes and
splits them; this module is the stage).

The stage streams its input (Arrow batches of 16k rows; never every text in Python lists) in
two passes: the first validates and formats each batch into a temporary 0600 file, with each
record's unit (its user, or its row) hashed under the run root's secret split key, and hashed
for the test draw; the second routes every record to its split by its ranks among those hashes.
The rule (which units are test, validation, train) is pipeline/stages/data_split.py's.

This module reads private data. Errors name the row and the column, never the content.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import DataConfig
from pipeline.manifest import MANIFEST, atomic_write_json, missing_outputs, write_manifest
from pipeline.records import (CODE_JOINER, ROW_GROUP, TOKENIZED_DIR, DataError, code_name, column_type_problem,
                              parquet_batches, read_batches, read_split, read_table, read_users, split_key)
from pipeline.stages.data_split import SplitSizes, digest, hashes_for_test, read_hash_column, split_sizes

log = logging.getLogger(__name__)

MAX_PROBLEMS = 20  # unusable records named in one error
DELETED = "deleted.json"  # beside the manifest: the private splits deleted after evaluation, by name and sha256
FORMAT_ROWS = 8_192  # rows validated at a time: their texts are Python strings while they are


@dataclass(frozen=True)
class DataResult:
    train: Path
    validation: Path
    test: Path
    n_train: int
    n_validation: int
    n_test: int
    n_dropped: int


def _joined_texts(table: pa.Table, cfg: DataConfig) -> tuple[list[str | None], list[str | None]]:
    """Each row's text, its text columns' non-empty parts joined with `data.text_separator`
    (None when every part is empty), and the first text column holding a NUL byte (or None)."""
    columns = [pc.cast(table[c], pa.string()).to_pylist() for c in cfg.text_columns]
    texts, nul = [], []
    for parts in zip(*columns):
        kept = [t for t in parts if t is not None and t.strip()]
        texts.append(cfg.text_separator.join(kept) if kept else None)
        nul.append(next((c for c, t in zip(cfg.text_columns, parts) if t and "\0" in t), None))
    return texts, nul


def _check_columns(schema: pa.Schema, cfg: DataConfig, where: str) -> None:
    wanted = [*cfg.text_columns, *cfg.code_columns] + ([cfg.user_column] if cfg.user_column else [])
    missing = [c for c in wanted if c not in schema.names]
    if missing:
        raise DataError(
            f"{where}: column(s) {missing} not found; the file has {schema.names}. "
            "Set data.text_column / data.code_columns / data.user_column to existing columns."
        )
    if problems := [p for c in wanted if (p := column_type_problem(c, schema.field(c).type, where))]:
        raise DataError("; ".join(problems))


@dataclass
class _Records:
    """One batch's usable records, formatted, and the 1-based data rows they came from."""

    codes: list[str]
    texts: list[str]
    users: list[str] | None
    rows: list[int]


@dataclass
class _Findings:
    """What validating an input found, over all its batches: one error names every problem."""

    where: str
    rows: int = 0
    kept: int = 0
    problems: list[str] = field(default_factory=list)
    n_problems: int = 0
    dropped: list[int] = field(default_factory=list)
    dropped_for_text: int = 0

    def raise_if_unusable(self, cfg: DataConfig) -> None:
        if self.rows == 0:
            raise DataError(f"{self.where}: the file has no records (a header or schema only); point it at a file "
                            "with rows")
        if self.n_problems:
            shown = "\n  - ".join(self.problems)
            more = f"\n  ... and {self.n_problems - len(self.problems)} more" if self.n_problems > len(self.problems) else ""
            raise DataError(
                f"{self.where}: {self.n_problems} unusable record(s):\n  - {shown}{more}\n"
                "Fix or remove these rows, or set data.drop_empty=true to drop empty ones "
                "(they are counted in the data manifest)."
            )
        if not self.kept:  # every row dropped (data.drop_empty): say so, not "only 0 training records"
            what = (f"empty text in column {cfg.text_column!r}" if self.dropped_for_text == len(self.dropped)
                    else "an empty text, control code or user")
            raise DataError(
                f"{self.where}: all {len(self.dropped)} rows have {what}, so data.drop_empty=true left no record; "
                "check that data.text_column / data.code_columns / data.user_column name the right columns"
            )


def _format_batch(table, cfg: DataConfig, allowed: dict[str, set[str]], first_row: int,
                  findings: _Findings) -> _Records:
    """Validate one batch of rows (data rows `first_row`...); return its usable records and
    add what is wrong with the others to `findings`."""
    texts, nul_columns = _joined_texts(table, cfg)
    one = len(cfg.text_columns) == 1
    text_name = f"column {cfg.text_columns[0]!r}" if one else f"columns {cfg.text_columns}"  # for messages
    columns = {c: pc.cast(table[c], pa.string()).to_pylist() for c in cfg.code_columns}
    users = pc.cast(table[cfg.user_column], pa.string()).to_pylist() if cfg.user_column else None
    out = _Records([], [], [] if users is not None else None, [])
    for i, text in enumerate(texts):
        row = first_row + i
        empty, invalid = [], []  # empty fields may be dropped on request; invalid ones never
        if text is None:
            empty.append(f"row {row}, {text_name}: empty text")
        elif nul_columns[i] is not None:
            invalid.append(f"row {row}, column {nul_columns[i]!r}: text contains a NUL byte (remove it)")
        parts = []
        for c in cfg.code_columns:
            v = columns[c][i]
            if v is None or not v.strip():
                empty.append(f"row {row}, column {c!r}: empty control code")
            elif any(ch in v for ch in "\t\n\r"):
                invalid.append(f"row {row}, column {c!r}: control code contains a tab or newline")
            elif (name := code_name(cfg, c, v.strip())) is None:
                invalid.append(f"row {row}, column {c!r}: value not in data.code_values[{c!r}]; add it to the "
                               "mapping, or set data.unmapped_code_values=keep to keep such values as they are")
            elif c in allowed and name not in allowed[c]:
                mapped = " (after data.code_values)" if c in cfg.code_values else ""
                invalid.append(f"row {row}, column {c!r}: value{mapped} not in control_codes.domain[{c!r}]")
            else:
                parts.append(cfg.code_template.format(column=c, value=name))
        if users is not None and (users[i] is None or not users[i].strip()):
            empty.append(f"row {row}, column {cfg.user_column!r}: empty user")
        if empty and not invalid and cfg.drop_empty:
            findings.dropped.append(row)
            findings.dropped_for_text += text is None or not text.strip()
            continue
        if empty or invalid:
            findings.n_problems += len(empty) + len(invalid)
            findings.problems.extend((empty + invalid)[: MAX_PROBLEMS - len(findings.problems)])
            continue
        out.codes.append(CODE_JOINER.join(parts))
        out.texts.append(text)
        out.rows.append(row)
        if users is not None:
            out.users.append(users[i].strip())
    findings.rows += len(texts)
    findings.kept += len(out.texts)
    return out


def _allowed(domain: dict[str, list[str]] | None) -> dict[str, set[str]]:
    return {c: set(v) for c, v in (domain or {}).items()}


def _format_codes(
    table: pa.Table, cfg: DataConfig, where: str, domain: dict[str, list[str]] | None = None
) -> tuple[list[str], list[str], list[str] | None, list[int]]:
    """Validate a whole (small) table's columns and rows; return (control_codes, texts, users or
    None, dropped rows)."""
    _check_columns(table.schema, cfg, where)
    findings = _Findings(where)
    records = _format_batch(table, cfg, _allowed(domain), 1, findings)
    findings.raise_if_unusable(cfg)
    hashes = _copy_hashes(records)
    _warn_copies(where, lambda name: hashes[name], records.users is not None)
    return records.codes, records.texts, records.users, findings.dropped


def _copy_hashes(records: _Records) -> dict[str, np.ndarray]:
    """Each record's 8-byte hash of (codes, text), and by user of (user, codes, text): what
    counting exact copies needs, 8 bytes a record instead of its text."""
    n = len(records.texts)
    out = {"copy": np.fromiter((digest(c, t) for c, t in zip(records.codes, records.texts)), np.uint64, n)}
    if records.users is not None:
        out["user_copy"] = np.fromiter(
            (digest(u, c, t) for u, c, t in zip(records.users, records.codes, records.texts)), np.uint64, n)
    return out


def _distinct(a: np.ndarray) -> int:
    """Distinct values of `a`, sorting it in place (no second copy of 8 bytes a record)."""
    a.sort()
    return int(len(a) > 0) + int(np.count_nonzero(a[1:] != a[:-1]))


def _warn_copies(where: str, column, by_user: bool) -> None:
    """Say how many records repeat another unit's record exactly: DP protects each unit (record,
    or user with data.user_column), so a text that n units hold is protected only as a group of
    n. Counts only, never which records. `column(name)`: a fresh array of the hashes
    `_copy_hashes` makes, one at a time."""
    copies = column("copy")
    n, distinct = len(copies), _distinct(copies)
    del copies
    if not by_user:
        n_copies = n - distinct
        unit, fix = "at record level each copy is a separate unit", "deduplicate the file, or set data.user_column"
    else:  # one user's repeats are one unit already: count the copies held by other users
        n_copies = _distinct(column("user_copy")) - distinct
        unit, fix = "each user is a unit", "deduplicate the file across users (e.g. drop retweets)"
    if n_copies > 0:
        log.warning("%s: %d record(s) repeat %s record exactly (same codes and text); %s, so a repeated "
                    "text is protected only as a group of its copies: %s", where, n_copies,
                    "an earlier" if not by_user else "another user's", unit, fix)


def format_public_split(cfg: DataConfig, source: Path, out: Path) -> Path:
    """Records the user declares public (teacher.monitor_path, the columns of data.path) written
    as a split at `out`, formatted exactly as the private ones, for the teacher's public
    validation loss. Users are dropped: a public loss needs no privacy unit."""
    public = cfg.model_copy(update={"user_column": None})  # no privacy unit: the column need not exist
    codes, texts, _, _ = _format_codes(read_table(source), public, f"teacher.monitor_path {str(source)!r}")
    _write_split(Path(out), codes, texts, None)
    return Path(out)


def delete_private_copies(result: DataResult) -> list[Path]:
    """Delete the private splits and their tokenized copies once nothing reads them any more
    (after evaluation). The splits' sha256 stay in the data manifest; a later run with the
    same data under the same run root rewrites identical files (the split depends on the run
    root's key and the public TEST_SPLIT_SALT alone), so the stages after it stay cached. Which
    splits were deleted is recorded (`DELETED`): a later run that finds exactly them missing
    meets the expected event, not damage (`deleted_as_recorded`)."""
    data_dir = Path(result.train).parent
    outputs = {name: item["sha256"] for name, item in json.loads((data_dir / MANIFEST).read_text())["outputs"].items()}
    deleted, names = [], {}
    for name, path in (("train", result.train), ("validation", result.validation), ("test", result.test)):
        if Path(path).is_file():
            Path(path).unlink()
            deleted.append(Path(path))
            names[name] = outputs[name]
    tokenized = data_dir / TOKENIZED_DIR
    if tokenized.is_dir():
        shutil.rmtree(tokenized)
        deleted.append(tokenized)
    recorded = _deleted_record(data_dir)  # a second deletion (a resumed run) adds to the first
    atomic_write_json(data_dir / DELETED, {"deleted": {**recorded, **names},
                                           "why": "data.keep_private_copies=false: deleted after evaluation"})
    return deleted


def _deleted_record(data_dir: Path) -> dict[str, str]:
    try:
        return dict(json.loads((Path(data_dir) / DELETED).read_text())["deleted"])
    except (OSError, ValueError, KeyError, TypeError):  # none, or unreadable: nothing recorded
        return {}


def deleted_as_recorded(data_dir: Path) -> bool:
    """Whether the data stage's only problem is that private splits are missing, and exactly
    those that `delete_private_copies` recorded deleting (by name and sha256): the expected
    state of a finished run, not a damaged one."""
    missing = missing_outputs(data_dir)
    return bool(missing) and missing == _deleted_record(data_dir)


class _SplitWriter:
    """One private split written in row groups of ROW_GROUP records as they come, readable by its
    owner only (0600) whatever the umask, and in place only when complete."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path, self.schema = Path(path), schema
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.tmp.unlink(missing_ok=True)  # O_EXCL below: never write through a file someone left there
        self.file = os.fdopen(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
        os.fchmod(self.file.fileno(), 0o600)
        self.writer = pq.ParquetWriter(self.file, schema)
        self.pending: list[pa.Table] = []
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        self.pending.append(table)
        if sum(t.num_rows for t in self.pending) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            table = pa.concat_tables(self.pending)
            self.writer.write_table(table, row_group_size=ROW_GROUP)
            self.rows += table.num_rows
            self.pending = []

    def close(self) -> None:
        self._flush()
        if self.rows == 0:  # a schema-only file still reads as an empty split
            self.writer.write_table(self.schema.empty_table())
        self.writer.close()
        self.file.close()
        self.tmp.replace(self.path)

    def discard(self) -> None:
        self.writer.close()
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _split_schema(users: bool, hashes: bool = False) -> pa.Schema:
    """A split's columns; `hashes`: and the formatted file's (unit, unit_test, copy, and by user
    user_copy)."""
    fields = [("control_code", pa.string()), ("text", pa.string())] + ([("user", pa.string())] if users else [])
    if hashes:
        fields += ([("unit", pa.uint64()), ("unit_test", pa.uint64()), ("copy", pa.uint64())]
                   + ([("user_copy", pa.uint64())] if users else []))
    return pa.schema(fields)


HASH_COLUMNS = ["unit", "unit_test", "copy", "user_copy"]


def _records_table(records: _Records, hashes: dict[str, np.ndarray] | None = None) -> pa.Table:
    columns = {"control_code": records.codes, "text": records.texts}
    if records.users is not None:
        columns["user"] = records.users
    return pa.table(columns | (hashes or {}), schema=_split_schema(records.users is not None, hashes is not None))


def _write_split(path: Path, codes: list[str], texts: list[str], users: list[str] | None) -> None:
    """Write one private split (a small one, whole), readable by its owner only (0600)."""
    writer = _SplitWriter(path, _split_schema(users is not None))
    writer.write(_records_table(_Records(codes, texts, users, [])))
    writer.close()


def _format_file(cfg: DataConfig, path: Path, max_records: int | None, where: str,
                 domain: dict[str, list[str]] | None, out: Path, key: bytes) -> _Findings:
    """Pass 1: stream one input through validation into the temporary 0600 file `out`, each
    record with its unit's keyed hash (column `unit`: the unit is the user, or the record's data
    row), the hash that draws test (`unit_test`, data_split.py `hashes_for_test`) and the hashes
    that count exact copies (warned about here)."""
    batches = read_batches(path, max_records)
    _check_columns(batches.schema, cfg, where)
    findings, allowed = _Findings(where), _allowed(domain)
    writer = _SplitWriter(out, _split_schema(cfg.user_column is not None, hashes=True))
    try:
        for batch in (b.slice(i, FORMAT_ROWS) for b in batches for i in range(0, b.num_rows, FORMAT_ROWS)):
            records = _format_batch(batch, cfg, allowed, findings.rows + 1, findings)
            ids = records.users if records.users is not None else map(str, records.rows)
            unit = np.fromiter((digest(u, key=key) for u in ids), np.uint64, len(records.texts))
            test = hashes_for_test(cfg, records.codes, records.texts, records.users, unit)
            writer.write(_records_table(records, {"unit": unit, "unit_test": test, **_copy_hashes(records)}))
        findings.raise_if_unusable(cfg)
    except BaseException:
        writer.discard()
        raise
    writer.close()
    _warn_copies(where, lambda name: read_hash_column(out, name, findings.kept), cfg.user_column is not None)
    return findings


ARROW_JEMALLOC_DECAY_MS = 1000  # Arrow's own setting, restored after the stage


@contextmanager
def _returning_arrow_memory():
    """Arrow's default pool (mimalloc) keeps what the Parquet reader frees: streaming a file of
    64k-record row groups held ~110 MB more RSS than with jemalloc, which gives it back; with
    its decay at 0 (at once) another ~50 MB less at 1 M records, for ~20 % more time."""
    jemalloc = True
    try:
        pool = pa.jemalloc_memory_pool()
        pa.jemalloc_set_decay_ms(0)
    except NotImplementedError:  # a pyarrow built without jemalloc
        pool, jemalloc = pa.system_memory_pool(), False
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        yield
    finally:
        pa.set_memory_pool(previous)
        if jemalloc:
            pa.jemalloc_set_decay_ms(ARROW_JEMALLOC_DECAY_MS)


def prepare_data(
    cfg: DataConfig, out_dir: Path, code_domain: dict[str, list[str]] | None = None, key: bytes | None = None
) -> DataResult:
    """Read, validate, split and write the private splits (train / validation / test), streaming.

    With `data.user_column`, splits are made by user, so that no author has records on both
    sides of a split (the test perplexity would otherwise flatter the models). `key`: the run
    root's split key (`split_key`); None draws a fresh one, a new random split (of train and
    validation only with data.test_split=fixed).
    """
    out_dir = Path(out_dir)
    key = secrets.token_bytes(32) if key is None else key
    users = cfg.user_column is not None
    paths = {"test": out_dir / "test.parquet", "validation": out_dir / "validation.parquet",
             "train": out_dir / "train.parquet"}
    formatted, formatted_test = out_dir / ".formatted.parquet", out_dir / ".formatted-test.parquet"
    with _returning_arrow_memory():
        findings, test_findings, sizes, counts = _split_files(cfg, code_domain, key, formatted, formatted_test, paths)
    test_dropped = test_findings.dropped if test_findings else []
    result = DataResult(train=paths["train"], validation=paths["validation"], test=paths["test"],
                        n_train=counts["train"], n_validation=counts["validation"], n_test=counts["test"],
                        n_dropped=len(findings.dropped) + len(test_dropped))
    inputs = {"data": cfg.path} | ({"test_data": cfg.test_path} if cfg.test_path else {})
    (out_dir / DELETED).unlink(missing_ok=True)  # the splits are here again: a record of their deletion is stale
    write_manifest(
        out_dir,
        stage="data",
        inputs=inputs,
        outputs={"train": result.train, "validation": result.validation, "test": result.test},
        extra={
            "n_train": result.n_train,
            "n_validation": result.n_validation,
            "n_test": result.n_test,
            "n_dropped": result.n_dropped,
            "n_train_users": sizes.n_train if users else None,
            "dropped_rows": {"data.path": findings.dropped, "data.test_path": test_dropped},
        },
    )
    log.info(
        "data: %d train, %d validation, %d test records, %d dropped",
        result.n_train, result.n_validation, result.n_test, result.n_dropped,
    )
    return result


def _split_files(cfg: DataConfig, code_domain, key: bytes, formatted: Path, formatted_test: Path,
                 paths: dict[str, Path]):
    """Both passes: the inputs validated into temporary files (deleted here), then the splits."""
    users = cfg.user_column is not None
    try:
        findings = _format_file(cfg, cfg.path, cfg.max_records, f"data.path {str(cfg.path)!r}", code_domain,
                                formatted, key)
        sizes = split_sizes(cfg, formatted, findings.kept, users)
        test_findings = None
        if cfg.test_path is not None:
            test_findings = _format_file(cfg, cfg.test_path, cfg.max_test_records,
                                         f"data.test_path {str(cfg.test_path)!r}", code_domain, formatted_test, key)
        counts = _write_splits(formatted, formatted_test if test_findings else None, sizes, paths, users)
    finally:
        formatted.unlink(missing_ok=True)
        formatted_test.unlink(missing_ok=True)
    return findings, test_findings, sizes, counts


def _write_splits(formatted: Path, formatted_test: Path | None, sizes: SplitSizes, paths: dict[str, Path],
                  users: bool) -> dict[str, int]:
    """Pass 2: every record of `formatted` to its unit's side (all of `formatted_test` to test),
    in file order; the splits written whole or not at all. Returns each split's record count."""
    writers = {name: _SplitWriter(path, _split_schema(users)) for name, path in paths.items()}
    sides = ["test", "validation", "train"]  # SplitSizes.side's 0, 1, 2
    counts, draw = dict.fromkeys(paths, 0), sizes.test_draw()
    try:
        for batch in parquet_batches(formatted):
            table = pa.Table.from_batches([batch])
            side = sizes.side(table["unit"].to_numpy(), draw(table["unit_test"].to_numpy()))
            table = table.drop_columns([c for c in HASH_COLUMNS if c in table.column_names])
            for i, name in enumerate(sides):
                if (mask := side == i).any():
                    writers[name].write(table.filter(pa.array(mask)))
                    counts[name] += int(mask.sum())
        if formatted_test is not None:
            for batch in parquet_batches(formatted_test):
                table = pa.Table.from_batches([batch])
                writers["test"].write(table.drop_columns([c for c in HASH_COLUMNS if c in table.column_names]))
                counts["test"] += table.num_rows
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    for w in writers.values():
        w.close()
    return counts


@dataclass(frozen=True)
class PlannedSplit:
    """The data stage's split as `dpdistill plan` needs it, written nowhere."""

    n: int
    """Privacy units the teacher's DP-SGD samples from."""
    unit: str
    """'record' or 'user'."""
    n_validation: int
    """Validation records."""
    n_validation_units: int
    """Validation units (records, or users): what the DP monitor's and the private selection's means are over."""
    test_codes: list[str]
    test_texts: list[str]
    """Held out and never trained on; the plan times evaluation by their token count only, a
    figure the run publishes anyway (metrics.json's perplexity `tokens`)."""


def _planned(cfg: DataConfig, code_domain, run_root: Path, read) -> object:
    """`read(result)` of the split the data stage will make under `run_root` (its key; a
    throwaway one before the first run: the sizes are the same, and with data.test_split=fixed
    the test records, but not which units validate), made in a temporary 0600 directory deleted
    at once."""
    key = split_key(run_root, create=False)
    with tempfile.TemporaryDirectory(prefix="dpdistill-plan-") as tmp:
        return read(prepare_data(cfg, Path(tmp), code_domain, key))


def planned_split(cfg: DataConfig, run_root: Path, code_domain: dict[str, list[str]] | None = None,
                  read_train=None):
    """The split the data stage will make, read and validated the same way, kept nowhere. With
    `read_train`: (that split, `read_train(path)` of its training file), from the one split
    (`dpdistill plan` reads the records' budget there)."""
    if read_train is None:
        return _planned(cfg, code_domain, run_root, read_planned)
    return _planned(cfg, code_domain, run_root, lambda result: (read_planned(result), read_train(result.train)))


def read_planned(result: DataResult) -> PlannedSplit:
    """What the plan needs of a split the data stage wrote (pipeline/split_ahead.py: made for the run's plan)."""
    manifest = json.loads((Path(result.train).parent / "manifest.json").read_text())
    users = manifest["n_train_users"]
    codes, texts = read_split(result.test)
    validation_users = read_users(Path(result.validation))
    return PlannedSplit(n=result.n_train if users is None else users, unit="record" if users is None else "user",
                        n_validation=result.n_validation,
                        n_validation_units=result.n_validation if validation_users is None else len(set(validation_users)),
                        test_codes=codes, test_texts=texts)


def with_training_split(cfg: DataConfig, run_root: Path, code_domain: dict[str, list[str]] | None, read):
    """`read(path)` of the training split file as the data stage will write it under `run_root`,
    kept nowhere: how `dpdistill plan` finds its records' privacy budget (pipeline/privacy/budget.py)."""
    return _planned(cfg, code_domain, run_root, lambda result: read(result.train))
