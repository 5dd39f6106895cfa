"""Stage 2: the DP teacher writes synthetic records to sharded Parquet.

Prompts are control codes drawn with the released control-code distribution; sampling is
top-k / top-p with a temperature (optionally `no_repeat_ngram_size`), at most `max_length`
tokens including the prompt, by either of two engines (`fast`, the default, and `hf`, the
reference): pipeline/stages/sampling.py writes one shard's samples. This module is the stage
around it: the shards' layout, files, resumption and totals (the fingerprint says which
engine wrote a shard).

Scale: samples are written in shards of `shard_size` (`synthetic/shard-00000.parquet`,
...), one shard in memory at a time. Shard i draws its prompts and samples from a seed
derived from (seed, i) alone, so a shard is deterministic for a given seed and shard, and
a rerun into the same directory skips every finished shard (resumable after a crash).
Each shard marks `validation_fraction` of its kept samples split='validation' (1% by
default, rounded up: a shard of 2 or more samples has at least one; the distillation's
validation split), the rest split='train'. Empty or prompt-only generations are
counted and dropped.

Parallel: `plan_generation` (checks, fingerprint, shard ranges) → `generate_shard(plan, i)`
for each shard, in any process and any order → `finish_generation` (totals, manifest
last). `generate_synthetic` runs the three in this process; flows/generation.py maps the
shards over worker processes. The shards are the same either way.

This stage reads only the DP teacher checkpoint and the released control-code counts,
never the private records: post-processing of DP releases (no extra privacy cost).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import operator
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from transformers import AutoConfig

from pipeline.config import GenerateConfig
from pipeline.prompts import HEADER, PromptFormat
from pipeline.records import read_control_codes
from pipeline.devices import CPU_FP32, Runtime
from pipeline.privacy.ledger import LedgerEntry
from pipeline.manifest import sha256_file, write_manifest
from pipeline.models import decoding
from pipeline.models.base import load_causal_lm, load_tokenizer, model_positions
from pipeline.progress import DEFAULT_EVERY, ProgressLog
from pipeline.stages.sampling import SCHEMA, GenerateError, sample_shard
from pipeline.tokenized import hf_datasets

log = logging.getLogger(__name__)

SHARD = "shard-{:05d}.parquet"
# Where shards are computed (local processes, a Dask cluster), never what they hold: left out of
# the fingerprint, the shards' metadata and the stage's cache key, so shards written anywhere are
# one generation and resume each other.
PLACEMENT_FIELDS = frozenset({"workers", "dask_address"})


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


def _frequencies(counts: Counter) -> dict[str, float]:
    total = sum(counts.values()) or 1
    return {c: counts[c] / total for c in sorted(counts)}


def teacher_fingerprint(teacher_dir: Path) -> str:
    weights = sorted(Path(teacher_dir).glob("*.safetensors"))
    return ",".join(sha256_file(w) for w in weights)


def _shard_seed(seed: int, shard: int) -> int:
    """A seed for shard `shard` that depends on (seed, shard) only."""
    return int(np.random.SeedSequence([seed, shard]).generate_state(1)[0])


def _fingerprint(cfg: GenerateConfig, teacher_sha: str, counts_sha: str, seed: int, precision: str = "fp32",
                 prompt: PromptFormat = HEADER) -> str:
    # PLACEMENT_FIELDS change how shards are scheduled, never what they hold. So does the device
    # (rounding only); the precision does not: bf16 weights sample other texts.
    # The engine changes the samples (other draws from the same distribution); shards written by
    # `generate` before engines existed stay the hf engine's generation.
    exclude = {"shard_size", *PLACEMENT_FIELDS} | ({"engine"} if cfg.engine == "hf" else set())
    spec = {"config": cfg.model_dump(mode="json", exclude=exclude), "teacher": teacher_sha,
            "codes": counts_sha, "seed": seed, "shard_size": cfg.shard_size, "format": 3}
    if precision != "fp32":  # fp32 shards written before precision existed stay this generation's
        spec["precision"] = precision
    if prompt.key():  # so do the header form's
        spec["prompt"] = prompt.key()
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _finished_shard(path: Path, fingerprint: str) -> dict | None:
    """The stats of a finished shard of this very generation, else None."""
    if not path.is_file():
        return None
    meta = pq.read_schema(path).metadata or {}
    if meta.get(b"dpdistill.fingerprint", b"").decode() != fingerprint:
        raise GenerateError(
            f"{path} was written by another generation (config, teacher, codes, seed or engine differ); "
            "use a new run directory, or delete the synthetic/ directory to generate anew (shards "
            "written before generate.engine existed are generate.engine=hf's: set it to resume them)"
        )
    return json.loads(meta[b"dpdistill.shard_stats"])


@dataclass(frozen=True)
class GenerationPlan:
    """Everything a worker needs to write any one shard: small, picklable, no model, no text."""

    cfg: GenerateConfig
    teacher_dir: Path
    control_codes_path: Path
    out_dir: Path
    seed: int
    fingerprint: str
    counts: dict[str, float]
    prompt: PromptFormat
    metadata: dict[str, str]
    """Parquet metadata of every shard (teacher, ledger, config, seed, fingerprint)."""
    shards: tuple[tuple[int, int], ...]
    """(first sample id, number of samples) of each shard."""
    runtime: Runtime = CPU_FP32
    """Device and precision the teacher samples with, threads per process (pipeline/devices.py)."""

    @property
    def n_shards(self) -> int:
        return len(self.shards)

    def shard_path(self, shard: int) -> Path:
        return self.out_dir / SHARD.format(shard)


def plan_generation(
    cfg: GenerateConfig, *, teacher_dir: Path, control_codes_path: Path, ledger: list[LedgerEntry],
    out_dir: Path, seed: int, runtime: Runtime = CPU_FP32, prompt: PromptFormat = HEADER,
) -> GenerationPlan:
    """Check the configuration against the teacher and codes, and lay out the shards."""
    out_dir, teacher_dir = Path(out_dir), Path(teacher_dir)
    try:
        model_config = AutoConfig.from_pretrained(str(teacher_dir))
    except OSError as e:
        raise GenerateError(f"no model config in the teacher checkpoint {teacher_dir}; run the teacher stage first") from e
    if cfg.engine == "fast" and (problem := decoding.fast_decode_problem(model_config, cfg.max_length)):
        raise GenerateError(f"generate.engine=fast cannot decode the teacher {teacher_dir}: {problem}; "
                            "set generate.engine=hf")
    n_positions = model_positions(model_config)
    if cfg.max_length > n_positions:
        raise GenerateError(
            f"generate.max_length={cfg.max_length} exceeds the teacher's {n_positions} positions; "
            f"set generate.max_length <= {n_positions}"
        )
    counts = read_control_codes(control_codes_path)
    tok = load_tokenizer(str(teacher_dir))
    longest = max((len(prompt.ids(tok, c)) for c, n in counts.items() if n > 0), default=0)
    if longest >= cfg.max_length:
        raise GenerateError(
            f"control-code prompts of {longest} tokens leave no room within "
            f"generate.max_length={cfg.max_length}; raise generate.max_length"
        )
    teacher_sha = teacher_fingerprint(teacher_dir)
    fingerprint = _fingerprint(cfg, teacher_sha, sha256_file(Path(control_codes_path)), seed, runtime.precision,
                               prompt)
    metadata = {
        "dpdistill.teacher_checkpoint": str(teacher_dir),
        "dpdistill.teacher_sha256": teacher_sha,
        "dpdistill.ledger": json.dumps([e.model_dump() for e in ledger]),
        "dpdistill.generate_config": cfg.model_dump_json(exclude=set(PLACEMENT_FIELDS)),
        "dpdistill.seed": str(seed),
        "dpdistill.precision": runtime.precision,
        "dpdistill.fingerprint": fingerprint,
        # How a template prompted the text (selection samples so); the header form writes nothing,
        # as shards did before templates, whatever the code columns.
        **({"dpdistill.prompt": json.dumps(asdict(prompt))} if prompt.key() else {}),
    }
    starts = range(0, cfg.num_samples, cfg.shard_size)
    shards = tuple((first, min(cfg.shard_size, cfg.num_samples - first)) for first in starts)
    for i in range(len(shards)):  # refuse another generation's shards here, before any worker starts
        _finished_shard(out_dir / SHARD.format(i), fingerprint)
    out_dir.mkdir(parents=True, exist_ok=True)
    return GenerationPlan(cfg=cfg, teacher_dir=teacher_dir, control_codes_path=Path(control_codes_path),
                          out_dir=out_dir, seed=seed, fingerprint=fingerprint, counts=counts, prompt=prompt,
                          metadata=metadata, shards=shards, runtime=runtime)


def teacher_files(teacher_dir: Path) -> dict[str, int]:
    """Name -> size of the files a process loads the teacher from (config, weights, tokenizer)."""
    return {f.name: f.stat().st_size for f in sorted(Path(teacher_dir).iterdir()) if f.is_file()}


def shard_access_problems(teacher_dir: Path, out_dir: Path, marker: str) -> list[str]:
    """What stops this process from writing shards (empty: nothing). Run on each worker of a
    cluster: `out_dir/marker` (written by the flow, the teacher's `teacher_files`) proves the
    worker sees the flow's output directory, not a local one at the same path, and that the
    teacher it reads at `teacher_dir` is the flow's. Paths as the worker resolves them."""
    where = f" (relative to this worker's directory {os.getcwd()})" if not Path(teacher_dir).is_absolute() else ""
    try:
        expected = json.loads((Path(out_dir) / marker).read_text())
    except OSError:
        return [f"cannot see the output directory {out_dir}{where}: the file the flow wrote there is missing"]
    try:
        seen = teacher_files(teacher_dir)
        for name in seen:  # readable, not only listed
            with open(Path(teacher_dir) / name, "rb") as f:
                f.read(1)
    except OSError as e:
        return [f"cannot read the teacher checkpoint {teacher_dir}{where}: {e.strerror or e}"]
    problems = [] if seen == expected else [f"the teacher checkpoint {teacher_dir} holds other files than the flow's"]
    probe = Path(out_dir) / f".write-probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        problems.append(f"cannot write the output directory {out_dir}: {e.strerror or e}")
    return problems


@functools.lru_cache(maxsize=1)
def _teacher(teacher_dir: str, teacher_sha: str, device: torch.device, dtype: torch.dtype):
    """The teacher (weights in `dtype`, on `device`) and its tokenizer, loaded once per process
    (the sha keys a rewritten checkpoint)."""
    return load_causal_lm(teacher_dir, dtype=dtype).eval().to(device), load_tokenizer(teacher_dir)


def generate_shard(plan: GenerationPlan, shard: int, on_batch: Callable[[int, int], None] | None = None) -> dict:
    """Write shard `shard` of the plan (or reuse it if finished); return its counts, time and
    the writing process id, never a text. `on_batch(samples, new_tokens)` is called after
    each generated batch with the shard's counts so far.

    Any process can run any shard: the shard depends on (seed, shard) only, and the file is
    written under a temporary name, then renamed.
    """
    path = plan.shard_path(shard)
    first, n = plan.shards[shard]
    stats = _finished_shard(path, plan.fingerprint)
    if stats is not None:
        log.info("generation: shard %d reused", shard)
        return {**stats, "shard": shard, "samples": n, "reused": True}
    model, tok = _teacher(str(plan.teacher_dir), plan.metadata["dpdistill.teacher_sha256"], plan.runtime.device,
                          plan.runtime.dtype)
    t0 = time.perf_counter()
    rows, stats = sample_shard(model, tok, plan.cfg, plan.counts, first, n, _shard_seed(plan.seed, shard),
                               on_batch, prompt=plan.prompt)
    stats["seconds"] = time.perf_counter() - t0
    table = pa.table(rows, schema=SCHEMA).replace_schema_metadata(
        plan.metadata | {"dpdistill.shard_stats": json.dumps(stats)}
    )
    # A name of its own (a random one: workers on several nodes sharing the directory may have the
    # same pid). It starts with '.', so a worker killed mid-write leaves a file no reader takes for
    # a shard (they read shard-*.parquet); finish_generation removes it.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)  # atomic: a crash never leaves half a shard
    log.info("generation: shard %d written, %d samples kept, %.0f new tokens/s",
             shard, stats["kept"], stats["new_tokens"] / max(stats["seconds"], 1e-9))
    return {**stats, "shard": shard, "samples": n, "reused": False, "pid": os.getpid(), "host": socket.gethostname()}


class GenerationProgress:
    """Samples done over finished and running shards, reported per generated batch: an
    `on_progress` record (done/total samples, shards, tokens/s) and a throttled progress line.
    Counts only, never a text. Shards may run in any order, in any process: the caller feeds
    `batch` (a running shard's counts so far) and `shard_done` (a finished shard's stats)."""

    def __init__(self, plan: GenerationPlan, on_progress: Callable[[dict], None] | None = None,
                 every: float = DEFAULT_EVERY, logger: logging.Logger | logging.LoggerAdapter = log):
        self.plan, self.on_progress = plan, on_progress
        self.finished: list[dict] = []
        self.running: dict[int, tuple[int, int]] = {}  # shard -> (samples, new tokens) so far
        self.lines = ProgressLog(logger, "generation", "samples", plan.cfg.num_samples, every=every)
        self.t0 = time.perf_counter()

    def batch(self, shard: int, samples: int, new_tokens: int) -> None:
        if self.running.get(shard) == (samples, new_tokens):
            return  # polled again before its next batch
        self.running[shard] = (samples, new_tokens)
        self._report()

    def shard_done(self, stats: dict) -> None:
        self.running.pop(stats["shard"], None)
        self.finished.append(stats)
        if stats["reused"]:
            self.lines.skipped(stats["samples"])  # not generated now: not in samples/s or the ETA
        self._report()

    def _report(self) -> None:
        fresh = [s for s in self.finished if not s["reused"]]
        done = sum(s["samples"] for s in self.finished) + sum(n for n, _ in self.running.values())
        tokens = sum(s["new_tokens"] for s in fresh) + sum(t for _, t in self.running.values())
        self.lines.update(done, counts={"new tokens": tokens})
        if self.on_progress:
            self.on_progress({
                "done": done, "total": self.plan.cfg.num_samples, "samples": done,
                "shards_done": len(self.finished), "shards": self.plan.n_shards,
                "reused": bool(self.finished) and self.finished[-1]["reused"],
                "tokens_per_second": tokens / max(time.perf_counter() - self.t0, 1e-9),
            })


def finish_generation(plan: GenerationPlan, stats: list[dict], wall_seconds: float | None = None) -> GenerateResult:
    """Check every shard is there, add up the stats and write the manifest (last).

    `tokens_per_second` is the new tokens over the summed shard times; with `wall_seconds`
    (shards generated in parallel) it is the new tokens of the shards written now over the
    wall-clock time, which counts every worker.
    """
    stats = sorted(stats, key=lambda s: s["shard"])
    if [s["shard"] for s in stats] != list(range(plan.n_shards)):
        raise GenerateError(
            f"generation finished {len(stats)} of {plan.n_shards} shards in {plan.out_dir}; rerun the stage "
            "into the same directory to write the missing ones (finished shards are reused)"
        )
    shards = [plan.shard_path(s["shard"]) for s in stats]
    assert all(p.is_file() for p in shards), "a shard reported finished is missing"
    for stale in plan.out_dir.glob(".shard-*.parquet.*.tmp"):  # half-written by a killed worker
        stale.unlink(missing_ok=True)
    requested, generated, totals = Counter(), Counter(), Counter()
    for s in stats:
        requested.update(s["requested"])
        generated.update(s["generated"])
        totals.update({k: s[k] for k in ("kept", "validation", "dropped_empty", "new_tokens", "seconds")})
    if totals["kept"] == 0:
        raise GenerateError(
            f"all {plan.cfg.num_samples} generations were empty; check the teacher checkpoint "
            "(it only writes end-of-text) or raise generate.temperature"
        )
    fresh = [s for s in stats if not s["reused"]]
    if wall_seconds is not None and fresh:
        tokens_per_second = sum(s["new_tokens"] for s in fresh) / max(wall_seconds, 1e-9)
    else:
        tokens_per_second = totals["new_tokens"] / max(totals["seconds"], 1e-9)
    resumed = len(stats) - len(fresh)
    result = GenerateResult(
        path=plan.out_dir,
        shards=shards,
        n_samples=totals["kept"],
        n_validation=totals["validation"],
        n_dropped_empty=totals["dropped_empty"],
        tokens_per_second=tokens_per_second,
        requested_codes=_frequencies(requested),
        generated_codes=_frequencies(generated),
        resumed_shards=resumed,
    )
    write_manifest(
        plan.out_dir,
        stage="generation",
        inputs={"teacher": plan.teacher_dir, "control_codes": plan.control_codes_path},
        outputs={f"shard_{i}": p for i, p in enumerate(shards)},
        extra={
            "n_samples": result.n_samples,
            "n_validation": result.n_validation,
            "n_dropped_empty": result.n_dropped_empty,
            "new_tokens": totals["new_tokens"],
            "seconds": totals["seconds"],
            "wall_seconds": wall_seconds,
            "tokens_per_second": result.tokens_per_second,
            "resumed_shards": resumed,
            # that wrote the shards generated now (pids repeat across the nodes of a Dask cluster)
            "processes": len({(s.get("host"), s["pid"]) for s in fresh}),
        },
    )
    log.info(
        "generation: %d samples kept (%d validation), %d empty dropped, %.0f new tokens/s",
        result.n_samples, result.n_validation, result.n_dropped_empty, result.tokens_per_second,
    )
    return result


def generate_synthetic(
    cfg: GenerateConfig,
    *,
    teacher_dir: Path,
    control_codes_path: Path,
    ledger: list[LedgerEntry],
    out_dir: Path,
    seed: int,
    on_progress: Callable[[dict], None] | None = None,
    progress_every: float = DEFAULT_EVERY,
    runtime: Runtime = CPU_FP32,
    prompt: PromptFormat = HEADER,
) -> GenerateResult:
    """Write `num_samples` synthetic records in Parquet shards, one after another, in this
    process (whatever `cfg.workers` says; flows/generation.py runs them in parallel).
    Finished shards are reused.

    `on_progress` receives, after each generated batch, done/total samples, the shards
    finished and the throughput (aggregates only, never a text); a progress line is logged
    after the first batch, then at least every `progress_every` seconds. The teacher samples
    on `runtime`'s device with weights in its precision.
    """
    runtime.apply_threads()
    plan = plan_generation(cfg, teacher_dir=teacher_dir, control_codes_path=control_codes_path, ledger=ledger,
                           out_dir=out_dir, seed=seed, runtime=runtime, prompt=prompt)
    tracker = GenerationProgress(plan, on_progress, progress_every)
    stats: list[dict] = []
    for shard in range(plan.n_shards):
        stats.append(generate_shard(plan, shard, functools.partial(tracker.batch, shard)))
        tracker.shard_done(stats[-1])
    return finish_generation(plan, stats)


def synthetic_prompt(path: Path) -> PromptFormat:
    """How the synthetic set's samples were prompted (its first shard's metadata); the header
    form for shards written before prompt templates."""
    meta = pq.read_schema(synthetic_files(path)[0]).metadata or {}
    if b"dpdistill.prompt" not in meta:
        return HEADER
    spec = json.loads(meta[b"dpdistill.prompt"])
    return PromptFormat(**{**spec, "columns": tuple(spec["columns"])})


def synthetic_files(path: Path) -> list[Path]:
    """The shard files of a synthetic directory (or the one shard file given)."""
    path = Path(path)
    files = sorted(path.glob("shard-*.parquet")) if path.is_dir() else [path]
    if not files:
        raise GenerateError(f"no synthetic shards in {path}; run the generation stage first")
    return files


def read_synthetic(path: Path, split: str | None = None) -> pa.Table:
    """All shards of a synthetic directory (or one shard file), optionally one split, in
    memory: for small sets (tests, benchmarks). The stages read them lazily: `synthetic_head`,
    `synthetic_texts`, `synthetic_ids`."""
    table = pa.concat_tables(pq.read_table(f).replace_schema_metadata(None) for f in synthetic_files(path))
    if split is not None:
        table = table.filter(pc.equal(table["split"], split))
    return table


def _scanner(path: Path, split: str | None, columns: list[str], ids: list[int] | None = None):
    import pyarrow.dataset as ds  # lazy: batches are read as the scanner is consumed

    shards = ds.dataset([str(f) for f in synthetic_files(path)], format="parquet")
    where = [ds.field("split") == split] if split is not None else []
    where += [ds.field("sample_id").isin(pa.array(ids, pa.int64()))] if ids is not None else []
    return shards.scanner(columns=columns, filter=functools.reduce(operator.and_, where) if where else None)


def synthetic_head(path: Path, n: int, split: str | None = None,
                   columns: tuple[str, ...] = ("control_code", "text"), ids: list[int] | None = None) -> pa.Table:
    """The first `n` samples (of `split`; of those whose sample_id is in `ids`), reading shards
    in order only until it has them: for a 10M-sample set, one shard, not the set."""
    return _scanner(path, split, list(columns), ids).head(n)


def synthetic_texts(path: Path, n: int, split: str | None = None) -> list[str]:
    """The first `n` synthetic texts: a sample for aggregate statistics (shards are i.i.d.)."""
    return synthetic_head(path, n, split, ("text",))["text"].to_pylist()


def synthetic_ids(path: Path, split: str, out_file: Path):
    """The `split` samples' sample_id, n_prompt_tokens and token_ids (int32), copied shard by
    shard, a batch at a time, into one Arrow file `out_file` and returned memory-mapped as a
    `datasets.Dataset`: random access for shuffled epochs without the set in memory.
    Synthetic data is public (post-processing of the DP teacher); the caller deletes the file."""
    schema = pa.schema([("sample_id", pa.int64()), ("n_prompt_tokens", pa.int32()),
                        ("token_ids", pa.list_(pa.int32()))])
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(out_file), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in _scanner(path, split, schema.names).to_batches():
            writer.write_batch(pa.RecordBatch.from_arrays(
                [batch.column(name).cast(schema.field(name).type) for name in schema.names], schema=schema))
    return hf_datasets().Dataset.from_file(str(out_file))
