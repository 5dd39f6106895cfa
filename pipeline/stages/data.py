"""Stage 0: read the private dataset, build control-coded records, split them.

A record is `"\t".join(codes) + "\n\n" + text + eos`. The prefix and the text are
tokenized separately (`encode_record`) so that training, generation prompts and
evaluation all see the same token boundary after the control codes.

This module reads private data. Errors name the row and the column, never the content.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from pipeline.config import DataConfig
from pipeline.manifest import write_manifest

log = logging.getLogger(__name__)

SEPARATOR = "\n\n"
CODE_JOINER = "\t"
ROW_GROUP = 65_536  # records per Parquet row group of a split
TOKENIZED_DIR = "tokenized"  # the splits' token ids, next to them (pipeline/tokenized.py): private too


class DataError(ValueError):
    """The private dataset cannot be used as configured; the message says where and how to fix."""


@dataclass(frozen=True)
class DataResult:
    train: Path
    validation: Path
    test: Path
    n_train: int
    n_validation: int
    n_test: int
    n_dropped: int


def prompt_for(control_code: str) -> str:
    """The generation prompt (and training prefix) for one control code."""
    return control_code + SEPARATOR


def encode_record(tokenizer, control_code: str, text: str, max_length: int | None = None) -> list[int]:
    """Token ids of prefix + text + eos; prefix and text tokenized apart (see module doc)."""
    ids = (
        tokenizer.encode(prompt_for(control_code), add_special_tokens=False)
        + tokenizer.encode(text, add_special_tokens=False)
        + [tokenizer.eos_token_id]
    )
    return ids[:max_length] if max_length else ids


def read_table(path: Path) -> pa.Table:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} not found; set data.path to an existing file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            # Every column as a string: control codes like "4.0" must not become floats.
            with open(path, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), [])
            return pacsv.read_csv(
                path,
                parse_options=pacsv.ParseOptions(newlines_in_values=True),
                convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in header}, strings_can_be_null=True
                ),
            )
        if suffix in (".jsonl", ".json"):
            return pajson.read_json(path)
        if suffix == ".parquet":
            return pq.read_table(path)
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as e:
        if suffix in (".jsonl", ".json") and (problems := jsonl_problems(path)):
            # Arrow's own message names a row of its block, not of the file, and often the wrong one.
            raise DataError(f"{str(path)!r}: {'; '.join(problems)}") from None
        # Arrow's message can quote a line of the file: keep only the kind of failure.
        raise DataError(
            f"could not parse {str(path)!r} as {suffix[1:]} ({type(e).__name__}); "
            "check the file's format and encoding"
        ) from None
    raise DataError(
        f"data file {str(path)!r} has unsupported type {suffix!r}; use .csv, .jsonl or .parquet"
    )


def _kind(value) -> str:
    return {str: "a string", bool: "true/false", int: "a number", float: "a number", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def jsonl_problems(path: Path, limit: int = 5) -> list[str]:
    """Rows of a JSON-lines file that Arrow cannot read into one table, each named by row and
    column (never quoted): a line that is not a JSON object, or a value whose kind differs from
    the rest of its column (a number or a list among texts). Streams the file with the json
    module; Arrow stops at the first such row and names a row of its block, not of the file."""
    kinds: dict[str, dict[str, list[int]]] = {}  # column -> kind -> first rows having it
    counts: dict[str, dict[str, int]] = {}
    problems = []
    with open(path, encoding="utf-8") as f:
        row = 0
        for line in f:
            if not line.strip():
                continue
            row += 1
            try:
                record = json.loads(line)
            except ValueError:
                problems.append(f"row {row}: not valid JSON (each line must hold one JSON object)")
                continue
            if not isinstance(record, dict):
                problems.append(f"row {row}: {_kind(record)}, not a JSON object of columns")
                continue
            for column, value in record.items():
                if value is None:
                    continue
                kind = _kind(value)
                rows = kinds.setdefault(column, {}).setdefault(kind, [])
                counts.setdefault(column, {}).setdefault(kind, 0)
                counts[column][kind] += 1
                if len(rows) < limit:
                    rows.append(row)
    for column, by_kind in kinds.items():
        usual = max(counts[column], key=counts[column].get)
        for kind, rows in by_kind.items():
            if kind != usual:
                more = counts[column][kind] - len(rows)
                problems.append(
                    f"row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}{f' (and {more} more)' if more else ''}, "
                    f"column {column!r}: {kind} where the other rows have {usual} "
                    "(write every value of a column as the same JSON type, texts as strings)"
                )
    return problems[: 2 * limit]


def column_type_problem(column: str, type_: pa.DataType, where: str) -> str | None:
    """Why a text, code or user column cannot be used, if it cannot: one value per row is needed,
    not a list or a struct (Arrow would fail with ArrowNotImplementedError on the cast)."""
    if pa.types.is_nested(type_):
        return (f"{where}: column {column!r} holds {type_} values, not one text or code per row; "
                "store a single string in each row (e.g. join a list into one string)")
    return None


def code_name(cfg: DataConfig, column: str, value: str) -> str | None:
    """The name a code column's value stands for (`data.code_values`); None when the column's
    mapping lacks it and `data.unmapped_code_values` is 'error'."""
    mapping = cfg.code_values.get(column)
    if mapping is None or value in mapping:
        return mapping[value] if mapping else value
    return value if cfg.unmapped_code_values == "keep" else None


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


def _format_codes(
    table: pa.Table, cfg: DataConfig, where: str, domain: dict[str, list[str]] | None = None
) -> tuple[list[str], list[str], list[str] | None, list[int]]:
    """Validate columns and rows; return (control_codes, texts, users or None, dropped rows)."""
    wanted = [*cfg.text_columns, *cfg.code_columns] + ([cfg.user_column] if cfg.user_column else [])
    missing = [c for c in wanted if c not in table.column_names]
    if missing:
        raise DataError(
            f"{where}: column(s) {missing} not found; the file has {table.column_names}. "
            "Set data.text_column / data.code_columns / data.user_column to existing columns."
        )
    if table.num_rows == 0:
        raise DataError(f"{where}: the file has no records (a header or schema only); point it at a file with rows")
    if problems := [p for c in wanted if (p := column_type_problem(c, table.schema.field(c).type, where))]:
        raise DataError("; ".join(problems))
    texts, nul_columns = _joined_texts(table, cfg)
    one = len(cfg.text_columns) == 1
    text_name = f"column {cfg.text_columns[0]!r}" if one else f"columns {cfg.text_columns}"  # for messages
    columns = {c: pc.cast(table[c], pa.string()).to_pylist() for c in cfg.code_columns}
    users = pc.cast(table[cfg.user_column], pa.string()).to_pylist() if cfg.user_column else None
    allowed = {c: set(v) for c, v in (domain or {}).items()}
    codes_out, texts_out, users_out, dropped, problems = [], [], [], [], []
    dropped_for_text = 0
    for i, text in enumerate(texts):
        row = i + 1  # 1-based data row, header excluded
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
            dropped.append(row)
            dropped_for_text += text is None or not text.strip()
            continue
        if empty or invalid:
            problems.extend(empty + invalid)
            continue
        codes_out.append(CODE_JOINER.join(parts))
        texts_out.append(text)
        if users is not None:
            users_out.append(users[i].strip())
    if problems:
        shown = "\n  - ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DataError(
            f"{where}: {len(problems)} unusable record(s):\n  - {shown}{more}\n"
            "Fix or remove these rows, or set data.drop_empty=true to drop empty ones "
            "(they are counted in the data manifest)."
        )
    if not texts_out:  # every row dropped (data.drop_empty): say so, not "only 0 training records"
        what = (f"empty text in column {cfg.text_column!r}" if dropped_for_text == len(dropped)
                else "an empty text, control code or user")
        raise DataError(
            f"{where}: all {len(dropped)} rows have {what}, so data.drop_empty=true left no record; "
            "check that data.text_column / data.code_columns / data.user_column name the right columns"
        )
    _warn_copies(where, codes_out, texts_out, users_out if users is not None else None)
    return codes_out, texts_out, (users_out if users is not None else None), dropped


def _warn_copies(where: str, codes: list[str], texts: list[str], users: list[str] | None) -> None:
    """Say how many records repeat another unit's record exactly: DP protects each unit (record,
    or user with data.user_column), so a text that n units hold is protected only as a group of n.
    Counts only, never which records."""
    if users is None:
        n_copies = len(texts) - len(set(zip(codes, texts)))
        unit, fix = "at record level each copy is a separate unit", "deduplicate the file, or set data.user_column"
    else:  # one user's repeats are one unit already: count the copies held by other users
        n_copies = len(set(zip(users, codes, texts))) - len(set(zip(codes, texts)))
        unit, fix = "each user is a unit", "deduplicate the file across users (e.g. drop retweets)"
    if n_copies > 0:
        log.warning("%s: %d record(s) repeat %s record exactly (same codes and text); %s, so a repeated "
                    "text is protected only as a group of its copies: %s", where, n_copies,
                    "an earlier" if users is None else "another user's", unit, fix)


def _write_split(path: Path, codes: list[str], texts: list[str], users: list[str] | None) -> None:
    """Write one private split, readable by its owner only (0600) whatever the umask."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # O_EXCL below: never write through a file someone left there
    columns = {"control_code": codes, "text": texts} | ({"user": users} if users is not None else {})
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        # Row groups of 64k records: a reader streaming the split (pipeline/tokenized.py)
        # decodes one group at a time, not the whole text column (pyarrow's default is 1M rows).
        pq.write_table(pa.table(columns), f, row_group_size=ROW_GROUP)
    tmp.replace(path)


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
    same data rewrites identical files (the split depends on the seed alone), so the stages
    after it stay cached."""
    deleted = []
    for path in (result.train, result.validation, result.test):
        if Path(path).is_file():
            Path(path).unlink()
            deleted.append(Path(path))
    tokenized = Path(result.train).parent / TOKENIZED_DIR
    if tokenized.is_dir():
        shutil.rmtree(tokenized)
        deleted.append(tokenized)
    return deleted


def read_split(path: Path) -> tuple[list[str], list[str]]:
    table = pq.read_table(path, columns=["control_code", "text"])
    return table["control_code"].to_pylist(), table["text"].to_pylist()


def read_users(path: Path) -> list[str] | None:
    """The split's user of each record, or None for a record-level dataset."""
    names = pq.read_schema(path).names
    return pq.read_table(path, columns=["user"])["user"].to_pylist() if "user" in names else None


def read_control_codes(path: Path) -> dict[str, float]:
    return json.loads(Path(path).read_text())["counts"]


def _split_units(units: list[str], n_out: int, rng: np.random.Generator) -> tuple[set[str], set[str]]:
    """Randomly split the distinct units (users, or records) into n_out held out and the rest."""
    distinct = sorted(set(units))
    order = rng.permutation(len(distinct))
    out = {distinct[i] for i in order[:n_out]}
    return out, set(distinct) - out


@dataclass(frozen=True)
class _Split:
    """The records and which of them go to each split (indices into codes/texts/users)."""

    codes: list[str]
    texts: list[str]
    users: list[str] | None
    train_idx: list[int]
    val_idx: list[int]
    test: tuple[list[str], list[str], list[str] | None]  # codes, texts, users of the test split
    dropped: list[int]
    test_dropped: list[int]
    train_units: set[str]


def _split(cfg: DataConfig, seed: int, code_domain: dict[str, list[str]] | None) -> _Split:
    """Read, validate and split, writing nothing (prepare_data writes; planned_split counts)."""
    table = read_table(cfg.path)
    if cfg.max_records:
        table = table.slice(0, cfg.max_records)
    codes, texts, users, dropped = _format_codes(table, cfg, f"data.path {str(cfg.path)!r}", code_domain)
    units = users if users is not None else [str(i) for i in range(len(texts))]

    rng = np.random.default_rng(seed)
    test_dropped: list[int] = []
    if cfg.test_path is None:
        n_test = max(1, int(round(cfg.test_fraction * len(set(units)))))
        test_units, rest = _split_units(units, n_test, rng)
        test_idx = [i for i, u in enumerate(units) if u in test_units]
        test_codes, test_texts = [codes[i] for i in test_idx], [texts[i] for i in test_idx]
        test_users = [users[i] for i in test_idx] if users is not None else None
    else:
        test_table = read_table(cfg.test_path)
        if cfg.max_test_records:
            test_table = test_table.slice(0, cfg.max_test_records)
        test_codes, test_texts, test_users, test_dropped = _format_codes(
            test_table, cfg, f"data.test_path {str(cfg.test_path)!r}", code_domain
        )
        rest = set(units)
    rest_units = [u for u in units if u in rest]
    n_val = int(round(cfg.validation_fraction * len(set(rest_units))))
    val_units, train_units = _split_units(rest_units, n_val, rng)
    if len(set(train_units)) < 2:
        raise DataError(
            f"only {len(set(train_units))} training {'user' if users is not None else 'record'}(s) "
            "after the split; DP-SGD needs many: use a larger data.path or lower "
            "data.validation_fraction / data.test_fraction"
        )
    return _Split(
        codes=codes, texts=texts, users=users,
        train_idx=[i for i, u in enumerate(units) if u in train_units],
        val_idx=[i for i, u in enumerate(units) if u in val_units],
        test=(test_codes, test_texts, test_users), dropped=dropped, test_dropped=test_dropped,
        train_units=train_units,
    )


@dataclass(frozen=True)
class PlannedSplit:
    """The data stage's split as `dpdistill plan` needs it, written nowhere."""

    n: int
    """Privacy units the teacher's DP-SGD samples from."""
    unit: str
    """'record' or 'user'."""
    n_validation: int
    test_codes: list[str]
    test_texts: list[str]
    """Held out and never trained on; the plan times evaluation by their token count only, a
    figure the run publishes anyway (metrics.json's perplexity `tokens`)."""


def planned_split(cfg: DataConfig, seed: int, code_domain: dict[str, list[str]] | None = None) -> PlannedSplit:
    """The split the data stage will make, read and validated the same way, writing nothing."""
    split = _split(cfg, seed, code_domain)
    unit = "record" if split.users is None else "user"
    n = len(split.train_units) if split.users is not None else len(split.train_idx)
    return PlannedSplit(n=n, unit=unit, n_validation=len(split.val_idx), test_codes=split.test[0],
                        test_texts=split.test[1])


def training_records(
    cfg: DataConfig, seed: int, code_domain: dict[str, list[str]] | None = None
) -> tuple[list[str], list[str]]:
    """(control codes, texts) of the training split as the data stage will write it, writing
    nothing: what `dpdistill plan` finds the privacy budget of (pipeline/privacy/budget.py)."""
    split = _split(cfg, seed, code_domain)
    return [split.codes[i] for i in split.train_idx], [split.texts[i] for i in split.train_idx]


def prepare_data(
    cfg: DataConfig, out_dir: Path, seed: int, code_domain: dict[str, list[str]] | None = None
) -> DataResult:
    """Read, validate, split and write the private splits (train / validation / test).

    With `data.user_column`, splits are made by user, so that no author has records on both
    sides of a split (the test perplexity would otherwise flatter the models).
    """
    out_dir = Path(out_dir)
    split = _split(cfg, seed, code_domain)
    codes, texts, users = split.codes, split.texts, split.users
    train_idx, val_idx, dropped, test_dropped = split.train_idx, split.val_idx, split.dropped, split.test_dropped
    test_codes, test_texts, test_users = split.test
    train_units = split.train_units
    train_codes = [codes[i] for i in train_idx]
    result = DataResult(
        train=out_dir / "train.parquet",
        validation=out_dir / "validation.parquet",
        test=out_dir / "test.parquet",
        n_train=len(train_idx),
        n_validation=len(val_idx),
        n_test=len(test_texts),
        n_dropped=len(dropped) + len(test_dropped),
    )
    pick = lambda idx: [users[i] for i in idx] if users is not None else None  # noqa: E731
    _write_split(result.train, train_codes, [texts[i] for i in train_idx], pick(train_idx))
    _write_split(result.validation, [codes[i] for i in val_idx], [texts[i] for i in val_idx], pick(val_idx))
    _write_split(result.test, test_codes, test_texts, test_users)
    inputs = {"data": cfg.path} | ({"test_data": cfg.test_path} if cfg.test_path else {})
    write_manifest(
        out_dir,
        stage="data",
        inputs=inputs,
        outputs={
            "train": result.train,
            "validation": result.validation,
            "test": result.test,
        },
        extra={
            "n_train": result.n_train,
            "n_validation": result.n_validation,
            "n_test": result.n_test,
            "n_dropped": result.n_dropped,
            "n_train_users": len(set(train_units)) if users is not None else None,
            "dropped_rows": {"data.path": dropped, "data.test_path": test_dropped},
        },
    )
    log.info(
        "data: %d train, %d validation, %d test records, %d dropped",
        result.n_train, result.n_validation, result.n_test, result.n_dropped,
    )
    return result
