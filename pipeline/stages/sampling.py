"""What the DP teacher writes for one shard of generation: prompts drawn from the released
control-code distribution, each engine's samples, the rows and their counts.

    rows, stats = sample_shard(model, tok, cfg, counts, first_id, n, shard_seed)

Two engines draw from the same distribution (top-k / top-p with a temperature, optionally
`no_repeat_ngram_size`, at most `max_length` tokens with the prompt): `fast` (the default,
pipeline/models/decoding.py: `batch_size` rows over a KV cache, each refilled with the next
prompt as its sample ends) and `hf`, the reference (transformers' `generate` on batches of
prompts of equal token length). They consume the random stream differently, so a seed gives
other samples with each. A shard's prompts and samples come from its seed alone.

The stage around it (pipeline/stages/generate.py) lays out the shards, writes each as Parquet
and adds them up; the selection criterion (pipeline/stages/selection.py) takes the teacher's
untruncated samples from here (`sample_untruncated`). Reads no private record.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import torch

from pipeline.config import GenerateConfig
from pipeline.models import decoding
from pipeline.prompts import HEADER, PromptFormat

# A synthetic shard's columns, one row a sample: what `sample_shard`'s rows hold.
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


def sample_control_codes(counts: dict[str, float], n: int, rng: np.random.Generator) -> list[str]:
    """Draw `n` control codes i.i.d. with the frequencies in `counts`."""
    codes = sorted(counts)
    p = np.array([counts[c] for c in codes], dtype=float)
    if len(codes) == 0 or p.sum() <= 0:
        raise ValueError("control-code counts are empty; the data stage found no training records")
    draws = rng.choice(len(codes), size=n, p=p / p.sum())
    return [codes[i] for i in draws]


def _validation_positions(kept: list[int], fraction: float, rng: np.random.Generator) -> set[int]:
    """The kept samples marked split='validation': `fraction` of them rounded up, so that a shard
    of 2 or more kept samples always has one (20 samples at 1% gave none when each sample was
    drawn at random). Chosen among the kept samples: a dropped empty one cannot take the place.
    Never all of them: fraction < 0.5 leaves at least one training sample."""
    n_validation = math.ceil(fraction * len(kept)) if len(kept) >= 2 else 0
    return {int(i) for i in rng.choice(kept, size=n_validation, replace=False)} if n_validation else set()


def _budget(cfg: GenerateConfig, prompt_length: int) -> int:
    """New tokens a sample may have: up to max_length in all, and max_new_tokens when set."""
    budget = cfg.max_length - prompt_length
    return min(budget, cfg.max_new_tokens) if cfg.max_new_tokens else budget


def _hf_samples(model, cfg: GenerateConfig, prompts: list[list[int]], eos: int):
    """The reference engine (generate.engine=hf): transformers' generate on batches of prompts
    of equal length (no padding), each batch running until its longest sample ends. Yields each
    batch's (prompt index, new tokens without eos, whether eos ended it)."""
    device = next(model.parameters()).device
    by_length: dict[int, list[int]] = defaultdict(list)  # prompt length -> prompt indices
    for i, prompt in enumerate(prompts):
        by_length[len(prompt)].append(i)
    for length in sorted(by_length):
        positions = by_length[length]
        for start in range(0, len(positions), cfg.batch_size):
            chunk = positions[start : start + cfg.batch_size]
            input_ids = torch.tensor([prompts[i] for i in chunk], device=device)  # (B, P), equal lengths
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=True,
                    top_k=cfg.top_k,
                    top_p=cfg.top_p,
                    temperature=cfg.temperature,
                    no_repeat_ngram_size=cfg.no_repeat_ngram_size or None,
                    max_new_tokens=_budget(cfg, length),
                    use_cache=True,
                    pad_token_id=eos,
                    eos_token_id=eos,
                )  # (B, <= P + budget)
            rows = []
            for i, row in zip(chunk, out.tolist()):
                new = row[length:]
                finished = eos in new
                rows.append((i, new[: new.index(eos)] if finished else new, finished))
            yield rows


def _fast_samples(model, cfg: GenerateConfig, prompts: list[list[int]], eos: int):
    """The default engine (generate.engine=fast, pipeline/models/decoding.py): `batch_size`
    rows decoded at a time, each refilled with the next prompt as its sample ends. Yields the
    ended samples a batch_size at a time (the progress granularity of the hf engine)."""
    ended = []
    rows_by_step = decoding.sample(model, prompts, [_budget(cfg, len(p)) for p in prompts], eos=eos,
                                   slots=cfg.batch_size, max_length=cfg.max_length, top_k=cfg.top_k, top_p=cfg.top_p,
                                   temperature=cfg.temperature, no_repeat_ngram_size=cfg.no_repeat_ngram_size)
    try:
        for rows in rows_by_step:
            ended += rows
            if len(ended) >= cfg.batch_size:
                yield ended
                ended = []
    except decoding.FastDecodeError as e:
        raise GenerateError(str(e)) from e
    if ended:
        yield ended


def sample_shard(
    model, tok, cfg: GenerateConfig, counts: dict[str, float], first_id: int, n: int, shard_seed: int,
    on_batch: Callable[[int, int], None] | None = None, keep_empty: bool = False, prompt: PromptFormat = HEADER,
) -> tuple[dict[str, list], dict]:
    """Rows and stats of one shard of `n` samples with ids first_id, first_id + 1, ...;
    `on_batch(samples, new_tokens)` after each batch, with the shard's totals so far."""
    rng = np.random.default_rng(shard_seed)
    torch.manual_seed(shard_seed)
    eos = tok.eos_token_id
    n_prompts = math.ceil(n / cfg.samples_per_prompt)
    requested = [c for c in sample_control_codes(counts, n_prompts, rng) for _ in range(cfg.samples_per_prompt)][:n]
    prompt_ids = {c: prompt.ids(tok, c) for c in set(requested)}
    prompts = [prompt_ids[c] for c in requested]
    assert max(map(len, prompts)) < cfg.max_length, "plan_generation checks prompt lengths"
    engine = _fast_samples if cfg.engine == "fast" else _hf_samples

    kept: dict[int, tuple] = {}
    dropped, new_tokens, samples_done = 0, 0, 0
    for ended in engine(model, cfg, prompts, eos):
        for i, new, finished in ended:
            new_tokens += len(new)
            text = tok.decode(new, skip_special_tokens=True)
            if not text.strip() and not keep_empty:
                dropped += 1  # prompt-only generation: counted, not kept
                continue
            kept[i] = (text, prompts[i] + new + ([eos] if finished else []), len(prompts[i]), finished)
        samples_done += len(ended)
        if on_batch:
            on_batch(samples_done, new_tokens)

    validation = _validation_positions(sorted(kept), cfg.validation_fraction, rng)
    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    for i in sorted(kept):
        text, seq, length, finished = kept[i]
        rows["sample_id"].append(first_id + i)
        rows["split"].append("validation" if i in validation else "train")
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


def sample_untruncated(model, tok, codes: dict[str, float], n: int, max_length: int, seed: int,
                       batch_size: int = 64, prompt: PromptFormat = HEADER) -> list[list[int]]:
    """`n` sequences (prompt + text + eos when finished) the model samples from its whole
    distribution: no top-k, no top-p, temperature 1, prompts drawn with `codes`' frequencies.
    Empty generations are kept (the model chose eos: that is part of its distribution).
    What distillation's selection criterion compares students with (pipeline/stages/distill.py)."""
    cfg = GenerateConfig(num_samples=n, batch_size=batch_size, top_k=0, top_p=1.0, temperature=1.0,
                         max_length=max_length, validation_fraction=0.0,
                         engine="hf" if decoding.fast_decode_problem(model, max_length) else "fast")
    rows, stats = sample_shard(model, tok, cfg, codes, 0, n, seed, keep_empty=True, prompt=prompt)
    return rows["token_ids"]
