"""Numbers that may be token ids, wherever a file holds them (issue 62 item 1).

    for row in id_rows(array, min_ids): ...          # an integer (or integral float) array
    for row in number_runs(text, min_ids): ...       # '[464, 3290, ...]' or one id a line
    columns = csv_columns(text)                      # a CSV/TSV file's columns, or None

A record's token ids were found only as a list column or a JSON list of ints; stored as an
int64 `.npy`, a tensor in `torch.save`, a Parquet int column one id per row, a CSV column, JSON
floats or a printed tensor in a log, they passed as "binary tensors, not scanned" or as numbers
and the audit said clean. Every integer sequence long enough to hold a span (`min_ids`: a span
of n words takes at least n tokens) is handed to the caller as rows of ids, which the run's
tokenizer decodes (pipeline/audits/audit.py `TokenDecoder`, which splits a row where an id is
not one of its vocabulary). A float array is read as ids only when all its values are integers
(a weight matrix fails on its first values, read without the rest); a constant array is one
short row (its windows are all the same). Long arrays are cut into rows of `CHUNK` ids that
overlap by `OVERLAP`, so that a span across a cut is in one row.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator

import numpy as np

CHUNK = 1 << 16
OVERLAP = 1024  # ids a span may take (10 words of 100 bytes each, one byte a token)
_HEAD = 1024  # values of a float array checked before the rest is
_RUN = re.compile(r"-?\d+(?:\.0+)?(?:[\s,;\[\]()]+-?\d+(?:\.0+)?)+")
_NUMBER = re.compile(r"-?\d+")
_INT = re.compile(r"\s*-?\d+(?:\.0*)?\s*")
_DELIMITERS = ",\t;|"


def _integral(values: np.ndarray) -> bool:
    with np.errstate(invalid="ignore"):
        return bool(np.all(np.isfinite(values) & (values == np.floor(values)) & (np.abs(values) < 2**62)))


def is_ids(flat: np.ndarray, min_ids: int) -> bool:
    """Whether a flat numeric array may hold token ids: integers (or floats that all are), at
    least `min_ids` of them."""
    if flat.size < min_ids or flat.dtype.kind not in "iuf":
        return False
    if flat.dtype.kind == "f":
        if not _integral(np.asarray(flat[:_HEAD], dtype=np.float64)):
            return False
        return all(_integral(np.asarray(flat[i:i + CHUNK], dtype=np.float64)) for i in range(_HEAD, flat.size, CHUNK))
    return True


def id_rows(flat: np.ndarray, min_ids: int) -> Iterator[list[int]]:
    """Rows of ids of a flat array that `is_ids` admits, CHUNK long, overlapping by OVERLAP."""
    n = flat.size
    if n and flat[0] == flat[min(n - 1, _HEAD)] and bool(np.all(flat == flat[0])):
        n = min(n, 4 * max(min_ids, 1))  # a constant: every window alike
    for start in range(0, n, CHUNK):
        chunk = np.asarray(flat[max(0, start - OVERLAP):min(n, start + CHUNK)])
        yield chunk.astype(np.int64).tolist()


def number_runs(text: str, min_ids: int) -> Iterator[list[int]]:
    """Runs of at least `min_ids` integers in `text` separated by nothing but spaces, commas,
    semicolons and brackets: a printed tensor or list, one id a line (floats ending in .0 too)."""
    if sum(c.isdigit() for c in text[:4096]) < min_ids and len(text) <= 4096:
        return
    for m in _RUN.finditer(text):
        ids = [int(x) for x in _NUMBER.findall(re.sub(r"\.0+\b", "", m.group()))]
        if len(ids) >= min_ids:
            yield ids


def csv_columns(text: str) -> list[list[str]] | None:
    """The columns of `text` read as CSV (or TSV, ';' or '|' separated: the delimiter that
    splits every line alike into two or more fields), or None when it is not such a table."""
    lines = text.splitlines()
    if len(lines) < 2:
        return None
    for delimiter in _DELIMITERS:
        if delimiter not in lines[0]:
            continue
        try:
            rows = [r for r in csv.reader(io.StringIO(text), delimiter=delimiter) if r]
        except csv.Error:
            continue
        width = len(rows[0])
        if width >= 2 and sum(len(r) == width for r in rows) >= 0.9 * len(rows):
            return [[r[i] for r in rows if len(r) == width] for i in range(width)]
    return None


def integer_cells(cells: list[str], min_ids: int) -> list[int] | None:
    """A column's cells as ids when they are integers (a header first is allowed), else None."""
    body = cells[1:] if cells and not _INT.fullmatch(cells[0]) else cells
    if len(body) < min_ids or not all(_INT.fullmatch(c) for c in body):
        return None
    return [int(float(c)) for c in body]
