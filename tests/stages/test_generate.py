"""Stage 2: control-code sampling and synthetic generation with a tiny random teacher."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config import GenerateConfig
from pipeline.prompts import header
from pipeline.stages.generate import GenerateError, generate_synthetic, read_synthetic
from pipeline.stages.sampling import SCHEMA, _validation_positions, sample_control_codes
from pipeline.privacy.ledger import LedgerEntry
from pipeline.models.base import load_tokenizer

CODES = {"Category: A\tStars: 5": 6, "Category: B\tStars: 1": 3, "Category: C": 1}


def _codes_file(tmp_path, counts):
    path = tmp_path / "control_codes.json"
    path.write_text(
        json.dumps(
            {
                "columns": ["label1", "label2"],
                "private": False,
                "note": "exact counts of the control codes in the private training split",
                "counts": counts,
            }
        )
    )
    return path


def _ledger():
    return [
        LedgerEntry(
            stage="teacher",
            private=True,
            epsilon=2.0,
            delta=1e-3,
            accountant="prv",
            noise_multiplier=1.1,
            sample_rate=0.1,
            steps=30,
            max_grad_norm=1.0,
            privacy_unit="record",
            note="DP-SGD",
        )
    ]


def _generate(tmp_path, model_dir, counts, *, seed, out="gen", **cfg):
    return generate_synthetic(
        GenerateConfig(**cfg),
        teacher_dir=model_dir,
        control_codes_path=_codes_file(tmp_path, counts),
        ledger=_ledger(),
        out_dir=tmp_path / out,
        seed=seed,
    )


def test_sample_control_codes_follows_counts():
    """20k draws from counts 600/300/100 match the frequencies (±0.02, chi-square p > 0.001)."""
    counts = {"a": 600, "b": 300, "c": 100}
    n = 20_000
    draws = sample_control_codes(counts, n, np.random.default_rng(0))
    assert len(draws) == n
    seen = Counter(draws)
    assert set(seen) == set(counts)
    total = sum(counts.values())
    for code, c in counts.items():
        assert abs(seen[code] / n - c / total) < 0.02, code
    stats = pytest.importorskip("scipy.stats")
    observed = [seen[c] for c in sorted(counts)]
    expected = [n * counts[c] / total for c in sorted(counts)]
    assert stats.chisquare(observed, expected).pvalue > 0.001


def test_sample_control_codes_rejects_empty_counts():
    """Empty counts raise ValueError instead of sampling nothing."""
    with pytest.raises(ValueError, match="empty"):
        sample_control_codes({}, 5, np.random.default_rng(0))


def test_generate_synthetic_writes_well_formed_parquet(tmp_path, tiny_model_dir):
    """Generation writes the schema, prompt-prefixed token ids within max_length, metadata and manifest."""
    res = _generate(tmp_path, tiny_model_dir, CODES, seed=0, num_samples=40, batch_size=16, max_length=32)
    assert res.path.is_dir() and res.shards == [res.path / "shard-00000.parquet"]
    assert (res.path / "manifest.json").is_file()
    assert res.n_samples + res.n_dropped_empty == 40
    assert res.n_samples > 0

    pf = pq.ParquetFile(res.shards[0])
    table = pf.read()
    assert table.schema.remove_metadata().equals(SCHEMA)
    assert table.schema.field("control_code").type == pa.string()
    assert table.schema.field("text").type == pa.string()
    assert table.schema.field("n_tokens").type == pa.int32()
    assert table.num_rows == res.n_samples

    tok = load_tokenizer(str(tiny_model_dir))
    for row in table.to_pylist():
        assert row["control_code"] in CODES
        prompt = tok.encode(header(row["control_code"]), add_special_tokens=False)
        assert row["token_ids"][: len(prompt)] == prompt
        assert row["n_prompt_tokens"] == len(prompt)
        assert len(row["token_ids"]) == row["n_tokens"] <= 32
        assert row["text"].strip()
        assert row["finished"] == (row["token_ids"][-1] == tok.eos_token_id)

    meta = pf.schema_arrow.metadata
    assert b"dpdistill.teacher_checkpoint" in meta
    assert meta[b"dpdistill.teacher_checkpoint"].decode() == str(tiny_model_dir)
    assert b"dpdistill.ledger" in meta
    ledger = [LedgerEntry.model_validate(e) for e in json.loads(meta[b"dpdistill.ledger"])]
    assert ledger == _ledger()


def test_generation_is_deterministic_per_seed(tmp_path, tiny_model_dir):
    """The same seed gives identical rows; another seed gives different texts."""
    kw = dict(num_samples=16, batch_size=8, max_length=24)
    a = read_synthetic(_generate(tmp_path, tiny_model_dir, CODES, seed=1, out="a", **kw).path)
    b = read_synthetic(_generate(tmp_path, tiny_model_dir, CODES, seed=1, out="b", **kw).path)
    c = read_synthetic(_generate(tmp_path, tiny_model_dir, CODES, seed=2, out="c", **kw).path)
    assert a.to_pylist() == b.to_pylist()
    assert a["text"].to_pylist() != c["text"].to_pylist()


def test_generated_code_frequencies_follow_counts(tmp_path, tiny_model_dir):
    """With counts A:3, B:1 the requested and generated shares of A are near 0.75."""
    counts = {"Category: A": 3, "Category: B": 1}
    res = _generate(tmp_path, tiny_model_dir, counts, seed=0, num_samples=200, batch_size=64, max_length=16)
    assert set(res.requested_codes) <= set(counts)
    assert abs(res.requested_codes["Category: A"] - 0.75) < 0.1
    table = read_synthetic(res.path)
    codes = table["control_code"].to_pylist()
    assert len(codes) == res.n_samples
    assert res.n_samples + res.n_dropped_empty == 200
    share_a = codes.count("Category: A") / len(codes)
    assert res.generated_codes["Category: A"] == pytest.approx(share_a)
    assert abs(share_a - 0.75) < 0.1


def test_shards_resume_after_a_crash_and_are_deterministic(tmp_path, tiny_model_dir):
    """3 shards; one lost (a crash before it was written) is regenerated identically, the
    others are reused untouched; a shard does not depend on the shard size of its neighbours."""
    kw = dict(num_samples=30, shard_size=10, batch_size=8, max_length=24)
    first = _generate(tmp_path, tiny_model_dir, CODES, seed=3, **kw)
    assert [p.name for p in first.shards] == ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    before = {p.name: (p.stat().st_mtime_ns, read_synthetic(p).to_pylist()) for p in first.shards}
    first.shards[1].unlink()
    (first.path / "manifest.json").unlink()
    again = _generate(tmp_path, tiny_model_dir, CODES, seed=3, **kw)
    assert again.resumed_shards == 2
    for p in again.shards:
        assert read_synthetic(p).to_pylist() == before[p.name][1]
        if p.name != "shard-00001.parquet":
            assert p.stat().st_mtime_ns == before[p.name][0]  # reused, not rewritten
    assert again.n_samples == first.n_samples and again.requested_codes == first.requested_codes
    ids = read_synthetic(again.path)["sample_id"].to_pylist()
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and max(ids) < 30


def test_shards_of_another_generation_are_refused(tmp_path, tiny_model_dir):
    """A directory holding shards of another config is never silently mixed with new ones."""
    _generate(tmp_path, tiny_model_dir, CODES, seed=0, num_samples=8, batch_size=8, max_length=24)
    with pytest.raises(GenerateError, match="another generation"):
        _generate(tmp_path, tiny_model_dir, CODES, seed=0, num_samples=8, batch_size=8, max_length=24, top_k=5)


def test_validation_split_and_generation_options(tmp_path, tiny_model_dir):
    """validation_fraction marks samples; samples_per_prompt repeats prompts; max_new_tokens caps."""
    res = _generate(tmp_path, tiny_model_dir, {f"Category: {c}": 1 for c in "ABCDEFGH"}, seed=0,
                    num_samples=60, batch_size=32, max_length=40, validation_fraction=0.3,
                    samples_per_prompt=3, max_new_tokens=4, no_repeat_ngram_size=2)
    table = read_synthetic(res.path)
    assert res.n_validation == table["split"].to_pylist().count("validation") > 0
    assert len(read_synthetic(res.path, split="train")) == res.n_samples - res.n_validation
    new = [n - p for n, p in zip(table["n_tokens"].to_pylist(), table["n_prompt_tokens"].to_pylist())]
    assert max(new) <= 4 + 1  # + the end-of-text token when a sample finished
    # three samples per drawn prompt: consecutive ids share their control code
    rows = sorted(zip(table["sample_id"].to_pylist(), table["control_code"].to_pylist()))
    codes = dict(rows)
    assert all(codes[i] == codes[i - i % 3] for i in codes if i - i % 3 in codes)


@pytest.mark.parametrize(("kept", "fraction", "expected"), [
    (0, 0.01, 0), (1, 0.3, 0), (2, 0.01, 1), (20, 0.01, 1), (101, 0.01, 2), (20, 0.0, 0), (3, 0.49, 2),
])
def test_validation_share_is_rounded_up_and_leaves_training_samples(kept, fraction, expected):
    chosen = _validation_positions(list(range(100, 100 + kept)), fraction, np.random.default_rng(0))
    assert len(chosen) == expected and chosen <= set(range(100, 100 + kept))
    assert kept - len(chosen) >= min(kept, 1)  # never every sample of a shard


def test_twenty_samples_at_the_default_fraction_keep_one_for_validation(tmp_path, tiny_model_dir):
    """20 samples at 1% gave 0 validation samples, so distillation never evaluated."""
    res = _generate(tmp_path, tiny_model_dir, CODES, seed=0, num_samples=20, batch_size=20, max_length=24)
    assert GenerateConfig.model_fields["validation_fraction"].default == 0.01
    assert res.n_samples >= 2 and res.n_validation == 1
    assert read_synthetic(res.path)["split"].to_pylist().count("validation") == 1


def test_the_hf_engine_keeps_the_fingerprint_shards_had_before_engines():
    """Shards written before generate.engine existed (by HF's generate) stay resumable with
    engine=hf; the fast engine, whose samples differ, is another generation."""
    import hashlib

    from pipeline.stages.generate import _fingerprint

    cfg = GenerateConfig(engine="hf")
    # the fields that did not exist then (engine, dask_address) are left out as they were absent
    before = {"config": cfg.model_dump(mode="json", exclude={"shard_size", "workers", "dask_address", "engine"}),
              "teacher": "t",
              "codes": "c", "seed": 0, "shard_size": cfg.shard_size, "format": 3}  # the spec as it was
    assert _fingerprint(cfg, "t", "c", 0) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    assert _fingerprint(GenerateConfig(engine="fast"), "t", "c", 0) != _fingerprint(cfg, "t", "c", 0)


def test_a_llama_teacher_generates_with_the_default_engine(tmp_path, tiny_tokenizer):
    """The fast engine is the default for every causal LM (issue 35): a tiny Llama teacher with
    grouped-query attention writes well-formed shards with it; no GPT-2-only refusal."""
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = tiny_tokenizer.eos_token_id
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tiny_tokenizer.save_pretrained(tmp_path / "llama")
    res = _generate(tmp_path, tmp_path / "llama", CODES, seed=0, num_samples=12, batch_size=4, max_length=48)
    assert GenerateConfig().engine == "fast" and res.n_samples + res.n_dropped_empty == 12
    for row in read_synthetic(res.path).to_pylist():
        assert row["n_prompt_tokens"] < row["n_tokens"] <= 48


def test_a_teacher_the_fast_engine_cannot_decode_is_refused_before_sampling(tmp_path, tiny_model_dir):
    """An encoder-decoder teacher: refused when generation is planned, naming its type and the
    generate.engine=hf fix (pipeline.models.decoding.fast_decode_problem, from its config)."""
    from transformers import T5Config

    teacher = tmp_path / "t5"
    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8).save_pretrained(teacher)
    with pytest.raises(GenerateError, match="'t5' is an encoder-decoder model.*set generate.engine=hf"):
        _generate(tmp_path, teacher, CODES, seed=0, num_samples=4, batch_size=4, max_length=32)
