"""Choosing the distilled student among candidate settings, from DP outputs only (issue 20).

The student is trained once per candidate (`distill.candidates`: α, T, β, kl_skip_tokens,
epochs, ...) and the one closest to the DP teacher is kept. "Closest" is measured on a
fresh set of texts the DP teacher samples from its *whole* distribution: no top-k, no top-p,
temperature 1. The synthetic training data is truncated (top-k 50, top-p 0.9), so a CE on it
rewards a student that learned the truncated distribution, whose tail never happens; the
test data has a tail. (The reference study saw the CE on the truncated synthetic validation
split rank α the wrong way on Yelp; its figures are withdrawn, no tracked file holds them:
docs/reference.md.)

- `teacher_kl`: mean per-token KL(teacher ‖ student) over the untruncated samples, every
  position (control codes and eos included, as the test perplexity counts them).
- `untruncated_ce`: the student's mean per-token CE on the same samples. It equals the KL
  plus the teacher's entropy, which is the same for every student: the same ranking in
  expectation, with the sampling noise of one token instead of the teacher's whole
  next-token distribution.
- `synthetic_validation_ce`: the best CE on the truncated synthetic validation split during
  training (the early-stopping signal), kept for comparison.

Privacy: the criterion reads the DP teacher, texts it samples, and the control codes of the
synthetic data (drawn from the DP release): post-processing, no cost in the ledger. No
private record, validation or test, is read.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch

from pipeline.batching import IGNORE, lm_batch
from pipeline.models.losses import kl_teacher_student
from pipeline.models.scoring import by_length
from pipeline.reports import SELECTION_CRITERIA as CRITERIA
from pipeline.stages.generate import synthetic_head, synthetic_prompt
from pipeline.stages.sampling import sample_untruncated
from pipeline.tokenized import ListIds

log = logging.getLogger(__name__)

CODE_SAMPLE = 10_000  # synthetic samples whose control codes give the prompts' frequencies


def _selection_seed(seed: int) -> int:
    """A seed for the selection samples, apart from every shard's (shards use (seed, shard))."""
    return int(np.random.SeedSequence([seed, 0, 1]).generate_state(1)[0])


def selection_set(teacher, tok, synthetic_path, n: int, max_length: int, seed: int, batch_size: int = 64) -> ListIds:
    """`n` texts the DP teacher samples without truncation, prompted by control codes drawn with
    the frequencies of the synthetic data's codes (which came from the DP code release)."""
    codes = synthetic_head(synthetic_path, CODE_SAMPLE, columns=("control_code",))["control_code"].to_pylist()
    frequencies = {c: k / len(codes) for c, k in sorted(Counter(codes).items())}
    sequences = sample_untruncated(teacher, tok, frequencies, n, max_length, _selection_seed(seed), batch_size,
                                   prompt=synthetic_prompt(synthetic_path))  # prompted as the synthetic set was
    return ListIds(sequences, tok.pad_token_id)


@torch.no_grad()
def score_students(teacher, students: dict[str, torch.nn.Module], selection: ListIds, vocab: int,
                   batch_size: int, autocast=None) -> dict[str, dict[str, float]]:
    """`teacher_kl` and `untruncated_ce` of each student on the selection set, token-weighted
    over every predicted position. The teacher runs once per batch for all students."""
    teacher.eval()
    for s in students.values():
        s.eval()
    device = next(teacher.parameters()).device
    kl_sum = dict.fromkeys(students, 0.0)
    ce_sum = dict.fromkeys(students, 0.0)
    tokens = 0
    for rows in by_length(selection, batch_size):
        ids, lengths = selection.collate([selection[i] for i in rows])
        batch = {k: v.to(device) for k, v in lm_batch(ids, lengths).items()}
        labels = batch.pop("labels")  # (B, L-1)
        mask = labels != IGNORE  # (B, L-1)
        n = int(mask.sum())
        with autocast() if autocast else torch.autocast("cpu", enabled=False):
            t_logits = teacher(**batch).logits[:, :-1, :vocab].float()  # (B, L-1, V)
            for name, student in students.items():
                s_logits = student(**batch).logits[:, :-1, :vocab].float()  # (B, L-1, V)
                kl_sum[name] += float(kl_teacher_student(s_logits, t_logits, mask, 1.0)) * n
                nll = torch.nn.functional.cross_entropy(
                    s_logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
                ce_sum[name] += float(nll)
        tokens += n
    tokens = max(tokens, 1)
    return {name: {"teacher_kl": kl_sum[name] / tokens, "untruncated_ce": ce_sum[name] / tokens}
            for name in students}


def choose(rows: list[dict], select_by: str) -> str:
    """The candidate with the lowest `select_by` (the first listed on a tie)."""
    scored = [r for r in rows if r.get(select_by) is not None]
    if not scored:
        raise ValueError(f"no candidate has a {select_by} value; use another distill.select_by")
    return min(scored, key=lambda r: r[select_by])["candidate"]


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None below 3 pairs."""
    if len(x) < 3:
        return None

    def ranks(v):
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in set(v):  # ties share their mean rank
            tied = [i for i, w in enumerate(v) if w == value]
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(list(x)), ranks(list(y))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def criterion_study(rows: list[dict], target: str = "test_perplexity") -> dict[str, dict]:
    """For candidates evaluated on the test split: how each criterion ranks them against their
    test perplexity `target` (`test_perplexity`, windowed; `test_text_perplexity`, the same with
    the control-code header left out of the targets): Spearman ρ, the candidate it would choose,
    and its regret (its figure minus the best). Test-split aggregates: not protected, and never
    an input to the choice (which is made before evaluation)."""
    rated = [r for r in rows if r.get(target) is not None]
    if len(rated) < 2:
        return {}
    best = min(r[target] for r in rated)
    out = {}
    for criterion in CRITERIA:
        pairs = [r for r in rated if r.get(criterion) is not None]
        if len(pairs) < 2:
            continue
        chosen = min(pairs, key=lambda r: r[criterion])
        out[criterion] = {
            "spearman": spearman([r[criterion] for r in pairs], [r[target] for r in pairs]),
            "chooses": chosen["candidate"],
            "regret": chosen[target] - best,
        }
    return out


def log_selection(rows: list[dict], chosen: str, select_by: str) -> None:
    for r in rows:
        private = f", private validation (noisy) {_fmt(r['private_validation'])}" if "private_validation" in r else ""
        log.info("distillation: candidate %s: teacher_kl %s, untruncated_ce %s, synthetic validation CE %s%s%s",
                 r["candidate"], _fmt(r.get("teacher_kl")), _fmt(r.get("untruncated_ce")),
                 _fmt(r.get("synthetic_validation_ce")), private, "  <- chosen" if r["candidate"] == chosen else "")
    log.info("distillation: kept candidate %s (lowest %s)", chosen, select_by)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
