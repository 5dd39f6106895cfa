"""The shard contract of docs/operations.md ("Generation engine"): shards written by another
engine (a vLLM image, say), following only that description, are taken by the generation stage
as finished and read by distillation like its own."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import GenerateConfig
from pipeline.prompts import header
from pipeline.stages.generate import generate_synthetic, plan_generation, read_synthetic
from pipeline.stages.sampling import SCHEMA
from pipeline.models.base import load_tokenizer
from test_generate import CODES, _codes_file, _ledger

# The columns as docs/operations.md lists them, written out here rather than imported from
# pipeline/stages/generate.py: if the stage's schema changes, this test and the docs must change too.
# The stage writes these types itself; another engine must write them exactly.
DOCUMENTED = pa.schema([
    ("sample_id", pa.int64()), ("split", pa.string()), ("control_code", pa.string()), ("text", pa.string()),
    ("n_tokens", pa.int32()), ("n_prompt_tokens", pa.int32()), ("token_ids", pa.list_(pa.int32())),
    ("finished", pa.bool_()),
])


def _write_like_another_engine(plan, shard: int, tok) -> None:
    """One shard the way the docs say: every sample gets the same short continuation."""
    first, n = plan.shards[shard]
    codes = sorted(plan.counts)
    new = tok.encode(" good food", add_special_tokens=False)
    rows = {name: [] for name in DOCUMENTED.names}
    for j in range(n):
        code = codes[j % len(codes)]
        prompt = tok.encode(header(code), add_special_tokens=False)
        ids = prompt + new + [tok.eos_token_id]
        for name, value in zip(DOCUMENTED.names, (first + j, "validation" if j == 0 else "train", code,
                                                  tok.decode(new), len(ids), len(prompt), ids, True)):
            rows[name].append(value)
    stats = {"requested": {c: rows["control_code"].count(c) for c in codes},
             "generated": {c: rows["control_code"].count(c) for c in codes},
             "kept": n, "validation": 1, "dropped_empty": 0, "new_tokens": n * len(new), "seconds": 1.0}
    table = pa.table(rows, schema=DOCUMENTED).replace_schema_metadata(
        plan.metadata | {"dpdistill.shard_stats": json.dumps(stats)})
    path = plan.shard_path(shard)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def test_the_documented_schema_is_the_stage_schema():
    assert SCHEMA.equals(DOCUMENTED), f"update docs/operations.md and DOCUMENTED: the stage writes {SCHEMA}"


def test_shards_written_by_another_engine_are_reused_and_read(tmp_path, tiny_model_dir):
    cfg = GenerateConfig(num_samples=7, shard_size=4, batch_size=4, max_length=24)
    kw = dict(teacher_dir=tiny_model_dir, control_codes_path=_codes_file(tmp_path, CODES), ledger=_ledger(),
              out_dir=tmp_path / "synthetic", seed=5)
    plan = plan_generation(cfg, **kw)
    assert plan.shards == ((0, 4), (4, 3))
    tok = load_tokenizer(str(tiny_model_dir))
    for shard in range(plan.n_shards):
        _write_like_another_engine(plan, shard, tok)

    result = generate_synthetic(cfg, **kw)  # what `dpdistill run --run-dir` does next

    assert result.resumed_shards == 2 and result.n_samples == 7 and result.n_validation == 2
    assert (tmp_path / "synthetic" / "manifest.json").is_file()
    train = read_synthetic(result.path, split="train")
    assert train.num_rows == 5 and train["text"].to_pylist() == [tok.decode(tok.encode(" good food"))] * 5
    assert read_synthetic(result.path, split="validation")["sample_id"].to_pylist() == [0, 4]
