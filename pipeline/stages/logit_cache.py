"""Cached top-k teacher logits: one teacher pass over a synthetic set, reused by every student.

Distilling several students from one synthetic set with one teacher repeats the teacher's
forward pass every step of every epoch of every student. `build_teacher_cache` runs it
once (eval mode, `torch.no_grad`) and keeps, for every target position of every synthetic
sample (train and validation splits), the k largest *raw* logits (before any temperature),
their token ids, and the logsumexp of all V raw logits. Raw logits, not log-probs at T: the
top-k ids do not depend on T, so one cache serves every temperature. At T = 1 the logsumexp
gives the teacher's exact probabilities on the k ids and the mass of the rest of the
vocabulary, and the loss compares teacher and student on the k ids and that rest (`pipeline.
models.losses.kl_teacher_student_topk`); at T ≠ 1 it renormalises softmax(logits / T) over the
k ids. With k = V both are exact.

Layout: `<cache_dir>/topk-shard-00000.parquet`, one file per synthetic shard, a row per
sample (sample_id, split, n_targets, indices list<list<int32>>, logits list<list<float32>>,
logsumexp list<float32>; the inner lists hold k entries, one per target token), then
`manifest.json`, written last.
The manifest and every shard carry a fingerprint of (teacher weights, synthetic shard
hashes, k, max_length); a cache whose fingerprint differs is stale and is recomputed,
never read. Memory while building: one batch. Memory while training: every train token's
k ids and logits and its logsumexp (8·k + 4 bytes a token).

The default cache directory is `<synthetic dir>/teacher_topk_k<k>/`. Only the synthetic
data and the DP teacher are read: post-processing, like the distillation itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from transformers import AutoConfig

from pipeline.batching import TokenizedRecords, lm_batch
from pipeline.devices import CPU_FP32, Runtime
from pipeline.stages.generate import teacher_fingerprint
from pipeline.models.losses import TopKLogits
from pipeline.manifest import MANIFEST, sha256_file, write_manifest
from pipeline.models.base import load_causal_lm, load_tokenizer, model_positions
from pipeline.progress import DEFAULT_EVERY, ProgressLog

log = logging.getLogger(__name__)

FORMAT = 2  # 2: the logsumexp column (a cache of format 1 is stale and recomputed)
SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("split", pa.string()),
        ("n_targets", pa.int32()),
        ("indices", pa.list_(pa.list_(pa.int32()))),
        ("logits", pa.list_(pa.list_(pa.float32()))),
        ("logsumexp", pa.list_(pa.float32())),
    ]
)


class LogitCacheError(ValueError):
    """The teacher cache cannot be built or used as asked; the message says what to change."""


@dataclass(frozen=True)
class TeacherCache:
    path: Path
    k: int
    max_length: int
    """Tokens per sample the teacher saw (its context); a student may use fewer."""
    fingerprint: str
    reused: bool
    seconds: float
    """Time spent building it (0 when reused)."""


def default_cache_dir(synthetic_path: Path, k: int) -> Path:
    path = Path(synthetic_path)
    return (path if path.is_dir() else path.parent) / f"teacher_topk_k{k}"


def _synthetic_shards(synthetic_path: Path) -> list[Path]:
    path = Path(synthetic_path)
    files = sorted(path.glob("shard-*.parquet")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise LogitCacheError(f"no synthetic shards in {path}; run the generation stage first")
    return files


def _fingerprint_parts(teacher_dir: Path, shards: list[Path], k: int, max_length: int,
                       precision: str = "fp32") -> dict:
    teacher_sha = teacher_fingerprint(teacher_dir)
    if not teacher_sha:
        raise LogitCacheError(
            f"teacher checkpoint {str(teacher_dir)!r} has no *.safetensors weights, so a cache could not "
            "tell this teacher from another; save it with save_pretrained (safetensors) or set "
            "distill.teacher_top_k=null"
        )
    parts = {"teacher_sha256": teacher_sha, "synthetic": {f.name: sha256_file(f) for f in shards},
             "k": k, "max_length": max_length, "format": FORMAT}
    if precision != "fp32":  # bf16 weights give other logits; fp32 caches made before stay valid
        parts["precision"] = precision
    return parts


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _cache_shard(cache_dir: Path, synthetic_shard: Path) -> Path:
    return cache_dir / f"topk-{synthetic_shard.name}"


def _shard_fingerprint(path: Path) -> str | None:
    if not path.is_file():
        return None
    return (pq.read_schema(path).metadata or {}).get(b"dpdistill.fingerprint", b"").decode()


def _stale_reason(manifest: dict, parts: dict) -> str:
    """Which inputs differ from those the existing cache was built from (names only)."""
    old = manifest.get("fingerprint_parts", {})
    changed = [name for name in ("teacher_sha256", "synthetic", "k", "max_length", "format", "precision")
               if old.get(name) != parts.get(name)]
    return ", ".join(changed) or "unknown"


def _per_sample(values: pa.Array, n_targets: np.ndarray) -> pa.ListArray:
    """A list per sample of its `n_targets` consecutive entries of `values` (one per token)."""
    return pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(n_targets)]), pa.int32()), values)


def _nested(flat: pa.Array, k: int, n_targets: np.ndarray) -> pa.ListArray:
    """list<list<>>: a list per sample of `n_targets` tokens, each a list of k values."""
    return _per_sample(pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, k), pa.int32()), flat), n_targets)


def _write_shard(teacher, tok, src: Path, dst: Path, k: int, max_length: int, batch_size: int,
                 metadata: dict, on_batch=None) -> tuple[int, int]:
    """Top-k rows of one synthetic shard into `dst` (temp then rename), a batch at a time;
    `on_batch(samples, target tokens)` after each batch. Returns (samples, target tokens)."""
    table = pq.read_table(src, columns=["sample_id", "split", "token_ids"])
    token_ids = table["token_ids"].to_pylist()
    vocab = len(tok)
    device = next(teacher.parameters()).device
    lengths = np.array([min(len(x), max_length) for x in token_ids])
    order = np.argsort(lengths, kind="stable")  # similar lengths together: little padding
    tmp = dst.parent / f".{dst.name}.tmp"
    n_tokens = 0
    with pq.ParquetWriter(tmp, SCHEMA.with_metadata(metadata)) as writer:
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            records = TokenizedRecords([token_ids[i] for i in rows], tok.pad_token_id, max_length)
            batch = lm_batch(records.ids, records.lengths)
            batch.pop("labels")
            with torch.no_grad():
                logits = teacher(**{n: v.to(device) for n, v in batch.items()}).logits[:, :-1, :vocab].float()  # (B, L-1, V)
            values, ids = logits.topk(k, dim=-1)  # (B, L-1, k), sorted, largest first
            lse = torch.logsumexp(logits, dim=-1)  # (B, L-1): all V logits
            n_targets = (records.lengths - 1).clamp(min=0)  # (B,)
            keep = (torch.arange(logits.shape[1]).unsqueeze(0) < n_targets.unsqueeze(1)).to(device)  # (B, L-1)
            flat_ids = ids[keep].to(torch.int32).numpy(force=True).reshape(-1)  # (tokens·k,) row-major, on the host
            flat_values = values[keep].numpy(force=True).reshape(-1)
            n_tokens += int(n_targets.sum())
            writer.write_table(pa.table({
                "sample_id": table["sample_id"].take(rows),
                "split": table["split"].take(rows),
                "n_targets": pa.array(n_targets.numpy(), pa.int32()),
                "indices": _nested(pa.array(flat_ids, pa.int32()), k, n_targets.numpy()),
                "logits": _nested(pa.array(flat_values, pa.float32()), k, n_targets.numpy()),
                "logsumexp": _per_sample(pa.array(lse[keep].numpy(force=True), pa.float32()), n_targets.numpy()),
            }, schema=SCHEMA))
            if on_batch:
                on_batch(len(rows), int(n_targets.sum()))
    tmp.replace(dst)  # atomic: a crash never leaves half a shard under the final name
    return len(order), n_tokens


def build_teacher_cache(
    teacher_dir: Path, synthetic_path: Path, *, k: int, cache_dir: Path | None = None, batch_size: int = 16,
    progress_every: float = DEFAULT_EVERY, runtime: Runtime = CPU_FP32,
) -> TeacherCache:
    """Compute (or reuse) the teacher's top-k logits for every synthetic sample.

    A cache with the same fingerprint is reused without loading the teacher; a stale one
    (other teacher weights, synthetic shards, k or max_length) is recomputed, with a warning.
    A crash while building keeps the finished shards: the next call resumes. Progress lines
    (samples, samples/s, tokens/s, ETA) follow the batches, at least every `progress_every` s.
    The teacher runs on `runtime`'s device with weights in its precision (part of the fingerprint).
    """
    shards = _synthetic_shards(synthetic_path)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(synthetic_path, k)
    max_length = model_positions(AutoConfig.from_pretrained(str(teacher_dir)))
    parts = _fingerprint_parts(Path(teacher_dir), shards, k, max_length, runtime.precision)
    fingerprint = _digest(parts)
    outputs = {f"topk_{i}": _cache_shard(cache_dir, f) for i, f in enumerate(shards)}

    manifest_path = cache_dir / MANIFEST
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fingerprint and all(p.is_file() for p in outputs.values()):
            log.info("teacher cache: reusing %s (k=%d)", cache_dir, k)
            return TeacherCache(cache_dir, k, max_length, fingerprint, reused=True, seconds=0.0)
        log.warning("teacher cache: %s is stale (changed: %s); recomputing it", cache_dir, _stale_reason(manifest, parts))
        manifest_path.unlink()  # the cache is unfinished from here until the new manifest

    tok = load_tokenizer(str(teacher_dir))
    if k > len(tok):
        raise LogitCacheError(
            f"distill.teacher_top_k={k} exceeds the teacher's vocabulary of {len(tok)} tokens; "
            f"set it to at most {len(tok)} (= the exact dense KL)"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    for old in set(cache_dir.glob("topk-*.parquet")) - set(outputs.values()):
        old.unlink()  # shards of a synthetic set that no longer exists
    metadata = {"dpdistill.fingerprint": fingerprint, "dpdistill.teacher_checkpoint": str(teacher_dir)}
    teacher = None
    t0, n_samples, n_tokens, resumed = time.time(), 0, 0, 0
    sizes = [pq.ParquetFile(f).metadata.num_rows for f in shards]
    lines = ProgressLog(log, "teacher cache", "samples", sum(sizes), every=progress_every)

    def on_batch(samples: int, tokens: int) -> None:  # synthetic samples and tokens: public
        made["samples"] += samples
        made["tokens"] += tokens
        lines.update(lines.start + made["samples"], counts={"tokens": made["tokens"]})

    made = {"samples": 0, "tokens": 0}  # in the shards written now
    for i, src in enumerate(shards):
        dst = outputs[f"topk_{i}"]
        if _shard_fingerprint(dst) == fingerprint:
            resumed += 1
            lines.skipped(sizes[i])
            continue
        if teacher is None:
            teacher = load_causal_lm(str(teacher_dir), dtype=runtime.dtype).eval().to(runtime.device)
        samples, tokens = _write_shard(teacher, tok, src, dst, k, max_length, batch_size, metadata, on_batch)
        n_samples, n_tokens = n_samples + samples, n_tokens + tokens
        log.info("teacher cache: shard %d/%d, %d samples, %d target tokens (%.0f s)",
                 i + 1, len(shards), n_samples, n_tokens, time.time() - t0)
    seconds = time.time() - t0
    write_manifest(
        cache_dir,
        stage="teacher_topk_logits",
        inputs={f"synthetic/{f.name}": f for f in shards},
        outputs=outputs,
        extra={"fingerprint": fingerprint, "fingerprint_parts": parts, "teacher_checkpoint": str(teacher_dir),
               "values": "raw teacher logits before temperature, k largest per target token, largest first, "
                         "and the logsumexp of all of them",
               "k": k, "max_length": max_length, "seconds": seconds, "resumed_shards": resumed},
    )
    log.info("teacher cache: %s written (k=%d, %.0f s)", cache_dir, k, seconds)
    return TeacherCache(cache_dir, k, max_length, fingerprint, reused=False, seconds=seconds)


class CachedTopK:
    """The cached top-k logits of some samples, in a given order, batched like `lm_batch`."""

    def __init__(self, cache: TeacherCache, sample_ids: list[int]):
        wanted = pa.array(sample_ids, pa.int64())
        ids, logits, lse, counts, found = [], [], [], [], []
        for path in sorted(cache.path.glob("topk-*.parquet")):
            if _shard_fingerprint(path) != cache.fingerprint:
                raise LogitCacheError(
                    f"{path} does not belong to this cache (another teacher or synthetic set wrote it); "
                    f"delete {cache.path} and run again"
                )
            table = pq.read_table(path)
            table = table.filter(pc.is_in(table["sample_id"], value_set=wanted))
            if table.num_rows == 0:
                continue
            ids.append(pc.list_flatten(pc.list_flatten(table["indices"])).to_numpy())
            logits.append(pc.list_flatten(pc.list_flatten(table["logits"])).to_numpy())
            lse.append(pc.list_flatten(table["logsumexp"]).to_numpy())
            counts.append(table["n_targets"].to_numpy())
            found.append(table["sample_id"].to_numpy())
        found_ids = np.concatenate(found) if found else np.zeros(0, np.int64)
        counts_all = np.concatenate(counts) if counts else np.zeros(0, np.int64)
        row_of = {int(s): r for r, s in enumerate(found_ids)}
        missing = [s for s in sample_ids if s not in row_of]
        if missing:
            raise LogitCacheError(
                f"the teacher cache {cache.path} lacks {len(missing)} of {len(sample_ids)} samples; "
                f"delete {cache.path} and run again"
            )
        starts_all = np.concatenate([[0], np.cumsum(counts_all)[:-1]]) if len(counts_all) else counts_all
        rows = np.array([row_of[s] for s in sample_ids], dtype=np.int64)
        self.k = cache.k
        self.indices = torch.from_numpy(np.concatenate(ids).reshape(-1, cache.k)) if ids else None  # (tokens, k)
        self.logits = torch.from_numpy(np.concatenate(logits).reshape(-1, cache.k)) if logits else None
        self.logsumexp = torch.from_numpy(np.concatenate(lse)) if lse else None  # (tokens,)
        self.starts = torch.from_numpy(starts_all[rows].astype(np.int64))  # (N,)
        self.counts = torch.from_numpy(counts_all[rows].astype(np.int64))  # (N,)

    def nbytes(self) -> int:
        return 0 if self.indices is None else self.indices.nbytes + self.logits.nbytes + self.logsumexp.nbytes

    def batch(self, rows: torch.Tensor, lengths: torch.Tensor) -> TopKLogits:
        """Top-k logits for samples `rows` (B,) of true lengths `lengths` (B,), shaped (B, L-1, k)
        like `lm_batch`'s labels, and their logsumexp (B, L-1); padded positions hold token 0
        with logit 0 and logsumexp 0 (masked anyway)."""
        n_targets = lengths - 1  # (B,)
        width = int(lengths.max()) - 1
        out_ids = torch.zeros(len(rows), width, self.k, dtype=torch.long)  # (B, L-1, k)
        out_logits = torch.zeros(len(rows), width, self.k)  # (B, L-1, k)
        out_lse = torch.zeros(len(rows), width)  # (B, L-1)
        for b, (r, n) in enumerate(zip(rows.tolist(), n_targets.tolist())):
            assert self.counts[r] >= n, "cache built from a shorter sample than the one trained on"
            start = int(self.starts[r])
            out_ids[b, :n] = self.indices[start : start + n]
            out_logits[b, :n] = self.logits[start : start + n]
            out_lse[b, :n] = self.logsumexp[start : start + n]
        return TopKLogits(indices=out_ids, logits=out_logits, logsumexp=out_lse)
