"""The data stage's split rule: which units are test, which validate, which train.

    sizes = split_sizes(cfg, formatted, n, users)      # from the formatted file's hashes
    draw = sizes.test_draw()                           # one per pass over the file, in its order
    side = sizes.side(units, draw(test_hashes))        # a batch's records: 0 test, 1 validation, 2 train

Every record carries its unit's hash under the run root's secret split key (`unit`: the unit is
the user, or the record's data row) and its hash for the test draw (`hashes_for_test`). Test is
the units of lowest hash under a public salt (`data.test_split=fixed`, issue 60: the same records
in every run and checkout) or of lowest keyed hash (`keyed`); validation the units of lowest
keyed hash among the rest. Each draw is uniformly random, as a permutation would give, with its
exact sizes; which units train and which validate is the same on every run under one run root
(one key) and is not told by anything a run publishes (the seed is not used). One array of 8
bytes a record at a time, never a text. pipeline/stages/data.py formats the records and writes
the splits by this rule.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import DataConfig
from pipeline.records import DataError, parquet_batches

# data.test_split=fixed hashes the units under this public salt, not the secret key, so that every run
# root and checkout holds out the same test records (issue 60); a new salt would be a new test split.
TEST_SPLIT_SALT = b"dpdistill/test-split/v1"


def digest(*parts: str, key: bytes = b"") -> int:
    """An 8-byte BLAKE2b of `parts` (each ended by NUL), under `key`: a unit's keyed hash, the
    public test hash, and the hashes that count exact copies."""
    h = hashlib.blake2b(digest_size=8, key=key)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return int.from_bytes(h.digest(), "little")


def read_hash_column(path: Path, name: str, n: int) -> np.ndarray:
    """One uint64 column of a formatted file, read batch by batch into one array (no second copy)."""
    out, i = np.empty(n, np.uint64), 0
    for batch in parquet_batches(path, columns=[name]):
        out[i:i + batch.num_rows] = batch.column(0).to_numpy()
        i += batch.num_rows
    return out


def hashes_for_test(cfg: DataConfig, codes: list[str], texts: list[str], users: list[str] | None,
                    unit: np.ndarray) -> np.ndarray:
    """Each record's hash for the test draw. 'keyed': its unit's keyed hash (`unit`). 'fixed': under
    the public TEST_SPLIT_SALT, of its user, or at record level of the record itself (codes and
    text), not of its row: removing one row renumbers every later one, so a public hash of rows
    would move many other records in or out of test (and training) between neighbouring files."""
    n = len(texts)
    if cfg.test_split == "keyed":
        return unit
    if users is not None:
        return np.fromiter((digest(u, key=TEST_SPLIT_SALT) for u in users), np.uint64, n)
    return np.fromiter((digest(c, t, key=TEST_SPLIT_SALT) for c, t in zip(codes, texts)), np.uint64, n)


class _TestDraw:
    """Which records are test, batch by batch in file order: those of test hash below `test_max`, and
    of those at `test_max` the first `n_tied` (None: all, one user's records). At record level the
    tie is exact copies of one record: taking the first keeps the sizes exact, and removing any
    other record leaves the order (hash, then file order) of the rest as it was."""

    def __init__(self, test_max: np.uint64 | None, n_tied: int | None):
        self.test_max, self.left = test_max, n_tied

    def __call__(self, hashes: np.ndarray) -> np.ndarray:
        if self.test_max is None:  # data.test_path: no unit of this file is test
            return np.zeros(len(hashes), bool)
        test = hashes < self.test_max
        tied = np.flatnonzero(hashes == self.test_max)
        if self.left is not None:
            tied = tied[:self.left]
            self.left -= len(tied)
        test[tied] = True
        return test


@dataclass(frozen=True)
class SplitSizes:
    """Held-out units: the `n_test` units of lowest test hash (`unit_test`), then, of the others,
    the `n_validation` of lowest keyed hash (`unit`). With test hash = keyed hash
    (data.test_split=keyed) that is the `n_test` lowest keyed hashes, then the next `n_validation`."""

    test_max: np.uint64 | None  # the largest test hash in test (None: no test units, data.test_path)
    n_tied: int | None  # of the records at test_max, how many are test (None: all)
    ranked: np.ndarray  # the keyed hashes of the distinct units not in test, ascending
    n_test: int
    n_validation: int

    def test_draw(self) -> _TestDraw:
        """A fresh draw for one pass over the formatted file, in its order."""
        return _TestDraw(self.test_max, self.n_tied)

    def side(self, units: np.ndarray, test: np.ndarray) -> np.ndarray:
        """0 test, 1 validation, 2 train for each record's keyed hash and test draw."""
        rank = np.searchsorted(self.ranked, units)  # a test unit's rank means nothing: overruled by `test`
        return np.where(test, 0, np.where(rank < self.n_validation, 1, 2))

    @property
    def n_train(self) -> int:
        return len(self.ranked) - self.n_validation


def _ranked(hashes: np.ndarray, users: bool) -> np.ndarray:
    """The distinct units' hashes, ascending (`hashes` is sorted in place: no copy of 8 bytes a
    record when every record is its own unit)."""
    hashes.sort()
    return np.unique(hashes) if users else hashes


def _read_units(path: Path, n: int, draw: _TestDraw) -> np.ndarray:
    """The keyed hashes of a formatted file's records not in test, read batch by batch into one
    array (a view of its first part: no second copy)."""
    out, i = np.empty(n, np.uint64), 0
    for batch in parquet_batches(path, columns=["unit", "unit_test"]):
        units = batch.column(0).to_numpy()[~draw(batch.column(1).to_numpy())]
        out[i:i + len(units)] = units
        i += len(units)
    return out[:i]


def split_sizes(cfg: DataConfig, formatted: Path, n: int, users: bool) -> SplitSizes:
    """The split's sizes over the distinct units of the formatted file `formatted` (`n` records);
    one array of 8 bytes a record at a time, as each ranking is made."""
    test_max, n_tied, n_test = None, None, 0
    if cfg.test_path is None:
        tests = _ranked(read_hash_column(formatted, "unit_test", n), users)
        n_test = max(1, int(round(cfg.test_fraction * len(tests))))
        test_max = tests[n_test - 1]
        if not users:  # records are ranked with their copies: the first n_test of them, not every copy
            n_tied = n_test - int(np.searchsorted(tests, test_max))
        del tests  # before the second ranking: never two arrays of 8 bytes a record
    draw = _TestDraw(test_max, n_tied)
    ranked = _ranked(_read_units(formatted, n, draw), users)  # the units left: all but the n_test
    n_val = int(round(cfg.validation_fraction * len(ranked)))
    sizes = SplitSizes(test_max, n_tied, ranked, n_test, n_val)
    if sizes.n_train < 2:
        raise DataError(
            f"only {max(0, sizes.n_train)} training {'user' if users else 'record'}(s) "
            "after the split; DP-SGD needs many: use a larger data.path or lower "
            "data.validation_fraction / data.test_fraction"
        )
    return sizes
