"""Stage 2: the DP teacher writes synthetic records to Parquet.

Prompts are control codes drawn with the training split's control-code distribution;
sampling is top-k / top-p with a temperature, batched with the KV cache, at most
`max_length` tokens including the prompt. Prompts of equal token length are batched
together, so no batch needs padding.

This stage reads only the DP teacher checkpoint and the control-code counts, never the
private records: its output is post-processing of a DP release (no extra privacy cost).
The counts themselves are exact in this version, and the ledger says so.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.config import GenerateConfig
from pipeline.data import prompt_for, read_control_codes
from pipeline.ledger import LedgerEntry
from pipeline.manifest import sha256_file, write_manifest
from pipeline.models import load_causal_lm, load_tokenizer

log = logging.getLogger(__name__)

SYNTHETIC = "synthetic.parquet"
SCHEMA = pa.schema(
    [
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
    n_samples: int
    n_dropped_empty: int
    tokens_per_second: float
    requested_codes: dict[str, float]
    generated_codes: dict[str, float]


def sample_control_codes(counts: dict[str, int], n: int, rng: np.random.Generator) -> list[str]:
    """Draw `n` control codes i.i.d. with the frequencies in `counts`."""
    codes = sorted(counts)
    p = np.array([counts[c] for c in codes], dtype=float)
    if len(codes) == 0 or p.sum() <= 0:
        raise ValueError("control-code counts are empty; the data stage found no training records")
    draws = rng.choice(len(codes), size=n, p=p / p.sum())
    return [codes[i] for i in draws]


def _frequencies(codes: list[str]) -> dict[str, float]:
    counts = Counter(codes)
    total = sum(counts.values()) or 1
    return {c: counts[c] / total for c in sorted(counts)}


def teacher_fingerprint(teacher_dir: Path) -> str:
    weights = sorted(Path(teacher_dir).glob("*.safetensors"))
    return ",".join(sha256_file(w) for w in weights)


def generate_synthetic(
    cfg: GenerateConfig,
    *,
    teacher_dir: Path,
    control_codes_path: Path,
    ledger: list[LedgerEntry],
    out_dir: Path,
    seed: int,
) -> GenerateResult:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    out_dir = Path(out_dir)
    tok = load_tokenizer(str(teacher_dir))
    model = load_causal_lm(str(teacher_dir)).eval()
    eos = tok.eos_token_id
    n_positions = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    if cfg.max_length > n_positions:
        raise GenerateError(
            f"generate.max_length={cfg.max_length} exceeds the teacher's {n_positions} positions; "
            f"set generate.max_length <= {n_positions}"
        )

    requested = sample_control_codes(read_control_codes(control_codes_path), cfg.num_samples, rng)
    by_length: dict[int, list[tuple[str, list[int]]]] = defaultdict(list)
    prompt_ids = {c: tok.encode(prompt_for(c), add_special_tokens=False) for c in set(requested)}
    for code in requested:
        by_length[len(prompt_ids[code])].append((code, prompt_ids[code]))
    too_long = [n for n in by_length if n >= cfg.max_length]
    if too_long:
        raise GenerateError(
            f"control-code prompts of {max(too_long)} tokens leave no room within "
            f"generate.max_length={cfg.max_length}; raise generate.max_length"
        )

    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    dropped, new_tokens, done = 0, 0, 0
    t0 = time.time()
    for length in sorted(by_length):
        group = by_length[length]
        for start in range(0, len(group), cfg.batch_size):
            chunk = group[start : start + cfg.batch_size]
            input_ids = torch.tensor([ids for _, ids in chunk])  # (B, P), equal lengths
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=True,
                    top_k=cfg.top_k,
                    top_p=cfg.top_p,
                    temperature=cfg.temperature,
                    max_length=cfg.max_length,
                    use_cache=True,
                    pad_token_id=eos,
                    eos_token_id=eos,
                )  # (B, <= max_length)
            for (code, ids), row in zip(chunk, out.tolist()):
                new = row[length:]
                finished = eos in new
                if finished:
                    new = new[: new.index(eos)]
                text = tok.decode(new, skip_special_tokens=True)
                new_tokens += len(new)
                if not text.strip():
                    dropped += 1  # prompt-only generation: counted, not kept
                    continue
                seq = ids + new + ([eos] if finished else [])
                rows["control_code"].append(code)
                rows["text"].append(text)
                rows["n_tokens"].append(len(seq))
                rows["n_prompt_tokens"].append(length)
                rows["token_ids"].append(seq)
                rows["finished"].append(finished)
            done += len(chunk)
            if done * 10 // cfg.num_samples != (done - len(chunk)) * 10 // cfg.num_samples:
                log.info(
                    "generation: %d/%d samples, %.0f new tokens/s",
                    done, cfg.num_samples, new_tokens / max(time.time() - t0, 1e-9),
                )
    seconds = time.time() - t0
    if not rows["text"]:
        raise GenerateError(
            f"all {cfg.num_samples} generations were empty; check the teacher checkpoint "
            "(it only writes end-of-text) or raise generate.temperature"
        )

    metadata = {
        "dpdistill.teacher_checkpoint": str(teacher_dir),
        "dpdistill.teacher_sha256": teacher_fingerprint(teacher_dir),
        "dpdistill.ledger": json.dumps([e.model_dump() for e in ledger]),
        "dpdistill.generate_config": cfg.model_dump_json(),
        "dpdistill.seed": str(seed),
    }
    table = pa.table(rows, schema=SCHEMA).replace_schema_metadata(metadata)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SYNTHETIC
    tmp = out_dir / f".{SYNTHETIC}.tmp"
    pq.write_table(table, tmp)
    tmp.replace(path)
    result = GenerateResult(
        path=path,
        n_samples=table.num_rows,
        n_dropped_empty=dropped,
        tokens_per_second=new_tokens / max(seconds, 1e-9),
        requested_codes=_frequencies(requested),
        generated_codes=_frequencies(rows["control_code"]),
    )
    write_manifest(
        out_dir,
        stage="generation",
        inputs={"teacher": Path(teacher_dir), "control_codes": Path(control_codes_path)},
        outputs={"synthetic": path},
        extra={
            "n_samples": result.n_samples,
            "n_dropped_empty": dropped,
            "new_tokens": new_tokens,
            "seconds": seconds,
            "tokens_per_second": result.tokens_per_second,
        },
    )
    log.info(
        "generation: %d samples kept, %d empty dropped, %.0f new tokens/s",
        result.n_samples, dropped, result.tokens_per_second,
    )
    return result


def read_synthetic(path: Path) -> pa.Table:
    return pq.read_table(path)
