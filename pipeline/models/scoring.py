"""Scoring a causal LM on token data: summed next-token NLL per owner of each sequence, the
token-weighted mean NLL, and non-overlapping windows. Used by the evaluation, the
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


@torch.no_grad()
def nll_by_owner(
    model, data: ListIds | TokenIds, owners: list[int], n_owners: int, batch_size: int,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Summed next-token NLL and predicted-token count per owner of each sequence;
    `on_batch(sequences)` after each batch. Batches go to the model's device; the logits
    are upcast to fp32 before the log-softmax (bf16 weights or autocast). Batched by length
    (`by_length`): a record's last window, a short record or synthetic sample no longer pads
    its batch's other rows."""
    model.eval()
    device = next(model.parameters()).device
    nll_sum, count = np.zeros(n_owners), np.zeros(n_owners)
    for rows in by_length(data, batch_size):
        ids, lengths = data.collate([data[i] for i in rows])
        batch = {k: v.to(device) for k, v in lm_batch(ids, lengths).items()}
        labels = batch.pop("labels")  # (B, L-1)
        nll = next_token_nll(model(**batch).logits, labels)  # (B, L-1)
        for row, i in enumerate(rows):
            nll_sum[owners[i]] += float(nll[row].sum())
            count[owners[i]] += int((labels[row] != IGNORE).sum())
        if on_batch:
            on_batch(len(labels))
    return nll_sum, count


def mean_token_nll(model, data: ListIds | TokenIds, batch_size: int) -> float:
    """Token-weighted mean next-token NLL over the sequences of `data`."""
    nll, count = nll_by_owner(model, data, [0] * len(data), 1, batch_size)
    return float(nll[0] / max(count[0], 1))


def token_windows(ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows; a trailing window of one token predicts nothing and is dropped."""
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]
