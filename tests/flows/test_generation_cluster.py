"""Generation on an existing Dask cluster (`generate.dask_address`): a scheduler and two workers
started the way docs/operations.md says, as separate processes on 127.0.0.1. The pipeline's
generation stage run there writes the in-process shards and is cached for the next run; a
worker killed mid-shard loses and duplicates nothing; a worker that cannot read the teacher is
refused before any shard is written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from distributed import Client
from prefect import flow, task

from flows.generation import generate_with_workers
from flows.stage_runner import StageRunner
from flows.tasks import generation_task
from pipeline.config import GenerateConfig
from pipeline.manifest import write_manifest
from pipeline.privacy.control_codes import CodesResult
from pipeline.privacy.ledger import LedgerEntry
from pipeline.stages.generate import GenerateError, GenerateResult, generate_synthetic, read_synthetic
from pipeline.stages.teacher.state import TeacherResult

ROOT = Path(__file__).resolve().parents[2]
DASK = Path(sys.executable).parent / "dask"  # the venv's CLI, as on every node
CODES = {"Category: A\tStars: 5": 6, "Category: B\tStars: 1": 3, "Category: C": 1}
CFG = dict(num_samples=48, shard_size=12, batch_size=6, max_length=24, validation_fraction=0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """The process and its children (a worker's nanny spawns the worker): its own process group."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def dask_cluster(tmp_path, request):
    """start(cwds) -> (scheduler address, worker processes): a scheduler and one 1-thread worker
    process per entry of `cwds` (its working directory), all on 127.0.0.1, all stopped at the
    end of the test, failed or not."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DASK_SCHEDULER_ADDRESS", None)

    def spawn(args: list[str], cwd: Path, log: str) -> subprocess.Popen:
        with open(tmp_path / log, "wb") as out:
            proc = subprocess.Popen([str(DASK), *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        request.addfinalizer(lambda: _stop(proc))
        return proc

    def start(cwds: list[Path]) -> tuple[str, list[subprocess.Popen]]:
        address = f"tcp://127.0.0.1:{_free_port()}"
        spawn(["scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1], "--no-dashboard",
               "--dashboard-address", "127.0.0.1:0"],  # its HTTP server (health, metrics) still runs
              ROOT, "scheduler.log")
        workers = [spawn(["worker", address, "--host", "127.0.0.1", "--nworkers", "1", "--nthreads", "1",
                          "--no-dashboard"], cwd, f"worker-{i}.log") for i, cwd in enumerate(cwds)]
        with Client(address, timeout=60) as client:
            client.wait_for_workers(len(cwds), timeout=120)
        return address, workers

    return start


@task(name="generation")
def _generation_task(cfg: GenerateConfig, kw: dict) -> GenerateResult:
    return generate_with_workers(cfg, **kw)  # the way the pipeline flow calls it


@flow(name="generation-cluster-test", persist_result=False, validate_parameters=False)
def _generation_flow(cfg: GenerateConfig, kw: dict) -> GenerateResult:
    return _generation_task(cfg, kw)


@flow(name="generation-stage-test", persist_result=False, validate_parameters=False)
def _generation_stage(cfg, teacher: TeacherResult, codes: CodesResult, run_dir: Path) -> tuple[str, GenerateResult]:
    """The pipeline's generation stage alone: its task, cache key and result store. Returns its
    status in stages.json ("ran", "cached") and its result."""
    run_dir.mkdir(parents=True, exist_ok=True)
    runner = StageRunner(cfg, run_dir, [])
    result = runner("generation", generation_task, cfg, teacher, codes, [], run_dir)
    return runner.stages["generation"]["status"], result


def _finished_stages(tmp_path: Path, model_dir: Path) -> tuple[TeacherResult, CodesResult]:
    """A DP teacher and released control codes as their stages leave them (files and manifests)."""
    shutil.copytree(model_dir, tmp_path / "teacher" / "model")
    write_manifest(tmp_path / "teacher", stage="teacher", inputs={}, outputs={"model": tmp_path / "teacher" / "model"})
    (tmp_path / "control_codes").mkdir()
    codes = _codes(tmp_path / "control_codes")
    write_manifest(tmp_path / "control_codes", stage="control-codes", inputs={}, outputs={"codes": codes})
    return (TeacherResult(checkpoint=tmp_path / "teacher" / "model",
                          ledger=LedgerEntry(stage="teacher", private=True, epsilon=1.0, note="DP-SGD")),
            CodesResult(path=codes, ledger=LedgerEntry(stage="control-codes", private=True, epsilon=0.5,
                                                       note="DP histogram")))


def _codes(tmp_path: Path) -> Path:
    path = tmp_path / "control_codes.json"
    path.write_text(json.dumps({"columns": ["label1", "label2"], "private": False, "note": "", "counts": CODES}))
    return path


def _shard(path):
    """A shard's rows and its metadata, less the per-shard timing."""
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    stats = json.loads(meta.pop(b"dpdistill.shard_stats"))
    stats.pop("seconds")
    return table.replace_schema_metadata(None), meta, stats


def _assert_same_shards(one: GenerateResult, other: GenerateResult) -> None:
    assert [p.name for p in other.shards] == [p.name for p in one.shards]
    for a, b in zip(one.shards, other.shards):
        rows_a, meta_a, stats_a = _shard(a)
        rows_b, meta_b, stats_b = _shard(b)
        assert rows_b.num_rows > 0 and rows_a.equals(rows_b), a.name  # ids, token ids, texts, splits
        assert meta_a == meta_b and stats_a == stats_b, a.name


def test_cluster_stage_writes_the_in_process_shards_and_is_cached(prefect_server, dask_cluster, tmp_path,
                                                                    tiny_model_dir, tiny_config, caplog):
    """The pipeline's generation stage on a cluster writes the in-process shards, persists its
    GenerateResult in the stage cache (issue 35: "Encountered an error while persisting result:
    Failed to serialize object of type 'list'", and the next run generated everything again) and
    is cached on the next run."""
    address, _ = dask_cluster([ROOT, ROOT])
    teacher, codes = _finished_stages(tmp_path, tiny_model_dir)
    cfg = tiny_config.model_copy(update={"generate": GenerateConfig(**CFG, dask_address=address), "seed": 7})
    one = generate_synthetic(GenerateConfig(**CFG), teacher_dir=teacher.checkpoint, control_codes_path=codes.path,
                             ledger=[], seed=7, out_dir=tmp_path / "one")
    caplog.set_level("WARNING")
    status, cluster = _generation_stage(cfg, teacher, codes, cfg.run_root / "first")
    assert status == "ran"

    assert len(cluster.shards) == 4
    _assert_same_shards(one, cluster)
    manifest = json.loads((cluster.path / "manifest.json").read_text())
    assert manifest["processes"] == 2  # both workers of the cluster wrote shards, none this process
    assert not [r.getMessage() for r in caplog.records if "persisting result" in r.getMessage()]

    written = {p: p.stat().st_mtime_ns for p in cluster.shards}
    status, again = _generation_stage(cfg, teacher, codes, cfg.run_root / "second")
    assert status == "cached" and again == cluster  # the first run's shards, not generated again
    assert {p: p.stat().st_mtime_ns for p in cluster.shards} == written
    assert not (cfg.run_root / "second" / "synthetic").exists()


# 4 shards of 24 samples, 2 per batch, up to 40 new tokens each: a shard takes a second or more,
# long enough to kill a worker in the middle of one.
SLOW = dict(num_samples=96, shard_size=24, batch_size=2, max_length=48, validation_fraction=0.2)


def _kill_mid_shard(out_dir: Path, workers: list[subprocess.Popen], killed: list[int], stop: threading.Event):
    """SIGKILL the worker (its whole process group: nanny and worker, like a lost node) that
    reports a shard under way, before half of it is done."""
    groups = {w.pid for w in workers}
    while not stop.is_set() and not killed:
        for progress in out_dir.glob(".progress-*.json"):
            try:
                counts = json.loads(progress.read_text())
            except (OSError, ValueError):
                continue  # removed meanwhile: the shard just finished
            shard = int(progress.stem.split("-")[1])
            if 0 < counts["samples"] < SLOW["shard_size"] // 2 and not (out_dir / f"shard-{shard:05d}.parquet").exists():
                group = os.getpgid(counts["pid"])
                assert group in groups, "the shard runs in one of the cluster's workers"
                os.killpg(group, signal.SIGKILL)
                killed.append(shard)
                return
        time.sleep(0.02)


def test_worker_killed_mid_shard_loses_and_duplicates_nothing(prefect_server, dask_cluster, tmp_path,
                                                              tiny_model_dir):
    address, workers = dask_cluster([ROOT, ROOT])
    kw = dict(teacher_dir=tiny_model_dir, control_codes_path=_codes(tmp_path), ledger=[], seed=3)
    one = generate_synthetic(GenerateConfig(**SLOW), **kw, out_dir=tmp_path / "one")
    out = tmp_path / "cluster"
    out.mkdir()
    # what a worker killed inside pq.write_table leaves: half a Parquet file under its temporary name
    half = out / ".shard-00001.parquet.0123456789abcdef0123456789abcdef.tmp"
    half.write_bytes(one.shards[1].read_bytes()[:500])

    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_mid_shard, args=(out, workers, killed, stop), daemon=True)
    killer.start()
    try:
        state = _generation_flow(GenerateConfig(**SLOW, dask_address=address), {**kw, "out_dir": out},
                                 return_state=True)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was caught in the middle of a shard"
    assert state.is_completed()
    cluster = state.result()

    ids = read_synthetic(cluster.path)["sample_id"].to_pylist()
    assert len(ids) == len(set(ids)) == cluster.n_samples  # nothing written twice
    assert ids == read_synthetic(one.path)["sample_id"].to_pylist()  # nothing lost (empty ones are dropped alike)
    assert cluster.n_samples + cluster.n_dropped_empty == SLOW["num_samples"]
    _assert_same_shards(one, cluster)
    assert not list(out.glob(".shard-*.tmp")) and not list(out.glob(".progress-*"))


def test_worker_that_cannot_read_the_teacher_is_refused(dask_cluster, tmp_path, tiny_model_dir, monkeypatch):
    # A relative teacher path: the worker started in the flow's directory reads it, the one
    # started elsewhere does not (as a node without the shared mount would not).
    shutil.copytree(tiny_model_dir, tmp_path / "teacher")
    (tmp_path / "elsewhere").mkdir()
    address, _ = dask_cluster([tmp_path, tmp_path / "elsewhere"])
    with Client(address) as client:
        cwds = client.run(os.getcwd)
    blind = next(w for w, cwd in cwds.items() if cwd.endswith("elsewhere"))
    monkeypatch.chdir(tmp_path)

    with pytest.raises(GenerateError) as e:
        generate_with_workers(GenerateConfig(**CFG, dask_address=address), teacher_dir=Path("teacher"),
                              control_codes_path=_codes(tmp_path), ledger=[], out_dir=tmp_path / "synthetic", seed=7)
    message = str(e.value)
    assert f"1 of the 2 Dask workers at generate.dask_address={address}" in message
    assert blind in message and "cannot read the teacher checkpoint teacher" in message
    assert "same path on every worker node" in message
    assert len(message.splitlines()) == 3  # only the blind worker is named
    assert not list((tmp_path / "synthetic").iterdir())  # no shard, no progress, no check file left
