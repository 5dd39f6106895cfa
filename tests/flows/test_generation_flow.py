"""Generation scaled out: shards mapped over 2 local Dask worker processes under Prefect are the
shards one in-process worker writes for the same seed, and either resumes the other."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from prefect import flow, task

from flows.generation import generate_with_workers
from pipeline.config import GenerateConfig
from pipeline.stages.generate import GenerateResult, generate_synthetic

CODES = {"Category: A\tStars: 5": 6, "Category: B\tStars: 1": 3, "Category: C": 1}
CFG = dict(num_samples=48, shard_size=12, batch_size=6, max_length=24, validation_fraction=0.2)


@task(name="generation")
def _generation_task(cfg: GenerateConfig, kw: dict, progress: list) -> GenerateResult:
    return generate_with_workers(cfg, **kw, on_progress=progress.append)  # the way the pipeline flow calls it


@flow(name="generation-test", persist_result=False, validate_parameters=False)
def _generation_flow(cfg: GenerateConfig, kw: dict, progress: list) -> GenerateResult:
    return _generation_task(cfg, kw, progress)


def _shard(path):
    """A shard's rows and its metadata, less the per-shard timing."""
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    stats = json.loads(meta.pop(b"dpdistill.shard_stats"))
    stats.pop("seconds")
    return table.replace_schema_metadata(None), meta, stats


def test_two_workers_write_the_shards_of_one(prefect_server, tmp_path, tiny_model_dir):
    codes = tmp_path / "control_codes.json"
    codes.write_text(json.dumps({"columns": ["label1", "label2"], "private": False, "note": "", "counts": CODES}))

    def kw(out):
        return dict(teacher_dir=tiny_model_dir, control_codes_path=codes, ledger=[], out_dir=tmp_path / out, seed=7)

    one = generate_synthetic(GenerateConfig(**CFG), **kw("one"))  # the library, in this process
    progress: list[dict] = []
    state = _generation_flow(GenerateConfig(**CFG, workers=2), kw("two"), progress, return_state=True)
    assert state.is_completed()
    two = state.result()

    assert [p.name for p in two.shards] == [p.name for p in one.shards] and len(two.shards) == 4
    for a, b in zip(one.shards, two.shards):
        rows_a, meta_a, stats_a = _shard(a)
        rows_b, meta_b, stats_b = _shard(b)
        assert rows_b.num_rows > 0 and rows_a.equals(rows_b), a.name
        assert meta_a == meta_b and stats_a == stats_b, a.name
    assert (two.n_samples, two.n_validation, two.n_dropped_empty) == (one.n_samples, one.n_validation,
                                                                      one.n_dropped_empty)
    assert two.requested_codes == one.requested_codes and two.generated_codes == one.generated_codes
    manifest = json.loads((two.path / "manifest.json").read_text())
    assert manifest["processes"] == 2 and manifest["resumed_shards"] == 0  # both workers wrote shards
    # samples done, from the workers' batches (polled) and their finished shards, never backwards
    done = [p["done"] for p in progress]
    assert done == sorted(done) and done[-1] == 48 and progress[-1]["shards_done"] == 4

    # A shard lost after the 2-worker run is written again by the in-process path, identically;
    # the other three are reused: the worker count is not part of the generation's identity.
    lost = two.shards[2]
    before = _shard(lost)[0]
    lost.unlink()
    again = _generation_flow(GenerateConfig(**CFG, workers=1), kw("two"), [], return_state=True).result()
    assert again.resumed_shards == 3 and _shard(lost)[0].equals(before)
    assert json.loads((two.path / "manifest.json").read_text())["processes"] == 1
