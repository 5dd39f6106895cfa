"""`dpdistill audit`: verbatim spans of training records in what a run publishes, canary
exposure, and the model cards. Hand-built run directories keep most tests fast; one test
runs the real tiny flow with canaries and audits it, Prefect logs included."""

from __future__ import annotations

import gzip
import html
import json
import os
import shutil
import stat
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from prefect import flow, get_run_logger, task
from safetensors.torch import save_file
from conftest import PUBLIC, YELP_TRAIN, make_tiny_model, tiny_pipeline_dict

from flows.audit import secret_work_dir
from flows.cli import main
from flows.run_info import RunDirError
from pipeline.audits.audit import AUDIT, NAMES, training_texts, words
from pipeline.batching import lm_batch
from pipeline.audits.canaries import Canary, canary_exposures, make_canaries, write_canary_data
from pipeline.config import DataConfig, config_from_dict, dump_config
from pipeline.records import encode_record, read_split, split_key
from pipeline.stages.data import prepare_data
from pipeline.privacy.ledger import LedgerEntry, PrivacyLedger, compose, fmt_value, post_processing, read_ledger
from pipeline.reports.model_card import CARD, model_card


def _public_sentences(n: int) -> list[str]:
    return [line.strip() for line in PUBLIC.read_text().splitlines() if len(line.split()) > 20][:n]


@flow(name="tiny-run", persist_result=False)
def _ordinary_flow() -> str:
    from prefect.context import get_run_context

    get_run_logger().info("an ordinary log line")
    return str(get_run_context().flow_run.id)


@pytest.fixture(scope="session")
def ordinary_flow_run(prefect_server) -> str:
    """A flow run of the session's Prefect server that holds no private record: the run
    directories below name it, as a run made by the flow names its own."""
    return _ordinary_flow()


@pytest.fixture
def run_dir(tmp_path, tiny_tokenizer, ordinary_flow_run) -> Path:
    """A finished-looking run directory: config, private splits, checkpoint, report, shard,
    model files (with the run's tokenizer), logs, and its flow run in Prefect. Nothing published
    holds a private record."""
    cfg = config_from_dict(tiny_pipeline_dict(tmp_path))
    run = tmp_path / "runs" / "tiny-1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))
    _flow_run_json(run, ordinary_flow_run)
    prepare_data(cfg.data, run / "data", cfg.control_codes.domain, split_key(run.parent))
    train = read_split(run / "data" / "train.parquet")[1]
    public = _public_sentences(30)
    (run / "report.html").write_text("<html><body>" + "".join(f"<p>{html.escape(t)}</p>" for t in public[:10]))
    (run / "synthetic").mkdir()
    pq.write_table(pa.table({"sample_id": list(range(10)), "text": public[10:20]}), run / "synthetic" / "shard-00000.parquet")
    model = run / "teacher" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"n_layer": 1, "note": public[20]}))
    tiny_tokenizer.save_pretrained(model)
    # Weights (a torch zip, a true .npy, safetensors): numbers that are no token ids, no text.
    (run / "teacher" / "checkpoint").mkdir()
    torch.save({"weight": torch.randn(4, 4), "step": torch.tensor(36)}, run / "teacher" / "checkpoint" / "state.pt")
    np.save(run / "teacher" / "checkpoint" / "noise.npy", np.random.default_rng(0).random(16, dtype=np.float32))
    save_file({"weight": torch.randn(4, 4)}, model / "model.safetensors")
    assert train  # the private splits stay in data/ while the run is alive
    (run / "teacher" / "training_log.json").write_text(json.dumps({"history": [{"step": 1, "loss": 3.2}]}))
    return run


def _record(run: Path, split: str = "train") -> str:
    """A record of the split long enough to be matched (from the split copy written above)."""
    return next(t for t in read_split(run / "data" / f"{split}.parquet")[1] if len(words(t)) >= 15)


def _assert_not_quoted(text: str, *outputs: str) -> None:
    span = " ".join(words(text)[:10])
    for out in outputs:
        assert text.strip()[:40] not in out
        assert span not in " ".join(words(out))


def test_clean_run_exits_0_and_writes_counts(run_dir, capsys):
    """Nothing published holds a training span: exit 0; audit.json has the counts, and
    the private splits and the checkpoint are listed as not scanned."""
    assert main(["audit", str(run_dir)]) == 0
    report = json.loads((run_dir / AUDIT).read_text())
    assert report["total_hits"] == 0 and report["records_source"].startswith("data/{train,validation,test}")
    assert report["span"] == 10 and report["spans_checked"] > 100 and report["bytes_scanned"] > 0
    assert {"report.html", "synthetic/shard-00000.parquet", "teacher/model/config.json"} <= set(report["files"])
    assert report["incomplete"] == {}  # everything it publishes was read
    for split in ("train", "validation", "test"):
        assert report["not_scanned"][f"data/{split}.parquet"] == "private split"
    for weights in ("teacher/checkpoint/state.pt", "teacher/checkpoint/noise.npy", "teacher/model/model.safetensors"):
        assert report["not_scanned"][weights].startswith("binary tensors")
    assert set(report["private_records"]) == {"train", "validation", "test"}
    assert report["extra_sources"].startswith("flow run") and report["files"]["prefect:flow_runs"]["bytes"] > 0
    assert "clean" in capsys.readouterr().out


def test_planted_record_exits_1_names_the_file_never_the_text(run_dir, capsys):
    """A training record in the report (HTML-escaped) and in a shard: exit 1, both files
    named with their counts, the record quoted nowhere (stdout, stderr, audit.json)."""
    secret = _record(run_dir)
    with open(run_dir / "report.html", "a") as f:
        f.write(f"<p>{html.escape(secret)}</p>")
    shard = run_dir / "synthetic" / "shard-00001.parquet"
    pq.write_table(pa.table({"sample_id": [0, 1], "text": ["An ordinary sentence.", "Prefix. " + secret.upper()]}), shard)
    assert main(["audit", str(run_dir)]) == 1
    out, err = capsys.readouterr()
    report_text = (run_dir / AUDIT).read_text()
    report = json.loads(report_text)
    assert report["files_with_hits"] == ["report.html", "synthetic/shard-00001.parquet"]
    assert report["private_records_found"] == {"train": 1, "validation": 0, "test": 0}
    assert report["files"]["report.html"]["hits"] == len(words(secret)) - 9
    assert "report.html" in out and "shard-00001.parquet" in out and "LEAK" in out
    _assert_not_quoted(secret, out, err, report_text)


def test_without_split_copies_the_splits_are_rebuilt_from_the_source(run_dir, capsys):
    """With data/*.parquet deleted, the records come from config.yaml's data.path through
    the data stage's own split: a training record is found, so is a validation record (a
    private record too, outside the ledger's ε), and --span changes the window."""
    train_secret, val_secret = _record(run_dir, "train"), _record(run_dir, "validation")
    for p in (run_dir / "data").glob("*.parquet"):
        p.unlink()
    (run_dir / "logs.txt").write_text(val_secret + "\n")
    assert main(["audit", str(run_dir)]) == 1
    report = json.loads((run_dir / AUDIT).read_text())
    assert report["records_source"].startswith("data.path") and report["files_with_hits"] == ["logs.txt"]
    assert report["private_records_found"] == {"train": 0, "validation": 1, "test": 0}
    (run_dir / "logs.txt").write_text(" ".join(words(train_secret)[:12]) + "\n")
    assert main(["audit", str(run_dir)]) == 1
    assert json.loads((run_dir / AUDIT).read_text())["files_with_hits"] == ["logs.txt"]
    assert main(["audit", str(run_dir), "--span", "13"]) == 0  # 12 words cannot hold a 13-word span
    _assert_not_quoted(train_secret, capsys.readouterr().out)


def _plant_in_checkpoint(run: Path, secret: str) -> str:
    (run / "teacher" / "checkpoint" / "notes.txt").write_text(secret)  # a folder's name proves nothing
    return "teacher/checkpoint/notes.txt"


def _plant_in_npy_named_text(run: Path, secret: str) -> str:
    (run / "teacher" / "model" / "extra.npy").write_text(secret)  # text with a weights suffix
    return "teacher/model/extra.npy"


def _plant_in_data_parquet(run: Path, secret: str) -> str:
    pq.write_table(pa.table({"text": ["An ordinary sentence.", secret]}), run / "data" / "export.parquet")
    return "data/export.parquet"  # under data/, but not one of the splits the data stage wrote


def _plant_in_token_ids(run: Path, secret: str) -> str:
    from pipeline.models.base import load_tokenizer

    ids = encode_record(load_tokenizer(str(run / "teacher" / "model")), "Stars: 5", secret)
    shard = run / "synthetic" / "shard-00001.parquet"
    pq.write_table(pa.table({"sample_id": [0], "text": ["An ordinary sentence."],
                             "token_ids": pa.array([ids], pa.list_(pa.int32()))}), shard)
    return "synthetic/shard-00001.parquet"  # the text column is clean: only the ids hold it


def _plant_in_modified_split(run: Path, secret: str) -> str:
    """A split file that is no longer the one the data stage wrote (its hash differs)."""
    codes, texts = read_split(run / "data" / "validation.parquet")
    pq.write_table(pa.table({"control_code": codes + ["x"], "text": texts + [secret]}),
                   run / "data" / "validation.parquet")
    return "data/validation.parquet"


def _secret(run: Path, split: str) -> str:
    """The first 20 words of a record of `split` (from the split copy)."""
    texts = read_split(run / "data" / f"{split}.parquet")[1]
    return " ".join(words(next(t for t in texts if len(words(t)) >= 20))[:20])


def _assert_found(run: Path, secret: str, where: str | list[str], split: str, capsys) -> None:
    assert main(["audit", str(run)]) == 1
    out, err = capsys.readouterr()
    report = json.loads((run / AUDIT).read_text())
    where = [where] if isinstance(where, str) else where
    assert report["files_with_hits"] == where and all(report["files"][w]["hits"] >= 11 for w in where)
    assert report["private_records_found"][split] >= 1 and report["incomplete"] == {}
    _assert_not_quoted(secret, out, err, (run / AUDIT).read_text())


@pytest.mark.parametrize("split", ["train", "validation", "test"])
@pytest.mark.parametrize("plant", [_plant_in_checkpoint, _plant_in_npy_named_text, _plant_in_data_parquet,
                                   _plant_in_token_ids, _plant_in_modified_split],
                         ids=["checkpoint-folder", "npy-named-text", "data-parquet", "token-ids", "modified-split"])
def test_a_planted_20_word_span_is_found_wherever_it_sits(run_dir, plant, split, capsys):
    """Files are read by what they hold, not by their name or folder; token ids are decoded
    with the run's tokenizer; every split's records are looked for."""
    secret = _secret(run_dir, split)
    _assert_found(run_dir, secret, plant(run_dir, secret), split, capsys)


def _ids(run: Path, text: str) -> list[int]:
    from pipeline.models.base import load_tokenizer

    return encode_record(load_tokenizer(str(run / "teacher" / "model")), "Stars: 5", text)


def _in_unicode_npy(run: Path, secret: str) -> str:
    np.save(run / "teacher" / "checkpoint" / "notes.npy", np.array(["an ordinary note", secret]))
    return "teacher/checkpoint/notes.npy"


def _in_torch_object(run: Path, secret: str) -> str:
    torch.save({"note": secret, "weight": torch.zeros(2, 2)}, run / "teacher" / "checkpoint" / "extra.pt")
    return "teacher/checkpoint/extra.pt"  # read with weights_only=True: its strings, not its tensors


def _in_safetensors_metadata(run: Path, secret: str) -> str:
    save_file({"weight": torch.zeros(2, 2)}, run / "teacher" / "model" / "extra.safetensors", metadata={"note": secret})
    return "teacher/model/extra.safetensors"


def _in_gzip_text(run: Path, secret: str) -> str:
    (run / "run.log.gz").write_bytes(gzip.compress(f"step 1\n{secret}\n".encode()))
    return "run.log.gz"


def _in_utf16_text(run: Path, secret: str) -> str:
    (run / "notes.txt").write_text(secret, encoding="utf-16")  # with a BOM
    return "notes.txt"


def _in_utf16_text_without_bom(run: Path, secret: str) -> str:
    (run / "notes.txt").write_bytes(secret.encode("utf-16-le"))
    return "notes.txt"


def _in_zip_archive(run: Path, secret: str) -> str:
    with zipfile.ZipFile(run / "export.zip", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("a.txt", "an ordinary text")
        z.writestr("b/notes.json", json.dumps({"note": secret}))
    return "export.zip"


def _in_tar_gz(run: Path, secret: str) -> str:
    import tarfile

    (run.parent / "notes.txt").write_text(secret)
    with tarfile.open(run / "logs.tar.gz", "w:gz") as tar:
        tar.add(run.parent / "notes.txt", arcname="notes.txt")
    return "logs.tar.gz"


def _in_list_of_strings(run: Path, secret: str) -> str:
    pq.write_table(pa.table({"texts": pa.array([["an ordinary text", secret]], pa.list_(pa.string()))}),
                   run / "synthetic" / "shard-00001.parquet")
    return "synthetic/shard-00001.parquet"


def _in_dictionary_column(run: Path, secret: str) -> str:
    pq.write_table(pa.table({"text": pa.array(["an ordinary text", secret, secret]).dictionary_encode()}),
                   run / "synthetic" / "shard-00001.parquet")
    return "synthetic/shard-00001.parquet"


def _in_binary_column(run: Path, secret: str) -> str:
    pq.write_table(pa.table({"text": pa.array([b"an ordinary text", secret.encode()], pa.binary())}),
                   run / "synthetic" / "shard-00001.parquet")
    return "synthetic/shard-00001.parquet"


def _in_json_token_ids(run: Path, secret: str) -> str:
    (run / "synthetic" / "samples.json").write_text(json.dumps({"samples": [{"token_ids": _ids(run, secret)}]}))
    return "synthetic/samples.json"


def _in_arrow_ipc_file(run: Path, secret: str) -> str:
    table = pa.table({"token_ids": pa.array([_ids(run, secret)], pa.list_(pa.int32()))})
    with pa.ipc.new_file(run / "synthetic" / "ids.arrow", table.schema) as writer:
        writer.write_table(table)
    return "synthetic/ids.arrow"


def _in_arrow_ipc_stream(run: Path, secret: str) -> str:
    table = pa.table({"input_ids": pa.array([_ids(run, "An ordinary text."), _ids(run, secret)], pa.list_(pa.int32()))})
    with pa.ipc.new_stream(run / "synthetic" / "ids.arrows", table.schema) as writer:
        writer.write_table(table)
    return "synthetic/ids.arrows"  # the format of the splits' token-id copies (pipeline/tokenized.py)


def _in_a_folder_linked_into_the_run_dir(run: Path, secret: str) -> str:
    (run / "published").symlink_to(run / "data", target_is_directory=True)  # publishes the private splits
    return [f"published/{split}.parquet" for split in ("test", "train", "validation")]


@pytest.mark.parametrize("plant", [
    _in_unicode_npy, _in_torch_object, _in_safetensors_metadata, _in_gzip_text, _in_utf16_text,
    _in_utf16_text_without_bom, _in_zip_archive, _in_tar_gz, _in_list_of_strings, _in_dictionary_column,
    _in_binary_column, _in_json_token_ids, _in_arrow_ipc_file, _in_arrow_ipc_stream,
    _in_a_folder_linked_into_the_run_dir,
], ids=lambda f: f.__name__.removeprefix("_in_"))
def test_a_planted_span_is_found_by_content_whatever_holds_it(run_dir, plant, capsys):
    """Issue 38 finding 2: what the audit missed, each found now. Unicode numpy arrays, a torch
    file's strings (weights_only: never an arbitrary unpickle), safetensors' __metadata__,
    compressed and archived text, UTF-16, every Arrow type (lists of strings, dictionary-encoded,
    binary), token ids in JSON and Arrow IPC (decoded with the run's tokenizer), and a folder
    linked inside the run directory, read under the link's name."""
    secret = _secret(run_dir, "train")
    _assert_found(run_dir, secret, plant(run_dir, secret), "train", capsys)


# --- issue 62: numbers as token ids, and text in pieces -------------------------------------


def _ids_int64_npy(run: Path, secret: str) -> str:
    np.save(run / "teacher" / "checkpoint" / "batch.npy", np.array(_ids(run, secret), dtype=np.int64))
    return "teacher/checkpoint/batch.npy"  # was "binary tensors, not scanned", exit 0


def _ids_int32_npy_as_padded_labels(run: Path, secret: str) -> str:
    """A (2, T) batch of labels: padding -100, the record's ids in the second row."""
    ids = _ids(run, secret)
    labels = np.full((2, len(ids) + 8), -100, dtype=np.int32)
    labels[1, 4:4 + len(ids)] = ids
    np.save(run / "teacher" / "checkpoint" / "labels.npy", labels)
    return "teacher/checkpoint/labels.npy"


def _ids_tensor_in_torch_save(run: Path, secret: str) -> str:
    torch.save({"weight": torch.randn(2, 2), "batch": torch.tensor([_ids(run, secret)])},
               run / "teacher" / "checkpoint" / "batch.pt")
    return "teacher/checkpoint/batch.pt"


def _ids_tensor_in_safetensors(run: Path, secret: str) -> str:
    save_file({"weight": torch.randn(2, 2), "ids": torch.tensor(_ids(run, secret))},
              run / "teacher" / "model" / "extra.safetensors")
    return "teacher/model/extra.safetensors"


def _ids_parquet_int_column_one_per_row(run: Path, secret: str) -> str:
    ids = _ids(run, secret)
    pq.write_table(pa.table({"position": list(range(len(ids))), "token_id": ids}), run / "synthetic" / "ids.parquet")
    return "synthetic/ids.parquet"


def _ids_csv_column(run: Path, secret: str) -> str:
    ids = _ids(run, secret)
    (run / "teacher" / "tokens.csv").write_text("position,token_id\n" + "".join(f"{i},{t}\n" for i, t in enumerate(ids)))
    return "teacher/tokens.csv"


def _ids_json_floats(run: Path, secret: str) -> str:
    (run / "synthetic" / "samples.json").write_text(json.dumps({"ids": [float(i) for i in _ids(run, secret)]}))
    return "synthetic/samples.json"


def _ids_printed_tensor_in_a_log(run: Path, secret: str) -> str:
    (run / "debug.log").write_text(f"step 3 batch: tensor([{', '.join(map(str, _ids(run, secret)))}])\n")
    return "debug.log"


def _one_word_per_json_string(run: Path, secret: str) -> str:
    (run / "synthetic" / "words.json").write_text(json.dumps({"words": secret.split()}))
    return "synthetic/words.json"


def _one_word_per_parquet_row(run: Path, secret: str) -> str:
    pq.write_table(pa.table({"word": secret.split()}), run / "synthetic" / "words.parquet")
    return "synthetic/words.parquet"


def _bpe_token_strings(run: Path, secret: str) -> str:
    from pipeline.models.base import load_tokenizer

    tok = load_tokenizer(str(run / "teacher" / "model"))
    tokens = tok.convert_ids_to_tokens(tok(secret, add_special_tokens=False)["input_ids"])
    (run / "synthetic" / "tokens.json").write_text(json.dumps({"tokens": tokens}))
    return "synthetic/tokens.json"


def _html_a_span_per_word(run: Path, secret: str) -> str:
    (run / "tokens.html").write_text("<html><body>" + "".join(
        f'<span class="t">{html.escape(w)}</span>' for w in secret.split()) + "</body></html>")
    return "tokens.html"


def _base64_text(run: Path, secret: str) -> str:
    import base64

    (run / "notes.txt").write_text("payload: " + base64.b64encode(secret.encode()).decode() + "\n")
    return "notes.txt"


def _hex_text(run: Path, secret: str) -> str:
    (run / "notes.txt").write_text("payload=" + secret.encode().hex() + "\n")
    return "notes.txt"


def _url_encoded_text(run: Path, secret: str) -> str:
    import urllib.parse

    (run / "links.txt").write_text("https://example.org/search?q=" + urllib.parse.quote(secret) + "\n")
    return "links.txt"


def _words_joined_with_underscores(run: Path, secret: str) -> str:
    (run / "notes.txt").write_text("_".join(secret.split()))
    return "notes.txt"


def _a_file_named_with_the_span(run: Path, secret: str) -> str:
    (run / "synthetic" / f"{secret}.txt").write_text("")
    return NAMES


def _a_folder_named_with_the_span(run: Path, secret: str) -> str:
    (run / "_".join(secret.split())).mkdir()
    return NAMES


@pytest.mark.parametrize("plant", [
    _ids_int64_npy, _ids_int32_npy_as_padded_labels, _ids_tensor_in_torch_save, _ids_tensor_in_safetensors,
    _ids_parquet_int_column_one_per_row, _ids_csv_column, _ids_json_floats, _ids_printed_tensor_in_a_log,
    _one_word_per_json_string, _one_word_per_parquet_row, _bpe_token_strings, _html_a_span_per_word,
    _base64_text, _hex_text, _url_encoded_text, _words_joined_with_underscores, _a_file_named_with_the_span,
    _a_folder_named_with_the_span,
], ids=lambda f: f.__name__.strip("_"))
def test_a_record_stored_as_numbers_or_in_pieces_is_found(run_dir, plant, capsys):
    """Issue 62 findings 1 and 2: a training record's token ids stored as numbers (an int64 or
    int32 .npy, a tensor in torch.save or safetensors, a Parquet int column or a CSV column one id
    a row, JSON floats, a tensor printed in a log), or its text in pieces (a word per JSON string
    or Parquet row, BPE token strings, a <span> per word, base64, hex, URL-encoded, words joined
    with underscores, a file or folder named with it) exited 0 "clean". Each is found now."""
    secret = _secret(run_dir, "train")
    _assert_found(run_dir, secret, plant(run_dir, secret), "train", capsys)


def _failing_stage() -> None:
    raise ValueError("an ordinary failure")


def test_the_splits_token_id_copies_are_private_like_the_splits_and_an_edited_one_is_read(run_dir, capsys):
    """The stages keep each split's token ids under data/tokenized/ (pipeline/tokenized.py), as
    private as the splits and deleted with them: not read while they hold exactly the split's
    ids (an interrupted run keeps them, and its audit must not cry leak), read once edited."""
    from pipeline.models.base import load_tokenizer
    from pipeline.tokenized import IDS_FILE, tokenized_split

    tok = load_tokenizer(str(run_dir / "teacher" / "model"))
    for split in ("train", "validation"):
        tokenized_split(run_dir / "data" / f"{split}.parquet", tok)
    copies = {p.parent.name.split("-")[0]: p for p in (run_dir / "data" / "tokenized").glob(f"*/{IDS_FILE}")}
    assert main(["audit", str(run_dir)]) == 0
    report = json.loads((run_dir / AUDIT).read_text())
    for split, path in copies.items():
        assert report["not_scanned"][str(path.relative_to(run_dir))] == (
            f"private split (the token ids of data/{split}.parquet)")
    shutil.copyfile(copies["validation"], copies["train"])  # the train copy's place, other records' ids
    assert main(["audit", str(run_dir)]) == 1
    report = json.loads((run_dir / AUDIT).read_text())
    assert report["files_with_hits"] == [str(copies["train"].relative_to(run_dir))]
    assert report["private_records_found"]["validation"] >= 1
    capsys.readouterr()


@flow(name="tiny-published", persist_result=False)
def _publishing_flow(table_file: str) -> str:
    """What a run's flow publishes in Prefect, in every payload type: a progress artifact (the
    stages' own, whose data SQLite stores as a number), an integer and a float one, markdown,
    a table as rows and as columns, a link, a log line and a task run that failed."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.context import get_run_context

    from flows.progress import StageProgress

    run_id = get_run_context().flow_run.id
    with StageProgress("teacher", "steps") as progress:
        progress({"done": 3, "total": 3})
    with get_client(sync_client=True) as client:
        for data in (50, 12.5):
            client.create_artifact(ArtifactCreate(type="progress", data=data, flow_run_id=run_id, key="raw-progress"))
    create_markdown_artifact("# The ledger\n\nε = 2.07", key="ledger-md", description="the ledger")
    create_table_artifact([{"stage": "teacher", "note": "an ordinary note"}], key="ledger-rows")
    create_table_artifact({"stage": ["teacher"], "note": [Path(table_file).read_text()]}, key="samples-columns")
    create_link_artifact("https://example.org/report", key="report-link")
    task(_failing_stage, name="a-stage")(return_state=True)  # a Failed state: its message quotes the error
    get_run_logger().info("an ordinary log line")
    return str(run_id)


def _flow_run_json(run: Path, flow_run_id: str) -> None:
    (run / "run.json").write_text(json.dumps({"tool": "dpdistill", "status": "completed", "flow_run_id": flow_run_id}))


def test_a_default_run_s_local_prefect_database_is_read_whatever_its_artifacts_hold(prefect_server, run_dir, capsys):
    """Issue 38 finding 1: with no PREFECT_API_URL the flow run's Prefect records are read from
    the local server's SQLite database (PREFECT_HOME/prefect.db by default; the test harness's
    here), every artifact type included: a progress artifact's data is a number there, which
    made the whole database go unread and the audit say clean. A training record planted as a
    log row of the run's flow and a validation record in a table artifact are both found."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.types import DateTime

    secret, in_table = _record(run_dir, "train"), _record(run_dir, "validation")
    (run_dir.parent / "table.txt").write_text(in_table)  # by path: a flow's parameters are published too
    flow_run_id = _publishing_flow(str(run_dir.parent / "table.txt"))
    _flow_run_json(run_dir, flow_run_id)
    with get_client(sync_client=True) as client:
        client.create_logs([LogCreate(name="x", level=20, message=secret, timestamp=DateTime.now("UTC"),
                                      flow_run_id=flow_run_id)])
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert not PREFECT_API_URL.value()
        assert main(["audit", str(run_dir)]) == 1
    out, err = capsys.readouterr()
    report = json.loads((run_dir / AUDIT).read_text())
    # The server's events copy what the artifact held (once its event service has stored them)
    assert set(report["files_with_hits"]) - {"prefect:events"} == {"prefect:artifact:samples-columns", "prefect:logs"}
    assert report["private_records_found"] == {"train": 1, "validation": 1, "test": 0}
    assert "database" in report["extra_sources"] and report["incomplete"] == {}
    for key in ("teacher-progress", "raw-progress", "ledger-md", "ledger-rows", "report-link"):
        assert f"prefect:artifact:{key}" in report["files"], key
    assert report["files"]["prefect:states"]["bytes"] > 0 and report["files"]["prefect:parameters"]["hits"] == 0
    assert "INCOMPLETE" not in out
    _assert_not_quoted(secret, out, err, (run_dir / AUDIT).read_text())
    _assert_not_quoted(in_table, out, err, (run_dir / AUDIT).read_text())


@pytest.fixture(scope="session")
def published_flow_run(prefect_server, tmp_path_factory) -> str:
    """A flow run of the session's server with task runs, artifacts of every type and logs,
    none holding a private record."""
    table = tmp_path_factory.mktemp("published") / "table.txt"
    table.write_text("an ordinary table cell")
    return _publishing_flow(str(table))


def _copy_of_the_database(tmp_path: Path) -> Path:
    """A copy of the session server's SQLite database, as an attacker would get one."""
    import sqlite3
    from contextlib import closing

    from flows.audit import local_prefect_database

    copy = tmp_path / "prefect-copy.db"
    with closing(sqlite3.connect(local_prefect_database())) as source, closing(sqlite3.connect(copy)) as target:
        source.backup(target)
    return copy


_NOW = "2026-01-01 00:00:00.000000"


def _db_event_payload(con, run_id: str, secret: str) -> str:
    resource = {"prefect.resource.id": f"prefect.flow-run.{run_id}"}
    con.execute("INSERT INTO events (occurred, event, resource_id, resource, payload, received, recorded) "
                "VALUES (?, 'dpdistill.note', ?, ?, ?, ?, ?)",
                (_NOW, resource["prefect.resource.id"], json.dumps(resource), json.dumps({"note": secret}), _NOW, _NOW))
    return "prefect:events"


def _db_event_related_to_a_task_run(con, run_id: str, secret: str) -> str:
    """An event about something else that names one of the run's task runs as related."""
    [task_run] = con.execute("SELECT id FROM task_run WHERE flow_run_id = ? LIMIT 1", (run_id,)).fetchone()
    related = {"prefect.resource.id": f"prefect.task-run.{task_run}", "prefect.resource.role": "task-run"}
    con.execute("INSERT INTO events (id, occurred, event, resource_id, resource, related_resource_ids, related, payload, "
                "received, recorded) VALUES ('e-1', ?, 'dpdistill.note', 'dpdistill.thing', ?, ?, ?, ?, ?, ?)",
                (_NOW, json.dumps({"prefect.resource.id": "dpdistill.thing"}), json.dumps([related["prefect.resource.id"]]),
                 json.dumps([related]), json.dumps({"note": secret}), _NOW, _NOW))
    con.execute("INSERT INTO event_resources (occurred, resource_id, resource_role, resource, event_id) "
                "VALUES (?, ?, 'task-run', ?, 'e-1')", (_NOW, related["prefect.resource.id"], json.dumps(related)))
    return "prefect:events"


def _db_task_run_name(con, run_id: str, secret: str) -> str:
    con.execute("UPDATE task_run SET name = ? WHERE flow_run_id = ?", (secret, run_id))
    return "prefect:task_runs"


def _db_flow_run_name(con, run_id: str, secret: str) -> str:
    con.execute("UPDATE flow_run SET name = ? WHERE id = ?", (secret, run_id))
    return "prefect:flow_runs"


def _db_artifact_collection_alone(con, run_id: str, secret: str) -> str:
    """The latest artifact of a key, its artifact rows deleted."""
    con.execute("UPDATE artifact_collection SET description = ?, flow_run_id = ? WHERE key = 'ledger-md'",
                (secret, run_id))
    con.execute("DELETE FROM artifact WHERE key = 'ledger-md'")
    return "prefect:artifact:ledger-md"


def _db_variable(con, run_id: str, secret: str) -> str:
    con.execute("INSERT INTO variable (name, value) VALUES ('notes', ?)", (json.dumps(secret),))
    return "prefect:table:variable"


def _db_flow_run_input(con, run_id: str, secret: str) -> str:
    con.execute("INSERT INTO flow_run_input (flow_run_id, key, value) VALUES (?, 'answer', ?)",
                (run_id, json.dumps(secret)))
    return "prefect:flow_run_input"


@pytest.mark.parametrize("plant", [
    _db_event_payload, _db_event_related_to_a_task_run, _db_task_run_name, _db_flow_run_name,
    _db_artifact_collection_alone, _db_variable, _db_flow_run_input,
], ids=lambda f: f.__name__.removeprefix("_db_"))
def test_every_prefect_table_that_holds_text_is_read(run_dir, published_flow_run, tmp_path, plant, capsys):
    """Issue 62 finding 3: a record planted in a copy of the run's Prefect database, in a table or
    column the audit never read (an event's payload, a task run's or flow run's name, an artifact
    collection whose artifact is gone, a variable, a flow run's input), exited 0 "clean"."""
    import sqlite3
    from contextlib import closing

    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    secret = _record(run_dir, "train")
    _flow_run_json(run_dir, published_flow_run)
    copy = _copy_of_the_database(tmp_path)
    with closing(sqlite3.connect(copy)) as con:
        source = plant(con, published_flow_run, secret)
        con.commit()
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{copy}"},
                            restore_defaults={PREFECT_API_URL}):
        assert main(["audit", str(run_dir)]) == 1
    out, err = capsys.readouterr()
    report = json.loads((run_dir / AUDIT).read_text())
    assert report["files_with_hits"] == [source] and report["incomplete"] == {}, report["incomplete"]
    _assert_not_quoted(secret, out, err, (run_dir / AUDIT).read_text())


def test_a_database_table_the_audit_does_not_know_makes_it_incomplete(run_dir, published_flow_run, tmp_path, capsys):
    """A newer Prefect's table could hold the run's text: named unread, never passed over."""
    import sqlite3
    from contextlib import closing

    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    _flow_run_json(run_dir, published_flow_run)
    copy = _copy_of_the_database(tmp_path)
    with closing(sqlite3.connect(copy)) as con:
        con.execute("CREATE TABLE run_notes (flow_run_id TEXT, note TEXT)")
        con.commit()
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{copy}"},
                            restore_defaults={PREFECT_API_URL}):
        assert main(["audit", str(run_dir)]) == 3
    assert list(json.loads((run_dir / AUDIT).read_text())["incomplete"]) == ["prefect:table:run_notes"]
    capsys.readouterr()


def _api_flow_run_name(client, run_id: str, secret: str) -> str:
    client.update_flow_run(run_id, name=secret)
    return "prefect:flow_runs"


def _api_task_run_name(client, run_id: str, secret: str) -> str:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    [task_run] = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))[:1]
    client.set_task_run_name(task_run.id, secret)
    return "prefect:task_runs"


def _api_variable(client, run_id: str, secret: str) -> str:
    from prefect.client.schemas.actions import VariableCreate

    client.create_variable(VariableCreate(name="audit-test-notes", value=secret))
    return "prefect:table:variable"


@pytest.mark.parametrize("plant", [_api_flow_run_name, _api_task_run_name, _api_variable],
                         ids=lambda f: f.__name__.removeprefix("_api_"))
def test_prefect_names_and_variables_are_read_through_the_api(run_dir, prefect_server, tmp_path, plant, capsys):
    """The same through the server's API (PREFECT_API_URL set), on a flow run of its own."""
    from prefect.client.orchestration import get_client

    secret = _record(run_dir, "train")
    (tmp_path / "table.txt").write_text("an ordinary table cell")
    run_id = _publishing_flow(str(tmp_path / "table.txt"))
    _flow_run_json(run_dir, run_id)
    with get_client(sync_client=True) as client:
        source = plant(client, run_id, secret)
        try:
            assert main(["audit", str(run_dir)]) == 1
        finally:  # the server's variables are every run's: the others' audits must not find it
            if source == "prefect:table:variable":
                client.delete_variable_by_name("audit-test-notes")
    report = json.loads((run_dir / AUDIT).read_text())
    assert report["files_with_hits"] == [source] and report["incomplete"] == {}
    capsys.readouterr()


def _unread_database(run: Path) -> str:
    _flow_run_json(run, "00000000-0000-4000-8000-000000000000")
    return "prefect"  # no PREFECT_API_URL and no database at PREFECT_SERVER_DATABASE_CONNECTION_URL


def _flow_run_json_without_id(run: Path) -> str:
    (run / "run.json").write_text(json.dumps({"tool": "dpdistill", "status": "completed"}))
    return "prefect"  # written by the flow, which always names its flow run: its logs cannot be found


def _run_json_without_tool_or_flow_run_id(run: Path) -> str:
    (run / "run.json").write_text(json.dumps({"status": "completed"}))
    return "prefect"  # issue 62 item 5: passed as "not made by the flow", Prefect unread, exit 0


def _no_run_json(run: Path) -> str:
    (run / "run.json").unlink()
    return "prefect"


def _damaged_parquet(run: Path) -> str:
    (run / "synthetic" / "shard-00001.parquet").write_bytes(b"PAR1" + os.urandom(200))
    return "synthetic/shard-00001.parquet"


def _token_ids_without_tokenizer(run: Path) -> str:
    from pipeline.models.base import load_tokenizer

    ids = encode_record(load_tokenizer(str(run / "teacher" / "model")), "Stars: 5", "An ordinary sentence.")
    pq.write_table(pa.table({"token_ids": pa.array([ids], pa.list_(pa.int32()))}), run / "synthetic" / "ids.parquet")
    for p in (run / "teacher" / "model").glob("*token*"):
        p.unlink()
    # and the shard's sample_id column: ten integers in a row may be ids too (issue 62 item 1)
    return ["synthetic/ids.parquet", "synthetic/shard-00000.parquet"]


class _Opaque:
    """An object only a full unpickle rebuilds (torch.load(weights_only=True) refuses it)."""


def _symlink_out_of_the_run_dir(run: Path) -> str:
    outside = run.parent / "elsewhere"
    outside.mkdir()
    (outside / "notes.txt").write_text(_record(run))
    (run / "linked").symlink_to(outside, target_is_directory=True)
    return "linked"  # named, never followed: it could be anything on the machine


def _dangling_symlink(run: Path) -> str:
    (run / "gone.txt").symlink_to(run.parent / "nothing-here.txt")
    return "gone.txt"


def _fifo(run: Path) -> str:
    os.mkfifo(run / "pipe")
    return "pipe"  # never opened: reading a FIFO blocks


def _numpy_object_array(run: Path) -> str:
    np.save(run / "teacher" / "checkpoint" / "objects.npy", np.array([{"a": 1}, None], dtype=object))
    return "teacher/checkpoint/objects.npy"  # needs pickle: not loaded


def _torch_pickle_of_an_object(run: Path) -> str:
    torch.save({"weight": torch.zeros(2), "extra": _Opaque()}, run / "teacher" / "checkpoint" / "opaque.pt")
    return "teacher/checkpoint/opaque.pt"


def _zstd_file(run: Path) -> str:
    (run / "run.log.zst").write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(64))
    return "run.log.zst"


def _unknown_binary(run: Path) -> str:
    (run / "blob.bin").write_bytes(bytes(range(256)) * 8)
    return "blob.bin"


@pytest.mark.parametrize("make_unreadable", [
    _unread_database, _flow_run_json_without_id, _run_json_without_tool_or_flow_run_id, _no_run_json, _damaged_parquet, _token_ids_without_tokenizer,
    _symlink_out_of_the_run_dir, _dangling_symlink, _fifo, _numpy_object_array, _torch_pickle_of_an_object,
    _zstd_file, _unknown_binary,
], ids=lambda f: f.__name__.strip("_"))
def test_what_cannot_be_read_makes_the_audit_incomplete_never_clean(run_dir, tmp_path, make_unreadable, capsys):
    """Fail closed: a source the run publishes that the audit cannot read exits 3 with
    "INCOMPLETE" and the source named (audit.json's `incomplete` says why), never 0; the rest is
    still read (a record planted elsewhere is still a LEAK, exit 1)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    source = make_unreadable(run_dir)
    nowhere = {PREFECT_SERVER_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{tmp_path / 'absent' / 'prefect.db'}"}
    # Prefect's cases without a server or database; the others read the run's flow run from the server
    with temporary_settings(updates=nowhere if source == "prefect" else {},
                            restore_defaults={PREFECT_API_URL} if source == "prefect" else set()):
        assert main(["audit", str(run_dir)]) == 3
        out = capsys.readouterr().out
        report = json.loads((run_dir / AUDIT).read_text())
        sources = [source] if isinstance(source, str) else source
        assert list(report["incomplete"]) == sources and "INCOMPLETE" in out and all(s in out for s in sources)
        assert "clean:" not in out and report["files"]["report.html"]["spans"] > 0  # the rest was read
        (run_dir / "notes.txt").write_text(_record(run_dir))
        assert main(["audit", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "LEAK" in out and "INCOMPLETE" in out


def test_usage_errors_exit_2(run_dir, tmp_path, capsys):
    assert main(["audit", str(tmp_path / "nope")]) == 2
    assert main(["audit", "--canaries", "2"]) == 2  # no --config
    assert main(["audit", str(run_dir), "--span", "0"]) == 2
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["data"]["path"] = str(tmp_path / "moved.csv")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    shutil.rmtree(run_dir / "data")
    assert main(["audit", str(run_dir)]) == 2  # no split copies and the source is gone
    assert "data.path" in capsys.readouterr().err


# --- canary exposure --------------------------------------------------------------------

_CFG = DataConfig(path=Path("unused.csv"), code_columns=["label1"])
_CANARIES = [Canary(id=i, codes={"label1": "Stars: 5"}, digits=d, repetitions=1)
             for i, d in enumerate(["392714856", "105938274", "771203958", "648201937"])]


def _train_on(model, tokenizer, canary: Canary, steps: int) -> None:
    """Non-private training on one canary repeated (a model that memorises it)."""
    ids = encode_record(tokenizer, canary.control_code(_CFG), canary.text)
    batch = lm_batch(torch.tensor([ids] * 4), torch.tensor([len(ids)] * 4))
    labels = batch.pop("labels")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(**batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_exposure_sees_a_memorised_canary_and_not_an_unseen_one(tiny_tokenizer):
    """Exposure (Carlini et al. 2019) with 100 candidates (max log2(101) = 6.66 bits): a model
    trained on a repeated canary ranks it first; an untrained one gives the canaries about
    the log2(e) = 1.44 bits of chance."""
    model = make_tiny_model(tiny_tokenizer)
    untrained = canary_exposures(model, tiny_tokenizer, _CANARIES, _CFG, n_candidates=100, seed=0)
    assert sum(e["exposure"] for e in untrained) / len(untrained) < 3
    _train_on(model, tiny_tokenizer, _CANARIES[0], steps=60)
    trained = canary_exposures(model, tiny_tokenizer, _CANARIES, _CFG, n_candidates=100, seed=0)
    assert trained[0]["rank"] == 1 and trained[0]["exposure"] == pytest.approx(6.658, abs=1e-3)
    assert all(e["exposure"] < 5 for e in trained[1:])  # the others were not trained on


def test_the_canary_work_dir_is_private_while_alive_and_deleted_after(tmp_path):
    """The data copy (the whole training file plus the secrets) lives in a 0700 directory,
    written 0600 whatever the umask, and the directory goes when the block ends, also when
    it ends in an error. A directory that holds something is refused, never emptied."""
    source = pa.table({"text": ["a text"] * 4, "label1": ["Stars: 5"] * 4})
    old_umask = os.umask(0o022)
    try:
        with secret_work_dir(tmp_path / "work") as work:
            write_canary_data(source, _CANARIES[:1], _CFG, work / "copy.parquet")
            assert stat.S_IMODE(work.stat().st_mode) == 0o700
            assert stat.S_IMODE((work / "copy.parquet").stat().st_mode) == 0o600
        assert not (tmp_path / "work").exists()
        with pytest.raises(RuntimeError, match="the flow failed"), secret_work_dir(tmp_path / "work") as work:
            write_canary_data(source, _CANARIES[:1], _CFG, work / "copy.parquet")
            raise RuntimeError("the flow failed")
        assert not (tmp_path / "work").exists()
    finally:
        os.umask(old_umask)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(RunDirError, match="not an empty directory"), secret_work_dir(tmp_path / "mine"):
        pass
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_canary_run_that_fails_leaves_no_data_copy(prefect_server, tmp_path, capsys):
    """The flow fails after the canaried copy is written (its run_root is shared: sticky
    bit): exit 2 with the reason, and the work directory with the copy is gone."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_pipeline_dict(tmp_path) | {"run_root": str(shared)}))
    work = tmp_path / "elsewhere" / "canaries"
    assert main(["audit", "--canaries", "2", "--config", str(config), "--work-dir", str(work)]) == 2
    assert "run_root" in capsys.readouterr().err
    assert not work.exists() and not list(shared.iterdir())


# --- model cards ------------------------------------------------------------------------


def _ledger(codes_private: bool) -> PrivacyLedger:
    teacher = LedgerEntry(
        stage="teacher", private=True, epsilon=1.875, delta=6.9e-4, accountant="prv", mechanism="subsampled_gaussian",
        noise_multiplier=1.234, sample_rate=0.0853, steps=36, max_grad_norm=1.0, privacy_unit="record",
        epsilon_rdp=2.1, history=[(1.234, 0.0853, 36)], note="record-level DP-SGD",
    )
    codes = LedgerEntry(stage="control-codes", private=codes_private, epsilon=None if not codes_private else 0.0,
                        note="exact counts of the training split's control codes")
    entries = [codes, teacher, post_processing("generation", "samples"), post_processing("distillation", "synthetic")]
    return PrivacyLedger(entries=entries, total=compose(entries, "prv", 6.9e-4))


def test_model_card_states_the_ledger_and_what_is_not_protected():
    ledger = _ledger(codes_private=False)
    card = model_card(ledger, "distillation")
    for value in ("1.875", "0.00069", "1.234", "0.0853", "36", "prv", "record", fmt_value(ledger.total.epsilon)):
        assert value in card, value
    assert "post-processing" in card and "INCOMPLETE" in card
    assert "`control-codes` is released without DP" in card
    assert "held-out splits" in card and "group-privacy" in card and "Hyperparameter" in card
    clean = model_card(_ledger(codes_private=True), "teacher")
    assert "released without DP" not in clean and "complete" in clean
    assert "untied" not in clean  # the entry says nothing was added


def test_model_card_says_what_untying_the_head_added():
    ledger = _ledger(codes_private=True)
    ledger.entries[1] = ledger.entries[1].model_copy(update={"untied_parameters": 28_311_552})
    card = model_card(ledger, "teacher")
    assert "| lm_head | untied from the input embedding for DP-SGD: +28,311,552 parameters" in card


# --- the real flow ----------------------------------------------------------------------


def _watch_modes(folder: Path, seen: dict[str, int], stop: threading.Event) -> None:
    """Record the mode of everything in `folder` while it exists (a thread beside the flow)."""
    while not stop.is_set():
        for p in [folder, *folder.rglob("*")] if folder.exists() else []:
            try:
                seen[str(p.relative_to(folder))] = stat.S_IMODE(p.stat().st_mode)
            except (FileNotFoundError, ValueError):  # deleted between the listing and the stat
                pass
        time.sleep(0.05)


def test_the_canary_report_gives_the_replace_one_epsilon_beside_the_add_remove_one():
    """Issue 38 item 6: canaries.json and the printed report had the add/remove ε only."""
    from flows.audit import format_canary_report, ledger_figures

    history = [(1.3, 0.08, 36)]
    teacher = LedgerEntry(stage="teacher", private=True, epsilon=1.99, epsilon_replace_one=3.04, delta=7e-5,
                          accountant="prv", mechanism="subsampled_gaussian", noise_multiplier=1.3, sample_rate=0.08,
                          steps=36, privacy_unit="record", history=history, note="DP-SGD")
    ledger = PrivacyLedger(entries=[teacher, post_processing("generation", "reads the DP teacher")],
                           total=compose([teacher], "prv", 7e-5).model_copy(update={"epsilon": 2.07,
                                                                                    "epsilon_replace_one": 3.17}))
    figures = ledger_figures(ledger)
    assert figures["epsilon_total"] == 2.07 and figures["epsilon_total_replace_one"] == 3.17
    assert figures["epsilon_dp_training"] == 1.99 and figures["epsilon_dp_training_replace_one"] == 3.04
    report = figures | {
        "canaries": 2, "records_added": 9, "candidates": 50, "max_exposure_bits": 5.67, "models": {"dp_teacher": "x"},
        "by_repetitions": {"1": {"canaries": 2, "copies_in_train": 2, "emitted": 0,
                                 "dp_teacher": {"mean": 1.0, "max": 2.0}}},
        "synthetic_samples": 10, "canaries_emitted": 0, "run_dir": "runs/tiny", "flow_seconds": 1, "elapsed_seconds": 2,
        "verbatim_audit": {"span": 10, "extra_sources": "flow run x", "total_hits": 0, "files_with_hits": []},
    }
    assert "ledger ε = 2.07 (replace-one 3.17), δ = 7e-05" in format_canary_report(report)
    del report["epsilon_total_replace_one"]  # a canaries.json written before
    assert "ledger ε = 2.07, δ = 7e-05" in format_canary_report(report)


def test_canary_cli_on_the_tiny_flow_and_audit_with_prefect_logs(prefect_server, tmp_path, capsys):
    """`audit --canaries` runs the real flow on a canaried copy and writes canaries.json
    (exposure per canary and model, ledger ε, the run's verbatim audit; no secret in it or
    on stdout); the copy lives 0600 in a 0700 work directory, deleted at the end; the run's
    models carry cards with the ledger's figures; the plain audit reads the flow run's
    Prefect logs and finds a training record planted in them, through the API and from the
    server's database, every artifact of the real flow read."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_pipeline_dict(tmp_path)))
    work, seen, stop = tmp_path / "elsewhere" / "canaries", {}, threading.Event()
    watcher = threading.Thread(target=_watch_modes, args=(work, seen, stop), daemon=True)
    old_umask = os.umask(0o022)
    watcher.start()
    try:  # the split copies kept, so that the plain audit below can read the canaried records
        code = main(["audit", "--canaries", "2", "--config", str(config), "--candidates", "50",
                     "--repetitions", "1,8", "--work-dir", str(work), "data.keep_private_copies=true"])
    finally:
        stop.set()
        watcher.join()
        os.umask(old_umask)
    out = capsys.readouterr().out
    assert code == 0
    assert not work.exists()
    assert seen["."] == 0o700 and seen[f"{YELP_TRAIN.stem}_with_canaries.parquet"] == 0o600
    assert set(seen) == {".", f"{YELP_TRAIN.stem}_with_canaries.parquet"}  # nothing else, the run neither
    written = Path(out.strip().splitlines()[-1].split("written: ")[1])
    report = json.loads(written.read_text())
    run = Path(report["run_dir"])
    assert written.parent == run and run.parent == tmp_path / "runs" and run.name.startswith("tiny-canaries-")
    assert report["canaries"] == 2 and report["records_added"] == 9
    assert report["verbatim_audit"]["total_hits"] == 0 and report["verbatim_audit"]["extra_sources"].startswith("flow run")
    assert set(report["models"]) == {"base_teacher", "dp_teacher", "base_student", "student"}
    assert all(0 <= r["exposure"]["dp_teacher"] <= report["max_exposure_bits"] for r in report["per_canary"])
    assert set(report["by_repetitions"]) == {"1", "8"}
    ledger = read_ledger(run / "ledger.json")
    assert report["epsilon_total"] == pytest.approx(ledger.total.epsilon)
    assert report["epsilon_total_replace_one"] == pytest.approx(ledger.total.epsilon_replace_one)
    kept = [t for split in ("train", "validation") for t in read_split(run / "data" / f"{split}.parquet")[1]]
    digits = {"".join(words(t)[4:]) for t in kept if t.startswith("my account number is")}
    assert len(digits) == 2
    for d in digits:
        assert d not in written.read_text() and " ".join(d) not in out and d not in out

    teacher = ledger.entry("teacher")
    for model in ("teacher", "student"):
        card = (run / model / "model" / CARD).read_text()
        for value in (teacher.epsilon, teacher.noise_multiplier, teacher.sample_rate, ledger.total.epsilon):
            assert fmt_value(value) in card or f"{value:.4g}" in card
        assert f"| steps | {teacher.steps} |" in card

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.types import DateTime

    assert main(["audit", str(run)]) == 0  # the tiny DP teacher emits no 10-word training span
    audit = json.loads((run / AUDIT).read_text())
    assert audit["extra_sources"].startswith("flow run") and audit["files"]["prefect:logs"]["spans"] > 0
    flow_run_id = json.loads((run / "run.json").read_text())["flow_run_id"]
    secret = next(t for t in training_texts(run)[0] if len(words(t)) >= 15)
    with get_client(sync_client=True) as client:
        client.create_logs([LogCreate(name="x", level=20, message=secret, timestamp=DateTime.now("UTC"),
                                      flow_run_id=flow_run_id)])
    assert main(["audit", str(run)]) == 1
    out, err = capsys.readouterr()
    assert json.loads((run / AUDIT).read_text())["files_with_hits"] == ["prefect:logs"]
    _assert_not_quoted(secret, out, err, (run / AUDIT).read_text())
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # the same run read from the database
        assert main(["audit", str(run)]) == 1
    audit = json.loads((run / AUDIT).read_text())
    assert audit["files_with_hits"] == ["prefect:logs"] and audit["incomplete"] == {}
    assert "database" in audit["extra_sources"] and any(k.endswith("-progress") for k in audit["files"])


def test_model_card_of_a_dp_student_states_its_own_stage():
    """dp_sgd / dpkd: the student's card reads the `student` entry (its own DP-SGD), not the teacher's."""
    teacher = _ledger(codes_private=True).entry("teacher")
    student = teacher.model_copy(update={"stage": "student", "epsilon": 0.9, "noise_multiplier": 2.345, "steps": 77})
    entries = [teacher.model_copy(update={"epsilon": 0.95}), student, post_processing("evaluation", "aggregates")]
    ledger = PrivacyLedger(entries=entries, total=compose(entries, "prv", 6.9e-4))
    card = model_card(ledger, "student")
    assert "`student` in the run's `ledger.json`" in card and "| noise multiplier σ | 2.345 |" in card
    assert "| steps | 77 |" in card and "DP student" in card


def test_canaries_in_several_text_columns_with_named_codes_are_the_records_the_data_stage_builds(tmp_path):
    """A canary's control code and text, as the exposure test scores them, are what the data
    stage makes of its inserted rows (joined text columns, data.code_values applied)."""
    source = pa.table({"title": ["a title"] * 8, "body": ["a body"] * 8, "label": ["1", "2"] * 4})
    cfg = DataConfig(path=tmp_path / "with-canaries.parquet", text_column=["title", "body"], code_columns=["label"],
                     code_template="Topic: {value}", code_values={"label": {"1": "World", "2": "Sports"}},
                     validation_fraction=0.0, test_fraction=0.2)
    [canary] = make_canaries(1, source, cfg, repetitions=(3,))
    assert write_canary_data(source, [canary], cfg, cfg.path) == 3
    res = prepare_data(cfg, tmp_path / "data")
    records = list(zip(*read_split(res.train))) + list(zip(*read_split(res.test)))
    assert records.count((canary.control_code(cfg), canary.text)) == 3
    assert canary.control_code(cfg) in ("Topic: World", "Topic: Sports")
