"""Stage results in Prefect's cache are our JSON only: a planted pickle never runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect import flow
from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
from prefect.serializers import PickleSerializer

from flows.caching import RESULTS_DIR
from flows.stage_runner import StageRunner
from flows.tasks import data_task, source_hashes
from flows.results import (
    StageResultSerializer, UntrustedResultError, check_record, decode_result, encode_result,
)
from pipeline.privacy.ledger import LedgerEntry
from pipeline.stages.teacher.state import TeacherResult


class _Payload:
    """What an attacker plants: unpickling it creates `marker` (stands for any code)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_stage_results_round_trip_as_json():
    entry = LedgerEntry(stage="teacher", private=True, epsilon=1.0, history=[(1.0, 0.1, 3)], note="DP-SGD")
    result = TeacherResult(checkpoint=Path("/runs/x/teacher/model"), ledger=entry)  # teacher.monitor=none
    blob = encode_result(result)
    json.loads(blob)  # plain JSON
    back = decode_result(blob)
    assert back.checkpoint == result.checkpoint and back.ledger == entry
    assert back.validation_loss is None and back.validation_curve == [] and back.monitor_ledger is None
    released = LedgerEntry(stage="teacher-validation", private=True, epsilon=0.5, history=[(9.0, 1.0, 2)],
                           mechanism="gaussian", note="noisy validation loss")  # teacher.monitor=dp
    dp = TeacherResult(checkpoint=result.checkpoint, ledger=entry, validation_curve=[(2, 2.0)], validation_loss=2.0,
                       monitor_ledger=released)
    back = decode_result(encode_result(dp))
    assert back.validation_curve == [(2, 2.0)] and back.validation_loss == 2.0 and back.monitor_ledger == released
    assert decode_result(encode_result({"perplexity": {"a": 1.5}})) == {"perplexity": {"a": 1.5}}
    assert decode_result(encode_result(None)) is None
    with pytest.raises(TypeError, match="not a stage result type"):
        encode_result(_Payload(Path("x")))
    with pytest.raises(UntrustedResultError):
        decode_result(b'{"type": "os.system", "value": "echo"}')


@pytest.mark.parametrize("serializer", [
    {"type": "pickle", "picklelib": "cloudpickle"},
    {"type": "json", "jsonlib": "json", "object_decoder": "os.system"},  # Prefect's JSON imports names
])
def test_records_naming_another_serializer_are_refused(serializer):
    record = {"metadata": {"serializer": serializer, "storage_key": "k"}, "result": "e30="}
    with pytest.raises(UntrustedResultError, match="names serializer"):
        check_record(json.dumps(record).encode())
    with pytest.raises(UntrustedResultError):  # the old format's top-level serializer wins in Prefect
        check_record(json.dumps(record | {"serializer": serializer}).encode())
    with pytest.raises(UntrustedResultError):
        check_record(b"\x80\x04not json")
    ours = {"metadata": {"serializer": StageResultSerializer().model_dump(), "storage_key": "k"}, "result": "{}"}
    check_record(json.dumps(ours).encode())


@flow(persist_result=False)
def _data_stage(cfg, run_dir: str):
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    runner = StageRunner(cfg, run, [])
    runner("data", data_task, cfg, source_hashes(cfg), run)
    return runner.stages["data"]["status"]


def test_planted_pickle_result_does_not_run(prefect_server, tiny_config, tmp_path):
    """A cloudpickle record planted under the exact key the next run reads is refused before
    it is decoded: the payload never runs, the stage runs again and overwrites the record."""
    # Splits kept: a later run may then reuse them (deleted ones are always written again).
    cfg = tiny_config.model_copy(update={"data": tiny_config.data.model_copy(update={"keep_private_copies": True})})
    run = cfg.run_root / "tiny-1"
    key = data_task.cache_policy.compute_key(None, {"cfg": cfg, "sources": source_hashes(cfg), "run_dir": run}, {})
    store = cfg.run_root / RESULTS_DIR
    store.mkdir(parents=True)
    marker = tmp_path / "pwned"
    planted = ResultRecord(
        metadata=ResultRecordMetadata(serializer=PickleSerializer(picklelib="cloudpickle"), storage_key=key),
        result=_Payload(marker),
    )
    (store / key).write_bytes(planted.serialize())

    assert _data_stage(cfg, str(run)) == "ran"
    assert not marker.exists(), "the planted pickle was unpickled"
    check_record((store / key).read_bytes())  # replaced by our own JSON record
    assert (store / key).stat().st_mode & 0o777 == 0o600
    assert _data_stage(cfg, str(cfg.run_root / "tiny-2")) == "cached"  # and our record is read back


def test_records_are_written_whole_and_private(tmp_path):
    """A record replaces the old one by rename (a run killed mid-write, or a reader in another
    process, never sees half of one), 0600; a planted symlink out of the store is refused."""
    from flows.results import stage_result_storage

    storage = stage_result_storage(tmp_path / "results")
    storage.write_path("key-1", b"old")
    storage.write_path("key-1", b"new")
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    (tmp_path / "results" / "key-2").symlink_to(outside)
    with pytest.raises(ValueError, match="outside of the base path"):  # Prefect's own check
        storage.write_path("key-2", b"record")
    results = tmp_path / "results"
    assert sorted(p.name for p in results.iterdir()) == ["key-1", "key-2"]  # no temp file left
    assert (results / "key-1").read_bytes() == b"new" and (results / "key-1").stat().st_mode & 0o777 == 0o600
    assert outside.read_bytes() == b"keep"


def test_a_run_never_reads_splits_another_run_deletes(prefect_server, tiny_config):
    """Private splits are deleted when their run ends (data.keep_private_copies=false, the
    default), maybe while a second run started beside it still reads them (seen in issue 12's
    experiment: a DP student lost its validation split): a run reuses only its own."""
    cfg = tiny_config
    assert not cfg.data.keep_private_copies
    assert _data_stage(cfg, str(cfg.run_root / "tiny-1")) == "ran"
    assert _data_stage(cfg, str(cfg.run_root / "tiny-2")) == "ran"  # not tiny-1's splits
    assert (cfg.run_root / "tiny-2" / "data" / "train.parquet").is_file()
    assert _data_stage(cfg, str(cfg.run_root / "tiny-2")) == "cached"  # its own: a continued run reuses them
