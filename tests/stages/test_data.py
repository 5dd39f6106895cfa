"""Stage 0: reading, validating, splitting the private data; errors never quote records."""

from __future__ import annotations

import csv
import hashlib
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import YELP_TEST, YELP_TRAIN
from pipeline.privacy.control_codes import domain_codes
from pipeline.config import ConfigError, DataConfig, config_from_dict
from pipeline.stages import data as data_stage
from pipeline.stages import data_split
from pipeline.prompts import header
from pipeline.records import (SPLIT_KEY, DataError, encode_record, read_split, read_table, read_users,
                              split_key)
from pipeline.stages.data import planned_split, prepare_data

CODE_RE = re.compile(r"^Business Category: [^\t\n]+\tReview Stars: [^\t\n]+$")


def _write_csv(path, rows, header=("text", "label1", "label2")):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def _sentinel_rows(n=10):
    """Rows with distinctive texts, so tests can check that no record leaks into messages."""
    names = ["ALPHA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT", "GOLF", "HOTEL", "INDIA", "JULIET"]
    return [[f"SECRET-RECORD-{names[i]} was here", f"cat{i % 2}", f"stars{i % 3}"] for i in range(n)]


def test_prepare_data_on_yelp_sample(tmp_path):
    """prepare_data writes the splits and the manifest; counts add up."""
    cfg = DataConfig(path=YELP_TRAIN, test_path=YELP_TEST, max_records=200, max_test_records=50)
    out = tmp_path / "data"
    res = prepare_data(cfg, out)

    for name in ("train.parquet", "validation.parquet", "test.parquet", "manifest.json"):
        assert (out / name).is_file(), name
    assert res.n_train + res.n_validation == 200
    assert res.n_validation == 10  # round(0.05 * 200)
    assert res.n_test == 50
    assert res.n_dropped == 0

    train_codes, train_texts = read_split(res.train)
    val_codes, _ = read_split(res.validation)
    test_codes, _ = read_split(res.test)
    assert len(train_codes) == len(train_texts) == res.n_train
    assert len(val_codes) == res.n_validation and len(test_codes) == 50
    for code in train_codes + val_codes + test_codes:
        assert CODE_RE.match(code), code

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "data"
    assert manifest["n_train"] == res.n_train and manifest["n_validation"] == res.n_validation


def test_encode_record_is_prefix_then_text_then_eos(tiny_tokenizer):
    """encode_record = tokenize(codes + '\\n\\n') + tokenize(text) + [eos]."""
    code, text = "Business Category: Bars\tReview Stars: 4.0", "Great beer, slow service."
    assert header(code) == code + "\n\n"
    expected = (
        tiny_tokenizer.encode(code + "\n\n", add_special_tokens=False)
        + tiny_tokenizer.encode(text, add_special_tokens=False)
        + [tiny_tokenizer.eos_token_id]
    )
    ids = encode_record(tiny_tokenizer, code, text)
    assert ids == expected
    assert ids[-1] == tiny_tokenizer.eos_token_id
    assert encode_record(tiny_tokenizer, code, text, max_length=5) == expected[:5]


def test_empty_text_and_missing_code_are_reported_without_content(tmp_path):
    """Empty text (row 3) and missing code (row 5) raise DataError naming rows/columns, quoting no record."""
    rows = _sentinel_rows()
    rows[2][0] = ""  # row 3: empty text
    rows[4][2] = ""  # row 5: missing control code in label2
    path = _write_csv(tmp_path / "bad.csv", rows)
    cfg = DataConfig(path=path)
    with pytest.raises(DataError) as err:
        prepare_data(cfg, tmp_path / "out")
    msg = str(err.value)
    assert "row 3" in msg and "'text'" in msg
    assert "row 5" in msg and "'label2'" in msg
    assert "data.drop_empty" in msg
    for row in rows:
        assert row[0] == "" or row[0] not in msg
    assert "SECRET-RECORD" not in msg
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_drop_empty_drops_and_counts_rows(tmp_path):
    """With drop_empty=True, the empty rows are dropped, counted and listed in the manifest."""
    rows = _sentinel_rows()
    rows[2][0] = "   "  # row 3: whitespace-only text
    rows[4][2] = ""  # row 5: missing control code
    path = _write_csv(tmp_path / "bad.csv", rows)
    res = prepare_data(DataConfig(path=path, drop_empty=True), tmp_path / "out")
    assert res.n_dropped == 2
    assert res.n_train + res.n_validation + res.n_test == len(rows) - 2
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["n_dropped"] == 2
    assert manifest["dropped_rows"] == {"data.path": [3, 5], "data.test_path": []}
    kept = []
    for split in (res.train, res.validation, res.test):
        kept += read_split(split)[1]
    assert sorted(kept) == sorted(r[0] for i, r in enumerate(rows) if i not in (2, 4))


def test_drop_empty_never_drops_an_invalid_code(tmp_path):
    """A tab inside a code is an error even with drop_empty, whatever the column is called."""
    rows = [[r[0], r[1]] for r in _sentinel_rows()]
    rows[2][1] = "a\tb"
    path = tmp_path / "d.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["text", "nonempty_tag"], *rows])
    with pytest.raises(DataError, match="row 3, column 'nonempty_tag': control code contains a tab"):
        prepare_data(DataConfig(path=path, code_columns=["nonempty_tag"], drop_empty=True), tmp_path / "o")


def test_missing_column_is_named_with_available_ones(tmp_path):
    """A missing code column raises DataError naming it and listing the file's columns."""
    path = _write_csv(tmp_path / "d.csv", _sentinel_rows())
    with pytest.raises(DataError) as err:
        prepare_data(DataConfig(path=path, code_columns=["label1", "stars"]), tmp_path / "out")
    msg = str(err.value)
    assert "'stars'" in msg
    for col in ("text", "label1", "label2"):
        assert col in msg
    assert "SECRET-RECORD" not in msg


def test_unsupported_extension_is_refused(tmp_path):
    """A .txt data file raises DataError naming the suffix."""
    path = tmp_path / "data.txt"
    path.write_text("text,label1,label2\nhello,a,b\n")
    with pytest.raises(DataError, match=r"\.txt"):
        read_table(path)
    with pytest.raises(DataError, match=r"\.txt"):
        prepare_data(DataConfig(path=path), tmp_path / "out")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_jsonl_and_parquet_inputs(tmp_path, fmt):
    """JSONL and Parquet files are read and prepared like a CSV."""
    rows = _sentinel_rows()
    records = [{"text": t, "label1": a, "label2": b} for t, a, b in rows]
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    table = read_table(path)
    assert table.num_rows == len(rows)
    assert table["text"].to_pylist() == [r[0] for r in rows]

    cfg = DataConfig(path=path, code_template="{column}={value}")
    res = prepare_data(cfg, tmp_path / "out")
    assert res.n_train + res.n_validation + res.n_test == len(rows)
    codes, _ = read_split(res.train)
    assert all(re.fullmatch(r"label1=cat[01]\tlabel2=stars[012]", c) for c in codes), codes


def test_csv_codes_stay_strings(tmp_path):
    """The CSV reader keeps codes as written: '4.0' stays the string '4.0'."""
    rows = [[f"review number {i}", "Bars", "4.0" if i % 2 else "05"] for i in range(10)]
    path = _write_csv(tmp_path / "d.csv", rows)
    table = read_table(path)
    assert table.schema.field("label2").type == pa.string()
    assert table["label2"].to_pylist()[:2] == ["05", "4.0"]

    res = prepare_data(DataConfig(path=path, code_template="{column}: {value}"), tmp_path / "out")
    codes = read_split(res.train)[0] + read_split(res.validation)[0] + read_split(res.test)[0]
    assert set(codes) == {"label1: Bars\tlabel2: 4.0", "label1: Bars\tlabel2: 05"}


def test_nul_bytes_are_refused_and_duplicates_counted_without_content(tmp_path, caplog):
    """A NUL byte in a text stops the data stage naming row and column; exact duplicate records
    are accepted with a warning that gives their count only (they weaken record-level DP)."""
    rows = _sentinel_rows()
    rows[3][0] = "SECRET-RECORD-NUL\0here"  # row 4
    with pytest.raises(DataError) as err:
        prepare_data(DataConfig(path=_write_csv(tmp_path / "nul.csv", rows)), tmp_path / "a")
    assert "row 4, column 'text': text contains a NUL byte" in str(err.value)
    assert "SECRET-RECORD" not in str(err.value)

    rows = _sentinel_rows() + [_sentinel_rows()[1]] * 3  # three more copies of row 2
    with caplog.at_level("WARNING", logger="pipeline.stages.data"):
        prepare_data(DataConfig(path=_write_csv(tmp_path / "dup.csv", rows)), tmp_path / "b")
    warned = [r.getMessage() for r in caplog.records if "repeat an earlier record" in r.getMessage()]
    assert len(warned) == 1 and ": 3 record(s) repeat" in warned[0] and "SECRET-RECORD" not in warned[0]


def test_at_user_level_only_copies_held_by_other_users_are_counted(tmp_path, caplog):
    """A user who posts the same text twice is one unit; the same text from two other users
    (a retweet) is protected only as a group of them, and the warning says so, with no
    advice to set data.user_column, which is set."""
    rows = [[*r, f"user{i}"] for i, r in enumerate(_sentinel_rows())]
    rows += [[*rows[1][:3], "user1"], [*rows[1][:3], "user7"], [*rows[1][:3], "user8"]]
    cfg = DataConfig(path=_write_csv(tmp_path / "users.csv", rows, ("text", "label1", "label2", "user")),
                     user_column="user")
    with caplog.at_level("WARNING", logger="pipeline.stages.data"):
        prepare_data(cfg, tmp_path / "out")
    warned = [r.getMessage() for r in caplog.records if "repeat" in r.getMessage()]
    assert len(warned) == 1 and ": 2 record(s) repeat another user's record" in warned[0]
    assert "set data.user_column" not in warned[0] and "SECRET-RECORD" not in warned[0]


def test_jsonl_value_of_another_kind_is_named_by_row_and_column(tmp_path):
    """A number or a list in one row's text of a valid JSONL file names that row and column
    (Arrow's own message names a row of its block, here the wrong one), never the content."""
    rows = [{"text": f"SECRET-RECORD {i}", "label1": "a", "label2": "b"} for i in range(8)]
    rows[0]["text"] = 4242  # row 1: Arrow would blame row 2
    rows[5]["text"] = ["SECRET-RECORD", "list"]  # row 6
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as err:
        prepare_data(DataConfig(path=path), tmp_path / "out")
    msg = str(err.value)
    assert "row 1, column 'text': a number where the other rows have a string" in msg
    assert "row 6, column 'text': a list" in msg
    assert "SECRET-RECORD" not in msg and "4242" not in msg


def test_drop_empty_dropping_every_row_says_so(tmp_path):
    """data.drop_empty=true on a file whose texts are all empty: 'all N rows', not 'only 0 records'."""
    path = _write_csv(tmp_path / "d.csv", [["", f"cat{i}", "stars"] for i in range(7)])
    with pytest.raises(DataError, match=r"all 7 rows have empty text in column 'text'"):
        prepare_data(DataConfig(path=path, drop_empty=True), tmp_path / "out")


def test_list_typed_parquet_column_is_named(tmp_path):
    """A list column gives a DataError naming it, not Arrow's ArrowNotImplementedError."""
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"r{i}" for i in range(5)], "label1": [["a"]] * 5, "label2": ["b"] * 5}), path)
    with pytest.raises(DataError, match=r"column 'label1' holds list"):
        prepare_data(DataConfig(path=path), tmp_path / "out")


# ---------------------------------------------------------------- shaping records in the config

NEWS_NAMES = {"1": "World", "2": "Sports", "3": "Business", "4": "Sci/Tech"}


def _news(tmp_path, n=20, label=lambda i: str(i % 4 + 1)):
    """An AG News-like file: title and description columns, a numeric class label."""
    rows = [[f"SECRET-TITLE-{i}", f"SECRET-BODY-{i} happened", label(i)] for i in range(n)]
    return _write_csv(tmp_path / "news.csv", rows, header=("title", "description", "label"))


def test_several_text_columns_are_joined_with_the_separator(tmp_path):
    path = _news(tmp_path)
    cfg = DataConfig(path=path, text_column=["title", "description"], text_separator=" // ",
                     code_columns=["label"], validation_fraction=0.0)
    res = prepare_data(cfg, tmp_path / "out")
    texts = read_split(res.train)[1] + read_split(res.test)[1]
    assert sorted(texts) == sorted(f"SECRET-TITLE-{i} // SECRET-BODY-{i} happened" for i in range(20))
    assert DataConfig(path=path).text_separator == "\n" and DataConfig(path=path).text_columns == ["text"]


def test_an_empty_text_part_is_left_out_and_all_parts_empty_is_an_empty_text(tmp_path):
    rows = [[f"SECRET-TITLE-{i}", f"SECRET-BODY-{i}", "1"] for i in range(20)]
    rows[3][0] = ""  # no title: the description alone
    rows[7][0] = rows[7][1] = " "  # nothing: an empty record
    path = _write_csv(tmp_path / "news.csv", rows, header=("title", "description", "label"))
    cfg = DataConfig(path=path, text_column=["title", "description"], code_columns=["label"])
    with pytest.raises(DataError) as err:
        prepare_data(cfg, tmp_path / "out")
    assert "row 8, columns ['title', 'description']: empty text" in str(err.value)
    assert "1 unusable record" in str(err.value) and "SECRET" not in str(err.value)
    res = prepare_data(cfg.model_copy(update={"drop_empty": True, "validation_fraction": 0.0}), tmp_path / "o2")
    texts = read_split(res.train)[1] + read_split(res.test)[1]
    assert "SECRET-BODY-3" in texts and res.n_dropped == 1


def test_code_values_name_the_codes_and_the_domain_holds_the_names(tmp_path):
    """YAML reads `{1: World}` with a number: it still matches the file's "1"."""
    yaml_names = {int(k): v for k, v in NEWS_NAMES.items()}
    tree = {"data": {"path": str(_news(tmp_path)), "text_column": ["title", "description"], "code_columns": ["label"],
                     "code_template": "Topic: {value}", "code_values": {"label": yaml_names}},
            "control_codes": {"domain": {"label": list(NEWS_NAMES.values())}}}
    cfg = config_from_dict(tree)
    res = prepare_data(cfg.data, tmp_path / "out", code_domain=cfg.control_codes.domain)
    codes = read_split(res.train)[0] + read_split(res.test)[0]
    assert set(codes) == {f"Topic: {name}" for name in NEWS_NAMES.values()}
    assert domain_codes(cfg.data, cfg.control_codes.domain) == [f"Topic: {n}" for n in NEWS_NAMES.values()]


def test_a_value_missing_from_code_values_names_row_column_and_fix(tmp_path):
    path = _news(tmp_path, label=lambda i: "5" if i == 6 else str(i % 4 + 1))
    cfg = DataConfig(path=path, text_column=["title", "description"], code_columns=["label"],
                     code_values={"label": NEWS_NAMES})
    with pytest.raises(DataError) as err:
        prepare_data(cfg, tmp_path / "out")
    msg = str(err.value)
    assert "row 7, column 'label': value not in data.code_values['label']" in msg
    assert "data.unmapped_code_values=keep" in msg and "SECRET" not in msg and "'5'" not in msg
    kept = prepare_data(cfg.model_copy(update={"unmapped_code_values": "keep"}), tmp_path / "o2")
    assert "5" in read_split(kept.train)[0] + read_split(kept.test)[0] + read_split(kept.validation)[0]


def test_config_refuses_code_values_that_cannot_agree_with_the_domain(tmp_path):
    data = {"path": str(tmp_path / "news.csv"), "code_columns": ["label"], "code_values": {"label": NEWS_NAMES}}
    with pytest.raises(ConfigError, match=r"control_codes.domain\['label'\] lists \['1', '2'\].*mapped names"):
        config_from_dict({"data": data, "control_codes": {"domain": {"label": ["1", "2"]}}})
    keep = data | {"unmapped_code_values": "keep"}  # raw values may then occur too
    assert config_from_dict({"data": keep, "control_codes": {"domain": {"label": ["1", "World"]}}})
    with pytest.raises(ConfigError, match=r"code_values names \['topic'\], which are not code columns"):
        config_from_dict({"data": data | {"code_values": {"topic": NEWS_NAMES}},
                          "control_codes": {"mechanism": "exact"}})
    with pytest.raises(ConfigError, match=r"names \['Sci\\tTech'\] that are empty or hold a tab"):
        config_from_dict({"data": data | {"code_values": {"label": {"4": "Sci\tTech"}}},
                          "control_codes": {"mechanism": "exact"}})


def test_the_split_is_the_run_root_s_not_the_seed_s(tmp_path):
    """The keyed-hash split (issue 23): the same file under one run root gives the same split on
    every run; under another run root (same config, same published seed) another validation
    split, so the seed does not tell which records train (the test split is the corpus's own,
    issue 60). The key is 0600; the sizes are a permutation's."""
    cfg = DataConfig(path=YELP_TRAIN, max_records=200, validation_fraction=0.1, test_fraction=0.1)
    key = split_key(tmp_path / "root")
    one, again = prepare_data(cfg, tmp_path / "1", key=key), prepare_data(cfg, tmp_path / "2", key=split_key(tmp_path / "root"))
    other = prepare_data(cfg, tmp_path / "3", key=split_key(tmp_path / "other_root"))
    for split in ("train", "validation", "test"):
        assert read_split(getattr(one, split)) == read_split(getattr(again, split))
    assert read_split(one.validation) != read_split(other.validation)
    assert read_split(one.test) == read_split(other.test)
    assert (one.n_train, one.n_validation, one.n_test) == (other.n_train, other.n_validation, other.n_test) == (162, 18, 20)
    assert (tmp_path / "root" / SPLIT_KEY).stat().st_mode & 0o777 == 0o600
    assert split_key(tmp_path / "nowhere", create=False) is None and not (tmp_path / "nowhere").exists()


def test_a_file_streamed_in_many_batches_keeps_rows_users_and_order(tmp_path, monkeypatch):
    """Batches of 50 rows: an error names its row of the file, a user's records all land on one
    side however far apart, and every split keeps the file's order."""
    monkeypatch.setattr(data_stage, "ROW_GROUP", 50)
    n = 230
    rows = {"text": [f"review {i}" for i in range(n)], "label1": [f"c{i % 3}" for i in range(n)],
            "user": [f"u{i % 40}" for i in range(n)]}
    path = tmp_path / "records.parquet"
    pq.write_table(pa.table(rows), path)
    cfg = DataConfig(path=path, code_columns=["label1"], user_column="user", validation_fraction=0.2, test_fraction=0.2)
    res = prepare_data(cfg, tmp_path / "out", key=split_key(tmp_path))
    assert res.n_train + res.n_validation + res.n_test == n
    sides = {}
    for split in ("train", "validation", "test"):
        path_ = getattr(res, split)
        for user in set(read_users(path_)):
            assert sides.setdefault(user, split) == split, f"user {user} on two sides"
        texts = read_split(path_)[1]
        assert texts == sorted(texts, key=lambda t: int(t.split()[1]))  # the file's order
    assert sorted(sides.values()).count("test") == 8 and sorted(sides.values()).count("validation") == 6

    rows["text"][172] = ""
    pq.write_table(pa.table(rows), path)
    with pytest.raises(DataError, match=r"1 unusable record\(s\):\n  - row 173, column 'text': empty text"):
        prepare_data(cfg, tmp_path / "bad", key=split_key(tmp_path))
    assert not list((tmp_path / "bad").glob("*.parquet")) and not list((tmp_path / "bad").glob(".*"))


SIDES = ("train", "validation", "test")
KEYS = (b"\1" * 32, b"\2" * 32)  # two run roots' split keys
SALT = b"dpdistill/test-split/v1"  # public: a corpus's test split is the same in every checkout


def _hash(*parts: str, key: bytes) -> int:
    """A hash as the data stage makes it, written out: 8-byte BLAKE2b of the parts, each ended by a NUL."""
    h = hashlib.blake2b(digest_size=8, key=key)
    for part in parts:
        h.update(part.encode() + b"\0")
    return int.from_bytes(h.digest(), "little")


def _keyed_rule(units: list[str], key: bytes, test_fraction: float, validation_fraction: float) -> list[str]:
    """The split before issue 60 (data.test_split=keyed): the units ranked by keyed hash, the
    lowest n_test to test, the next n_validation to validation; each record's side."""
    ranked = sorted(set(units), key=lambda u: _hash(u, key=key))
    n_test = max(1, round(test_fraction * len(ranked)))
    n_validation = round(validation_fraction * (len(ranked) - n_test))
    side = {u: "test" if i < n_test else "validation" if i < n_test + n_validation else "train"
            for i, u in enumerate(ranked)}
    return [side[u] for u in units]


def _fixed_rule(units: list[str], test_units: list[tuple[str, ...]], key: bytes, test_fraction: float,
                validation_fraction: float) -> list[str]:
    """data.test_split=fixed: test the n_test units of lowest public hash of `test_units` (the
    user, or the record's codes and text; copies in file order), then validation the
    n_validation of lowest keyed hash among the others; each record's side."""
    first = {}  # each unit's public hash, and where it first appears
    for i, (unit, parts) in enumerate(zip(units, test_units)):
        first.setdefault(unit, (_hash(*parts, key=SALT), i))
    ranked = sorted(first, key=first.get)
    test = set(ranked[:max(1, round(test_fraction * len(ranked)))])
    rest = sorted(set(units) - test, key=lambda u: _hash(u, key=key))
    n_validation = round(validation_fraction * len(rest))
    side = {u: "test" for u in test} | {u: "validation" if i < n_validation else "train" for i, u in enumerate(rest)}
    return [side[u] for u in units]


def _reviews(tmp_path, n=200, users=None, name="reviews", texts=None):
    """`n` records `{name} i` with code `c{i % 3}` (by user `u{i % users}` when `users`): the file, the
    texts, each record's unit as the data stage names it (its user, or its row) and what its
    public test hash is of (its user, or its codes and text)."""
    texts = texts or [f"{name} {i}" for i in range(n)]
    rows = {"text": texts, "label1": [f"c{i % 3}" for i in range(len(texts))]}
    if users:
        rows["user"] = [f"u{i % users}" for i in range(len(texts))]
    path = tmp_path / f"{name}.parquet"
    pq.write_table(pa.table(rows), path)
    if users:
        return path, texts, rows["user"], [(u,) for u in rows["user"]]
    return path, texts, [str(i + 1) for i in range(len(texts))], list(zip(rows["label1"], texts))


def _splits(result) -> dict[str, list[str]]:
    return {side: read_split(getattr(result, side))[1] for side in SIDES}


def _expected(texts: list[str], sides: list[str]) -> dict[str, list[str]]:
    return {side: [t for t, s in zip(texts, sides) if s == side] for side in SIDES}


@pytest.mark.parametrize("users", [None, 40])
def test_a_fixed_test_split_is_the_same_under_every_key_and_validation_stays_keyed(tmp_path, users):
    """Issue 60: with data.test_split=fixed (the default), two run roots hold out the same test
    records, those of lowest hash under the public salt, so every row of a results table is
    scored on them; which of the others validate is still the run root's secret key's choice.
    By user: no user on two sides, and the sizes a permutation of the 40 users would give."""
    path, texts, units, test_units = _reviews(tmp_path, users=users)
    cfg = DataConfig(path=path, code_columns=["label1"], user_column="user" if users else None,
                     validation_fraction=0.2, test_fraction=0.2)
    one, other = (prepare_data(cfg, tmp_path / f"run{i}", key=key) for i, key in enumerate(KEYS))
    for result, key in ((one, KEYS[0]), (other, KEYS[1])):
        assert _splits(result) == _expected(texts, _fixed_rule(units, test_units, key, 0.2, 0.2))
    assert _splits(one)["test"] == _splits(other)["test"]
    assert _splits(one)["validation"] != _splits(other)["validation"]
    if users:
        sides = {split: set(read_users(getattr(one, split))) for split in SIDES}
        assert not (sides["test"] & sides["validation"] or sides["test"] & sides["train"]
                    or sides["validation"] & sides["train"])
        assert [len(sides[split]) for split in SIDES] == [26, 6, 8]  # 8 = 0.2 × 40, 6 = round(0.2 × 32)
    else:
        assert (one.n_train, one.n_validation, one.n_test) == (128, 32, 40)


@pytest.mark.parametrize("users", [None, 40])
def test_a_keyed_test_split_is_the_rule_before_issue_60_bit_for_bit(tmp_path, users, monkeypatch):
    """data.test_split=keyed is the split before issue 60: test drawn with the secret key too, so
    two run roots hold out different test records; and by user (where the fixed rule hashes the
    same unit) the fixed rule with its public salt set to the key writes the very same files."""
    path, texts, units, _ = _reviews(tmp_path, users=users)
    cfg = DataConfig(path=path, code_columns=["label1"], user_column="user" if users else None,
                     validation_fraction=0.2, test_fraction=0.2, test_split="keyed")
    one, other = (prepare_data(cfg, tmp_path / f"run{i}", key=key) for i, key in enumerate(KEYS))
    for result, key in ((one, KEYS[0]), (other, KEYS[1])):
        assert _splits(result) == _expected(texts, _keyed_rule(units, key, 0.2, 0.2))
    assert _splits(one)["test"] != _splits(other)["test"]
    if not users:  # the fixed rule hashes a record's codes and text, not its row: no salt gives the keyed rule
        return
    monkeypatch.setattr(data_split, "TEST_SPLIT_SALT", KEYS[0])
    fixed = prepare_data(cfg.model_copy(update={"test_split": "fixed"}), tmp_path / "fixed", key=KEYS[0])
    for split in SIDES:
        assert getattr(fixed, split).read_bytes() == getattr(one, split).read_bytes(), split


def test_with_test_path_the_test_file_is_the_test_split_whatever_test_split_says(tmp_path):
    """data.test_path: that file is the test split, whole and in order, under either rule; the
    training file gives validation (by the keyed hash) and train only."""
    path, texts, units, _ = _reviews(tmp_path)
    test_path, test_texts, _, _ = _reviews(tmp_path, n=30, name="held-out")
    cfg = DataConfig(path=path, test_path=test_path, code_columns=["label1"], validation_fraction=0.2)
    fixed = prepare_data(cfg, tmp_path / "fixed", key=KEYS[0])
    keyed = prepare_data(cfg.model_copy(update={"test_split": "keyed"}), tmp_path / "keyed", key=KEYS[0])
    assert _splits(fixed) == _splits(keyed)
    assert _splits(fixed)["test"] == test_texts and fixed.n_test == 30
    ranked = sorted(units, key=lambda u: _hash(u, key=KEYS[0]))
    validation = set(ranked[:40])  # round(0.2 × 200), no unit of the training file in test
    assert _splits(fixed)["validation"] == [t for t, u in zip(texts, units) if u in validation]


def test_the_plan_sees_the_test_records_of_runs_not_made_yet(tmp_path):
    """`dpdistill plan` before the first run under a run root splits with a throwaway key; the
    test records it reads are the ones the run will score."""
    path = _reviews(tmp_path)[0]
    cfg = DataConfig(path=path, code_columns=["label1"])
    plan = planned_split(cfg, tmp_path / "root")
    assert not (tmp_path / "root" / SPLIT_KEY).exists()
    run = prepare_data(cfg, tmp_path / "run", key=split_key(tmp_path / "root"))
    assert (plan.test_codes, plan.test_texts) == read_split(run.test)


@pytest.mark.parametrize("users", [None, 40])
def test_removing_one_record_moves_at_most_one_other_in_or_out_of_each_split(tmp_path, users):
    """The DP argument for a public test rule (docs/privacy.md): each unit's public hash is of
    the unit alone, so a file with one record fewer gives each split as it was, with one record
    fewer, or with one exchanged for another (when a rounded size steps). At record level that
    needs the hash of the record, not of its row (removing row 1 would renumber every other),
    and holds for test and the rest; which of the rest validate is drawn by the secret key over
    rows, a fresh uniform draw in the neighbouring file (so it holds in distribution, not here)."""
    path, texts, _, _ = _reviews(tmp_path, users=users)
    cfg = DataConfig(path=path, code_columns=["label1"], user_column="user" if users else None,
                     validation_fraction=0.2, test_fraction=0.2)
    full = _splits(prepare_data(cfg, tmp_path / "full", key=KEYS[0]))
    table = pq.read_table(path)
    for row in (0, 1, 99, 199):
        pq.write_table(pa.concat_tables([table.slice(0, row), table.slice(row + 1)]), path)
        fewer = _splits(prepare_data(cfg, tmp_path / f"without{row}", key=KEYS[0]))
        for split in (full, fewer):
            split["rest"] = split["train"] + split["validation"]
        for side in SIDES + ("rest",) if users else ("test", "rest"):
            gone, new = set(full[side]) - {texts[row]} - set(fewer[side]), set(fewer[side]) - set(full[side])
            assert len(gone) <= 1 and len(new) <= 1, (row, side, len(gone), len(new))


def test_exact_copies_tie_in_the_public_hash_and_the_sizes_stay_exact(tmp_path):
    """Copies of one record have one public hash: as many of them as the size allows are test
    (the first in the file), not all, so the split sizes are a permutation's."""
    path = _reviews(tmp_path, texts=["the same review"] * 60 + [f"review {i}" for i in range(40)])[0]
    cfg = DataConfig(path=path, code_columns=["label1"], validation_fraction=0.2, test_fraction=0.2)
    result = prepare_data(cfg, tmp_path / "out", key=KEYS[0])
    assert (result.n_train, result.n_validation, result.n_test) == (64, 16, 20)
