"""Reading and splitting records: what the data stage, the teacher, the DP releases and the
audits all need, without any of them importing a stage.

A record is its prompt (pipeline/prompts.py: the control-code header `"\t".join(codes) + "\n\n"`,
or a prompt template's text) + text + eos. The prompt and the text are tokenized separately
(`encode_record`) so that training, generation prompts and evaluation all see the same token
boundary after the prompt.

Files in: .csv, .jsonl or .parquet, read whole (`read_table`, small files) or streamed in
Arrow batches (`read_batches`, `parquet_batches`); errors name the row and the column, never
the content. Files out of the data stage: the splits' Parquet (`read_split`, `read_users`),
the secret split key under the run root (`split_key`).
"""

from __future__ import annotations

import csv
import json
import os
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from pipeline.config import DataConfig
from pipeline.prompts import CODE_JOINER, HEADER, SEPARATOR, PromptFormat  # noqa: F401  (CODE_JOINER, SEPARATOR: re-exported)

ROW_GROUP = 16_384  # records per Parquet row group of a split, and per batch read from the input
SPLIT_KEY = ".split-key"  # under run_root: the secret that decides which units validate (0600)
TOKENIZED_DIR = "tokenized"  # the splits' token ids, next to them (pipeline/tokenized.py): private too


class DataError(ValueError):
    """The private dataset cannot be used as configured; the message says where and how to fix."""


def encode_record(tokenizer, control_code: str, text: str, max_length: int | None = None,
                  prompt: PromptFormat = HEADER) -> list[int]:
    """Token ids of prompt + text + eos; prompt and text tokenized apart (see module doc)."""
    ids = (
        prompt.ids(tokenizer, control_code)
        + tokenizer.encode(text, add_special_tokens=False)
        + [tokenizer.eos_token_id]
    )
    return ids[:max_length] if max_length else ids


def _source(path: Path) -> tuple[Path, str]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} not found; set data.path to an existing file")
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".jsonl", ".json", ".parquet"):
        raise DataError(f"data file {str(path)!r} has unsupported type {suffix!r}; use .csv, .jsonl or .parquet")
    return path, suffix


def _csv_options(path: Path) -> dict:
    # Every column as a string: control codes like "4.0" must not become floats.
    with open(path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return {"parse_options": pacsv.ParseOptions(newlines_in_values=True),
            "convert_options": pacsv.ConvertOptions(column_types={n: pa.string() for n in header},
                                                    strings_can_be_null=True)}


def _unreadable(path: Path, suffix: str, e: Exception) -> DataError:
    if suffix in (".jsonl", ".json") and (problems := jsonl_problems(path)):
        # Arrow's own message names a row of its block, not of the file, and often the wrong one.
        return DataError(f"{str(path)!r}: {'; '.join(problems)}")
    # Arrow's message can quote a line of the file: keep only the kind of failure.
    return DataError(f"could not parse {str(path)!r} as {suffix[1:]} ({type(e).__name__}); "
                     "check the file's format and encoding")


def read_table(path: Path) -> pa.Table:
    """The whole file as one table (small files: public monitor records, benchmarks)."""
    path, suffix = _source(path)
    try:
        if suffix == ".csv":
            return pacsv.read_csv(path, **_csv_options(path))
        if suffix in (".jsonl", ".json"):
            return pajson.read_json(path)
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as e:
        raise _unreadable(path, suffix, e) from None


@dataclass
class _Batches:
    """A file's schema and its rows streamed in batches (the first `max_records` only)."""

    path: Path
    suffix: str
    schema: pa.Schema
    reader: object
    max_records: int | None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        left = self.max_records
        try:
            for batch in self.reader:
                if left is not None:
                    batch = batch.slice(0, left)
                    left -= batch.num_rows
                if batch.num_rows:
                    yield batch
                if left == 0:
                    return
        except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as e:
            raise _unreadable(self.path, self.suffix, e) from None


def parquet_batches(path: Path, columns: list[str] | None = None, batch_size: int = ROW_GROUP):
    """A Parquet file's record batches, read a row group at a time. Not pyarrow's default
    pre-buffering: its read cache keeps every row group's bytes until the reader is gone, outside
    Arrow's pool (~40 bytes a record while a split is streamed: 120 MB more at 3 M records)."""
    return pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=batch_size, columns=columns)


def read_batches(path: Path, max_records: int | None = None) -> _Batches:
    """Stream a .csv, .jsonl or .parquet file in batches of about ROW_GROUP rows."""
    path, suffix = _source(path)
    try:
        if suffix == ".csv":
            reader = pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=4 << 20), **_csv_options(path))
            schema = reader.schema
        elif suffix in (".jsonl", ".json"):
            reader = pajson.open_json(path, read_options=pajson.ReadOptions(block_size=4 << 20))
            schema = reader.schema
        else:
            schema, reader = pq.read_schema(path), parquet_batches(path)
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as e:
        raise _unreadable(path, suffix, e) from None
    return _Batches(path, suffix, schema, reader, max_records)


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


def read_split(path: Path) -> tuple[list[str], list[str]]:
    table = pq.read_table(path, columns=["control_code", "text"])
    return table["control_code"].to_pylist(), table["text"].to_pylist()


def read_users(path: Path) -> list[str] | None:
    """The split's user of each record, or None for a record-level dataset."""
    names = pq.read_schema(path).names
    return pq.read_table(path, columns=["user"])["user"].to_pylist() if "user" in names else None


def read_control_codes(path: Path) -> dict[str, float]:
    return json.loads(Path(path).read_text())["counts"]


def split_key(run_root: Path, create: bool = True) -> bytes | None:
    """The secret that decides which units are held out for validation (and for test with
    data.test_split=keyed; 'fixed' draws test under a public salt, the same in every run root):
    32 random bytes in `<run_root>/.split-key` (0600), made by the first run under `run_root` and
    read by every later one, so that their splits agree (and their cached stages stay valid).
    Never published: the seed a run publishes does not tell which records train. None when
    absent and not `create`d."""
    path = Path(run_root) / SPLIT_KEY
    if not path.exists():
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".split-key-")  # 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic and never replaces: two first runs agree on one key
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    key = path.read_bytes()
    if len(key) != 32:
        raise DataError(f"{path} is damaged ({len(key)} bytes, not 32); delete it and every run under "
                        f"{path.parent} that you want to resume (a new key gives another split)")
    return key
