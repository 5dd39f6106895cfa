"""Canary exposure (Carlini et al. 2019, "The Secret Sharer", arXiv:1802.08232).

    dpdistill audit --canaries 8 --config configs/demo.yaml [key=value ...]

Random secrets ("my account number is 3 9 2 7 1 4 8 5 6", digits from `secrets`) are
inserted into a copy of the training data, some of them several times, as real secrets
are; the pipeline is run on the copy, and each model is asked how likely each secret is
compared with R random candidates of the same format. The secret's rank among the R + 1
log-likelihoods gives its exposure, log2(R + 1) − log2(rank): log2(e) = 1.44 bits on
average for a model that never saw it (the rank is then uniform), up to log2(R + 1) when the secret ranks first. DP bounds how far the
exposure can rise with ε; a non-private model that memorises a repeated secret shows it.

The secrets are the tool's own, yet they stay out of the outputs: `canaries.json` and the
printed table carry exposures, ranks and counts only. The data copy holds them, as it must
to be trained on: it is written 0600 into a 0700 work directory that `flows/audit.py`
deletes when the audit ends.

No Prefect here: `flows/audit.py` runs the pipeline on the copy.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from pipeline.audits.audit import words
from pipeline.batching import TokenizedRecords, lm_batch
from pipeline.config import DataConfig
from pipeline.records import CODE_JOINER, code_name, encode_record, read_table

TEMPLATE = "my account number is {}"
DIGITS = 9
DEFAULT_REPETITIONS = (1, 1, 4, 16)
DEFAULT_CANDIDATES = 1000


@dataclass(frozen=True)
class Canary:
    id: int
    codes: dict[str, str]  # code column -> value, copied from a real record
    digits: str  # the secret; never printed or written outside the data copy
    repetitions: int

    @property
    def text(self) -> str:
        return TEMPLATE.format(" ".join(self.digits))

    def control_code(self, cfg: DataConfig) -> str:
        """The record's control code as the data stage builds it."""
        return CODE_JOINER.join(cfg.code_template.format(column=c, value=code_name(cfg, c, self.codes[c]))
                                for c in cfg.code_columns)


def make_canaries(n: int, table: pa.Table, cfg: DataConfig, repetitions=DEFAULT_REPETITIONS) -> list[Canary]:
    """`n` canaries with digits from `secrets`, repetitions cycling through `repetitions`,
    control codes copied from random existing records (with every code present)."""
    columns = {c: pc.cast(table[c], pa.string()).to_pylist() for c in cfg.code_columns}
    usable = [i for i in range(table.num_rows) if all(columns[c][i] and columns[c][i].strip() for c in columns)]
    if not usable:
        raise ValueError("no record has every control code set: cannot copy codes for the canaries")
    rng = secrets.SystemRandom()
    out, seen = [], set()
    for i in range(n):
        digits = "".join(secrets.choice("0123456789") for _ in range(DIGITS))
        while digits in seen:
            digits = "".join(secrets.choice("0123456789") for _ in range(DIGITS))
        seen.add(digits)
        row = rng.choice(usable)
        codes = {c: columns[c][row].strip() for c in cfg.code_columns}
        out.append(Canary(id=i, codes=codes, digits=digits, repetitions=repetitions[i % len(repetitions)]))
    return out


def write_canary_data(source: pa.Table, canaries: list[Canary], cfg: DataConfig, path: Path) -> int:
    """The training data (`source`, already cut to data.max_records) with every canary's
    copies inserted at random rows, as Parquet at `path`. Returns the number of rows added.
    Only the columns the data stage reads are kept; a canary's copies share one user."""
    keep = [*cfg.text_columns, *cfg.code_columns] + ([cfg.user_column] if cfg.user_column else [])
    rows = {c: pc.cast(source[c], pa.string()).to_pylist() for c in keep}
    rng = secrets.SystemRandom()
    added = 0
    for canary in canaries:
        for _ in range(canary.repetitions):
            at = rng.randrange(len(rows[cfg.text_columns[0]]) + 1)
            rows[cfg.text_columns[0]].insert(at, canary.text)  # its other text columns empty: left out
            for c in cfg.text_columns[1:]:
                rows[c].insert(at, None)
            for c in cfg.code_columns:
                rows[c].insert(at, canary.codes[c])
            if cfg.user_column:
                rows[cfg.user_column].insert(at, f"canary-user-{canary.id}")
            added += 1
    # The whole training file plus the secrets: readable by its owner only (0600) from its
    # creation, whatever the umask, as the data stage writes its splits.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        pq.write_table(pa.table({c: pa.array(v, pa.string()) for c, v in rows.items()}), f)
    return added


def read_source(cfg: DataConfig) -> pa.Table:
    table = read_table(cfg.path)
    return table.slice(0, cfg.max_records) if cfg.max_records else table


def candidates(n: int, exclude: set[str], seed: int) -> list[str]:
    """`n` distinct random digit strings of the canaries' length, none of them a secret."""
    rng = np.random.default_rng(seed)
    out: set[str] = set()
    while len(out) < n:
        s = "".join(map(str, rng.integers(0, 10, DIGITS)))
        if s not in exclude:
            out.add(s)
    return sorted(out)


@torch.no_grad()
def log_likelihoods(model, tokenizer, control_code: str, texts: list[str], batch_size: int = 256) -> np.ndarray:
    """log p(text + eos | control code) of each text, in nats, as the teacher was trained on
    it (`encode_record`): the summed log-probabilities of the tokens after the prefix."""
    model.eval()
    prefix = len(tokenizer.encode(control_code + "\n\n", add_special_tokens=False))
    ids = [encode_record(tokenizer, control_code, t) for t in texts]
    data = TokenizedRecords(ids, tokenizer.pad_token_id, max(map(len, ids)))
    out = np.zeros(len(texts))
    for start in range(0, len(texts), batch_size):
        batch = lm_batch(data.ids[start : start + batch_size], data.lengths[start : start + batch_size])
        labels = batch.pop("labels")  # (B, L-1)
        logp = torch.log_softmax(model(**batch).logits[:, :-1].float(), dim=-1)  # (B, L-1, V)
        mask = labels >= 0
        mask[:, : prefix - 1] = False  # the prefix is the same for every candidate
        picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, L-1)
        out[start : start + len(labels)] = (picked * mask).sum(dim=1).numpy()
    return out


def exposure(secret_ll: float, candidate_ll: np.ndarray) -> tuple[float, int]:
    """(exposure in bits, rank) of a secret among R candidates: rank 1 = most likely.
    Ties count against the secret (conservative: they lower its exposure)."""
    rank = 1 + int((candidate_ll >= secret_ll).sum())
    return math.log2(len(candidate_ll) + 1) - math.log2(rank), rank


def canary_exposures(
    model, tokenizer, canaries: list[Canary], cfg: DataConfig, n_candidates: int, seed: int
) -> list[dict]:
    """Exposure and rank of every canary under one model (same candidates for every model)."""
    secrets_ = {c.digits for c in canaries}
    pool = candidates(n_candidates, secrets_, seed)
    out = []
    for c in canaries:
        texts = [c.text] + [TEMPLATE.format(" ".join(d)) for d in pool]
        ll = log_likelihoods(model, tokenizer, c.control_code(cfg), texts)
        bits, rank = exposure(ll[0], ll[1:])
        out.append({"exposure": bits, "rank": rank})
    return out


def emissions(synthetic_texts: list[str], canaries: list[Canary]) -> list[int]:
    """How many synthetic texts hold each canary's digits verbatim (as whole words, any
    punctuation or spacing between them)."""
    normal = [" " + " ".join(words(t)) + " " for t in synthetic_texts]
    return [sum((" " + " ".join(c.digits) + " ") in t for t in normal) for c in canaries]


def copies_in(texts: list[str], canaries: list[Canary]) -> list[int]:
    """How many of each canary's copies a split holds (some may land in validation)."""
    counts = {c.text: 0 for c in canaries}
    for t in texts:
        if t in counts:
            counts[t] += 1
    return [counts[c.text] for c in canaries]


def summarise(rows: list[dict], models: list[str]) -> dict:
    """Mean and max exposure per model, and emitted canaries, by repetition count."""
    out = {}
    for reps in sorted({r["repetitions"] for r in rows}):
        group = [r for r in rows if r["repetitions"] == reps]
        out[str(reps)] = {
            "canaries": len(group),
            "copies_in_train": sum(r["copies_in_train"] for r in group),
            "emitted": sum(r["synthetic_emissions"] > 0 for r in group),
            **{m: {"mean": float(np.mean([r["exposure"][m] for r in group])),
                   "max": float(max(r["exposure"][m] for r in group))} for m in models},
        }
    return out


def format_table(summary: dict, models: list[str], max_bits: float) -> str:
    head = ["reps", "canaries", "in train", "emitted"] + [f"{m} mean/max" for m in models]
    rows = [head]
    for reps, s in summary.items():
        rows.append([reps, str(s["canaries"]), str(s["copies_in_train"]), str(s["emitted"])]
                    + [f"{s[m]['mean']:.2f} / {s[m]['max']:.2f}" for m in models])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines + [f"exposure in bits; {max_bits:.2f} = the secret ranks first; "
                               "a model that never saw it gives 1.44 on average (log2 e), often 0 to 3"])
