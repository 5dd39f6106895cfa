"""Stage 2: the DP teacher writes synthetic records to sharded Parquet.

Prompts are control codes drawn with the released control-code distribution; sampling is
top-k / top-p with a temperature (optionally `no_repeat_ngram_size`), batched with the KV
cache, at most `max_length` tokens including the prompt. Prompts of equal token length
are batched together, so no batch needs padding.

Scale: samples are written in shards of `shard_size` (`synthetic/shard-00000.parquet`,
...), one shard in memory at a time. Shard i draws its prompts and samples from a seed
derived from (seed, i) alone, so a shard is deterministic for a given seed and shard, and
a rerun into the same directory skips every finished shard (resumable after a crash).
Each sample is marked split='train' or 'validation' (`validation_fraction`, 1% by
default: the distillation's validation split). Empty or prompt-only generations are
counted and dropped.

This stage reads only the DP teacher checkpoint and the released control-code counts,
never the private records: post-processing of DP releases (no extra privacy cost).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from pipeline.config import GenerateConfig
from pipeline.data import prompt_for, read_control_codes
from pipeline.ledger import LedgerEntry
from pipeline.manifest import sha256_file, write_manifest
from pipeline.models import load_causal_lm, load_tokenizer

log = logging.getLogger(__name__)

SHARD = "shard-{:05d}.parquet"
SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("split", pa.string()),
        ("control_code", pa.string()),
        ("text", pa.string()),
        ("n_tokens", pa.int32()),
        ("n_prompt_tokens", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
        ("finished", pa.bool_()),
    ]
)


class GenerateError(ValueError):
    """Generation cannot run as configured; the message says what to change."""


@dataclass(frozen=True)
class GenerateResult:
    path: Path
    """The directory holding the shards."""
    shards: list[Path]
    n_samples: int
    n_validation: int
    n_dropped_empty: int
    tokens_per_second: float
    requested_codes: dict[str, float]
    generated_codes: dict[str, float]
    resumed_shards: int = 0


def sample_control_codes(counts: dict[str, float], n: int, rng: np.random.Generator) -> list[str]:
    """Draw `n` control codes i.i.d. with the frequencies in `counts`."""
    codes = sorted(counts)
    p = np.array([counts[c] for c in codes], dtype=float)
    if len(codes) == 0 or p.sum() <= 0:
        raise ValueError("control-code counts are empty; the data stage found no training records")
    draws = rng.choice(len(codes), size=n, p=p / p.sum())
    return [codes[i] for i in draws]


def _frequencies(counts: Counter) -> dict[str, float]:
    total = sum(counts.values()) or 1
    return {c: counts[c] / total for c in sorted(counts)}


def teacher_fingerprint(teacher_dir: Path) -> str:
    weights = sorted(Path(teacher_dir).glob("*.safetensors"))
    return ",".join(sha256_file(w) for w in weights)


def _shard_seed(seed: int, shard: int) -> int:
    """A seed for shard `shard` that depends on (seed, shard) only."""
    return int(np.random.SeedSequence([seed, shard]).generate_state(1)[0])


def _generate_shard(
    model, tok, cfg: GenerateConfig, counts: dict[str, float], first_id: int, n: int, shard_seed: int
) -> tuple[dict[str, list], dict]:
    """Rows and stats of one shard of `n` samples with ids first_id, first_id + 1, ..."""
    rng = np.random.default_rng(shard_seed)
    torch.manual_seed(shard_seed)
    eos = tok.eos_token_id
    n_prompts = math.ceil(n / cfg.samples_per_prompt)
    requested = [c for c in sample_control_codes(counts, n_prompts, rng) for _ in range(cfg.samples_per_prompt)][:n]
    is_validation = rng.random(n) < cfg.validation_fraction
    prompt_ids = {c: tok.encode(prompt_for(c), add_special_tokens=False) for c in set(requested)}
    by_length: dict[int, list[int]] = defaultdict(list)  # prompt length -> sample positions
    for i, code in enumerate(requested):
        by_length[len(prompt_ids[code])].append(i)
    too_long = [p for p in by_length if p >= cfg.max_length]
    if too_long:
        raise GenerateError(
            f"control-code prompts of {max(too_long)} tokens leave no room within "
            f"generate.max_length={cfg.max_length}; raise generate.max_length"
        )

    kept: dict[int, tuple] = {}
    dropped, new_tokens = 0, 0
    for length in sorted(by_length):
        budget = cfg.max_length - length
        if cfg.max_new_tokens:
            budget = min(budget, cfg.max_new_tokens)
        positions = by_length[length]
        for start in range(0, len(positions), cfg.batch_size):
            chunk = positions[start : start + cfg.batch_size]
            input_ids = torch.tensor([prompt_ids[requested[i]] for i in chunk])  # (B, P), equal lengths
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=True,
                    top_k=cfg.top_k,
                    top_p=cfg.top_p,
                    temperature=cfg.temperature,
                    no_repeat_ngram_size=cfg.no_repeat_ngram_size or None,
                    max_new_tokens=budget,
                    use_cache=True,
                    pad_token_id=eos,
                    eos_token_id=eos,
                )  # (B, <= P + budget)
            for i, row in zip(chunk, out.tolist()):
                new = row[length:]
                finished = eos in new
                if finished:
                    new = new[: new.index(eos)]
                new_tokens += len(new)
                text = tok.decode(new, skip_special_tokens=True)
                if not text.strip():
                    dropped += 1  # prompt-only generation: counted, not kept
                    continue
                seq = prompt_ids[requested[i]] + new + ([eos] if finished else [])
                kept[i] = (text, seq, length, finished)

    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    for i in sorted(kept):
        text, seq, length, finished = kept[i]
        rows["sample_id"].append(first_id + i)
        rows["split"].append("validation" if is_validation[i] else "train")
        rows["control_code"].append(requested[i])
        rows["text"].append(text)
        rows["n_tokens"].append(len(seq))
        rows["n_prompt_tokens"].append(length)
        rows["token_ids"].append(seq)
        rows["finished"].append(finished)
    stats = {
        "requested": dict(Counter(requested)),
        "generated": dict(Counter(rows["control_code"])),
        "kept": len(kept),
        "validation": int(sum(1 for s in rows["split"] if s == "validation")),
        "dropped_empty": dropped,
        "new_tokens": new_tokens,
    }
    return rows, stats


def _fingerprint(cfg: GenerateConfig, teacher_sha: str, counts_sha: str, seed: int) -> str:
    spec = {"config": cfg.model_dump(mode="json", exclude={"shard_size"}), "teacher": teacher_sha,
            "codes": counts_sha, "seed": seed, "shard_size": cfg.shard_size, "format": 2}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _finished_shard(path: Path, fingerprint: str) -> dict | None:
    """The stats of a finished shard of this very generation, else None."""
    if not path.is_file():
        return None
    meta = pq.read_schema(path).metadata or {}
    if meta.get(b"dpdistill.fingerprint", b"").decode() != fingerprint:
        raise GenerateError(
            f"{path} was written by another generation (config, teacher, codes or seed differ); "
            "use a new run directory, or delete the synthetic/ directory to generate anew"
        )
    return json.loads(meta[b"dpdistill.shard_stats"])


def generate_synthetic(
    cfg: GenerateConfig,
    *,
    teacher_dir: Path,
    control_codes_path: Path,
    ledger: list[LedgerEntry],
    out_dir: Path,
    seed: int,
    on_progress: Callable[[dict], None] | None = None,
) -> GenerateResult:
    """Write `num_samples` synthetic records in Parquet shards; finished shards are reused.

    `on_progress` receives, after each shard, done/total shards, the samples so far and
    the throughput (aggregates only, never a text).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(str(teacher_dir))
    model = load_causal_lm(str(teacher_dir)).eval()
    n_positions = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    if cfg.max_length > n_positions:
        raise GenerateError(
            f"generate.max_length={cfg.max_length} exceeds the teacher's {n_positions} positions; "
            f"set generate.max_length <= {n_positions}"
        )
    counts = read_control_codes(control_codes_path)
    teacher_sha = teacher_fingerprint(teacher_dir)
    fingerprint = _fingerprint(cfg, teacher_sha, sha256_file(Path(control_codes_path)), seed)
    metadata = {
        "dpdistill.teacher_checkpoint": str(teacher_dir),
        "dpdistill.teacher_sha256": teacher_sha,
        "dpdistill.ledger": json.dumps([e.model_dump() for e in ledger]),
        "dpdistill.generate_config": cfg.model_dump_json(),
        "dpdistill.seed": str(seed),
        "dpdistill.fingerprint": fingerprint,
    }

    n_shards = math.ceil(cfg.num_samples / cfg.shard_size)
    shards, totals, resumed = [], Counter(), 0
    requested, generated = Counter(), Counter()
    seconds = 0.0
    for shard in range(n_shards):
        path = out_dir / SHARD.format(shard)
        first = shard * cfg.shard_size
        n = min(cfg.shard_size, cfg.num_samples - first)
        stats = _finished_shard(path, fingerprint)
        reused = stats is not None
        if reused:
            resumed += 1
        else:
            t0 = time.time()
            rows, stats = _generate_shard(model, tok, cfg, counts, first, n, _shard_seed(seed, shard))
            stats["seconds"] = time.time() - t0
            table = pa.table(rows, schema=SCHEMA).replace_schema_metadata(
                metadata | {"dpdistill.shard_stats": json.dumps(stats)}
            )
            tmp = out_dir / f".{path.name}.tmp"
            pq.write_table(table, tmp)
            tmp.replace(path)  # atomic: a crash never leaves half a shard
        shards.append(path)
        requested.update(stats["requested"])
        generated.update(stats["generated"])
        totals.update({k: stats[k] for k in ("kept", "validation", "dropped_empty", "new_tokens")})
        seconds += stats["seconds"]
        log.info(
            "generation: shard %d/%d %s, %d/%d samples, %.0f new tokens/s",
            shard + 1, n_shards, "reused" if reused else "written",
            first + n, cfg.num_samples, totals["new_tokens"] / max(seconds, 1e-9),
        )
        if on_progress:
            on_progress({"done": shard + 1, "total": n_shards, "samples": first + n, "reused": reused,
                         "tokens_per_second": totals["new_tokens"] / max(seconds, 1e-9)})
    if totals["kept"] == 0:
        raise GenerateError(
            f"all {cfg.num_samples} generations were empty; check the teacher checkpoint "
            "(it only writes end-of-text) or raise generate.temperature"
        )
    result = GenerateResult(
        path=out_dir,
        shards=shards,
        n_samples=totals["kept"],
        n_validation=totals["validation"],
        n_dropped_empty=totals["dropped_empty"],
        tokens_per_second=totals["new_tokens"] / max(seconds, 1e-9),
        requested_codes=_frequencies(requested),
        generated_codes=_frequencies(generated),
        resumed_shards=resumed,
    )
    write_manifest(
        out_dir,
        stage="generation",
        inputs={"teacher": Path(teacher_dir), "control_codes": Path(control_codes_path)},
        outputs={f"shard_{i}": p for i, p in enumerate(shards)},
        extra={
            "n_samples": result.n_samples,
            "n_validation": result.n_validation,
            "n_dropped_empty": result.n_dropped_empty,
            "new_tokens": totals["new_tokens"],
            "seconds": seconds,
            "tokens_per_second": result.tokens_per_second,
            "resumed_shards": resumed,
        },
    )
    log.info(
        "generation: %d samples kept (%d validation), %d empty dropped, %.0f new tokens/s",
        result.n_samples, result.n_validation, result.n_dropped_empty, result.tokens_per_second,
    )
    return result


def read_synthetic(path: Path, split: str | None = None) -> pa.Table:
    """All shards of a synthetic directory (or one shard file), optionally one split."""
    path = Path(path)
    files = sorted(path.glob("shard-*.parquet")) if path.is_dir() else [path]
    if not files:
        raise GenerateError(f"no synthetic shards in {path}; run the generation stage first")
    table = pa.concat_tables(pq.read_table(f).replace_schema_metadata(None) for f in files)
    if split is not None:
        table = table.filter(pc.equal(table["split"], split))
    return table
