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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from pipeline.config import DataConfig
from pipeline.manifest import atomic_write_json, write_manifest

log = logging.getLogger(__name__)

SEPARATOR = "\n\n"
CODE_JOINER = "\t"
CODES_FILE = "control_codes.json"


class DataError(ValueError):
    """The private dataset cannot be used as configured; the message says where and how to fix."""


@dataclass(frozen=True)
class DataResult:
    train: Path
    validation: Path
    test: Path
    control_codes: Path
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
        # Arrow's message can quote a line of the file: keep only the kind of failure.
        raise DataError(
            f"could not parse {str(path)!r} as {suffix[1:]} ({type(e).__name__}); "
            "check the file's format and encoding"
        ) from None
    raise DataError(
        f"data file {str(path)!r} has unsupported type {suffix!r}; use .csv, .jsonl or .parquet"
    )


def _format_codes(table: pa.Table, cfg: DataConfig, where: str) -> tuple[list[str], list[str], list[int]]:
    """Validate columns and rows; return (control_codes, texts, dropped_row_numbers)."""
    missing = [c for c in [cfg.text_column, *cfg.code_columns] if c not in table.column_names]
    if missing:
        raise DataError(
            f"{where}: column(s) {missing} not found; the file has {table.column_names}. "
            "Set data.text_column / data.code_columns to existing columns."
        )
    texts = pc.cast(table[cfg.text_column], pa.string()).to_pylist()
    columns = {c: pc.cast(table[c], pa.string()).to_pylist() for c in cfg.code_columns}
    codes_out, texts_out, dropped, problems = [], [], [], []
    for i, text in enumerate(texts):
        row = i + 1  # 1-based data row, header excluded
        empty, invalid = [], []  # empty fields may be dropped on request; invalid ones never
        if text is None or not text.strip():
            empty.append(f"row {row}, column {cfg.text_column!r}: empty text")
        parts = []
        for c in cfg.code_columns:
            v = columns[c][i]
            if v is None or not v.strip():
                empty.append(f"row {row}, column {c!r}: empty control code")
            elif any(ch in v for ch in "\t\n\r"):
                invalid.append(f"row {row}, column {c!r}: control code contains a tab or newline")
            else:
                parts.append(cfg.code_template.format(column=c, value=v.strip()))
        if empty and not invalid and cfg.drop_empty:
            dropped.append(row)
            continue
        if empty or invalid:
            problems.extend(empty + invalid)
            continue
        codes_out.append(CODE_JOINER.join(parts))
        texts_out.append(text)
    if problems:
        shown = "\n  - ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DataError(
            f"{where}: {len(problems)} unusable record(s):\n  - {shown}{more}\n"
            "Fix or remove these rows, or set data.drop_empty=true to drop empty ones "
            "(they are counted in the data manifest)."
        )
    return codes_out, texts_out, dropped


def _write_split(path: Path, codes: list[str], texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.table({"control_code": codes, "text": texts}), tmp)
    tmp.replace(path)


def read_split(path: Path) -> tuple[list[str], list[str]]:
    table = pq.read_table(path, columns=["control_code", "text"])
    return table["control_code"].to_pylist(), table["text"].to_pylist()


def read_control_codes(path: Path) -> dict[str, int]:
    return json.loads(Path(path).read_text())["counts"]


def prepare_data(cfg: DataConfig, out_dir: Path, seed: int) -> DataResult:
    """Read, validate, split and write the private splits plus the control-code counts."""
    out_dir = Path(out_dir)
    table = read_table(cfg.path)
    if cfg.max_records:
        table = table.slice(0, cfg.max_records)
    codes, texts, dropped = _format_codes(table, cfg, f"data.path {str(cfg.path)!r}")

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))
    test_dropped: list[int] = []
    if cfg.test_path is None:
        n_test = max(1, int(round(cfg.test_fraction * len(texts))))
        test_idx, order = order[:n_test], order[n_test:]
        test_codes = [codes[i] for i in test_idx]
        test_texts = [texts[i] for i in test_idx]
    else:
        test_table = read_table(cfg.test_path)
        if cfg.max_test_records:
            test_table = test_table.slice(0, cfg.max_test_records)
        test_codes, test_texts, test_dropped = _format_codes(
            test_table, cfg, f"data.test_path {str(cfg.test_path)!r}"
        )
    n_val = int(round(cfg.validation_fraction * len(order)))
    val_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])
    if len(train_idx) < 2:
        raise DataError(
            f"only {len(train_idx)} training record(s) after the split; DP-SGD needs many "
            "records: use a larger data.path or lower data.validation_fraction / data.test_fraction"
        )

    train_codes = [codes[i] for i in train_idx]
    result = DataResult(
        train=out_dir / "train.parquet",
        validation=out_dir / "validation.parquet",
        test=out_dir / "test.parquet",
        control_codes=out_dir / CODES_FILE,
        n_train=len(train_idx),
        n_validation=len(val_idx),
        n_test=len(test_texts),
        n_dropped=len(dropped) + len(test_dropped),
    )
    _write_split(result.train, train_codes, [texts[i] for i in train_idx])
    _write_split(result.validation, [codes[i] for i in val_idx], [texts[i] for i in val_idx])
    _write_split(result.test, test_codes, test_texts)
    counts = Counter(train_codes)
    atomic_write_json(
        result.control_codes,
        {
            "columns": cfg.code_columns,
            "private": False,
            "note": "exact counts of the control codes in the private training split; "
            "NOT differentially private in this version",
            "counts": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        },
    )
    inputs = {"data": cfg.path} | ({"test_data": cfg.test_path} if cfg.test_path else {})
    write_manifest(
        out_dir,
        stage="data",
        inputs=inputs,
        outputs={
            "train": result.train,
            "validation": result.validation,
            "test": result.test,
            "control_codes": result.control_codes,
        },
        extra={
            "n_train": result.n_train,
            "n_validation": result.n_validation,
            "n_test": result.n_test,
            "n_dropped": result.n_dropped,
            "dropped_rows": {"data.path": dropped, "data.test_path": test_dropped},
        },
    )
    log.info(
        "data: %d train, %d validation, %d test records, %d dropped, %d distinct control codes",
        result.n_train, result.n_validation, result.n_test, result.n_dropped, len(counts),
    )
    return result
