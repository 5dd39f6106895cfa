"""Scoring a causal LM on token data: summed next-token NLL per owner of each sequence (and
over a marked part of each sequence, from the same forward passes), the token-weighted mean
NLL, and non-overlapping windows. Used by the evaluation, the
distillation's validation and the base models' held-out perplexity."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pipeline.batching import IGNORE, lm_batch
from pipeline.models.losses import next_token_nll
from pipeline.tokenized import ListIds, TokenIds


def by_length(data: ListIds | TokenIds, batch_size: int) -> list[list[int]]:
    """The indices of `data` in batches of `batch_size`, shortest sequences first: each batch
    pads to little more than its own rows (issue 22). Scores summed over batches are the
    same in any order."""
    order = np.argsort(data.lengths(), kind="stable").tolist()
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def nll_by_owner(
    model, data: ListIds | TokenIds, owners: list[int], n_owners: int, batch_size: int,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Summed next-token NLL and predicted-token count per owner of each sequence;
    `on_batch(sequences)` after each batch. Batches go to the model's device; the logits
    are upcast to fp32 before the log-softmax (bf16 weights or autocast). Batched by length
    (`by_length`): a record's last window, a short record or synthetic sample no longer pads
    its batch's other rows."""
    nll, count, _, _ = _nll_sums(model, data, owners, n_owners, batch_size, on_batch, None)
    return nll, count


def nll_by_owner_and_part(
    model, data: ListIds | TokenIds, owners: list[int], n_owners: int, batch_size: int,
    part: list[np.ndarray], on_batch: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`nll_by_owner`'s sums, and beside them the same sums over the targets inside `part`:
    `part[i]` marks which tokens of sequence i count (bool, one per token; the first token is
    never a target). From the same forward passes: the second sum only masks the first's
    targets (the evaluation's text-only perplexity, with the control-code header left out)."""
    return _nll_sums(model, data, owners, n_owners, batch_size, on_batch, part)


@torch.no_grad()
def _nll_sums(model, data, owners, n_owners, batch_size, on_batch, part):
    model.eval()
    device = next(model.parameters()).device
    nll_sum, count = np.zeros(n_owners), np.zeros(n_owners)
    part_sum, part_count = np.zeros(n_owners), np.zeros(n_owners)
    for rows in by_length(data, batch_size):
        ids, lengths = data.collate([data[i] for i in rows])
        batch = {k: v.to(device) for k, v in lm_batch(ids, lengths).items()}
        labels = batch.pop("labels")  # (B, L-1)
        nll = next_token_nll(model(**batch).logits, labels)  # (B, L-1), 0 where IGNORE
        if part is not None:
            inside = torch.zeros(labels.shape, dtype=torch.bool)  # (B, L-1): target t predicts token t+1
            for row, i in enumerate(rows):
                mask = torch.as_tensor(np.asarray(part[i], dtype=bool)[1:])
                inside[row, : len(mask)] = mask
            inside = inside.to(device) & (labels != IGNORE)
            in_nll = torch.where(inside, nll, 0.0).sum(dim=1).tolist()  # (B,)
            in_count = inside.sum(dim=1).tolist()  # (B,)
        for row, i in enumerate(rows):
            nll_sum[owners[i]] += float(nll[row].sum())
            count[owners[i]] += int((labels[row] != IGNORE).sum())
            if part is not None:
                part_sum[owners[i]] += in_nll[row]
                part_count[owners[i]] += in_count[row]
        if on_batch:
            on_batch(len(labels))
    return nll_sum, count, part_sum, part_count


def mean_token_nll(model, data: ListIds | TokenIds, batch_size: int) -> float:
    """Token-weighted mean next-token NLL over the sequences of `data`."""
    nll, count = nll_by_owner(model, data, [0] * len(data), 1, batch_size)
    return float(nll[0] / max(count[0], 1))


def token_windows(ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows; a trailing window of one token predicts nothing and is dropped."""
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]
