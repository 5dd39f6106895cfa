"""Token batches shared by the stages: fixed-size rows plus lengths, and LM inputs/labels."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

IGNORE = -100


class TokenizedRecords(Dataset):
    """Sequences as fixed-size rows (right-padded to `max_length`) plus their true lengths.

    Fixed-size rows let Opacus build a well-shaped empty batch when Poisson sampling
    draws nobody; each batch is trimmed to its longest sequence by `lm_batch`.
    """

    def __init__(self, ids: list[list[int]], pad_id: int, max_length: int):
        self.lengths = torch.tensor([min(len(x), max_length) for x in ids], dtype=torch.long)
        self.ids = torch.full((len(ids), max_length), pad_id, dtype=torch.long)
        for i, x in enumerate(ids):
            x = x[:max_length]
            self.ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.lengths[i]


def lm_batch(ids: torch.Tensor, lengths: torch.Tensor, prompts: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Model inputs and next-token labels for right-padded rows.

    Returns input_ids / attention_mask / position_ids (B, L) and labels (B, L-1), where
    L is the longest length in the batch and padded targets are IGNORE: `logits[:, :-1]`
    predicts `labels`. With `prompts` (B,), each row's first prompts[b] tokens are no target
    either: a prompt template's tokens are given, not written (pipeline/prompts.py).
    """
    L = int(lengths.max())
    ids = ids[:, :L].contiguous()  # (B, L); Opacus' embedding ghost norms need contiguous ids
    B = ids.shape[0]
    positions = torch.arange(L).unsqueeze(0)  # (1, L)
    mask = positions < lengths.unsqueeze(1)  # (B, L)
    labels = ids[:, 1:].masked_fill(~mask[:, 1:], IGNORE)  # (B, L-1)
    if prompts is not None:
        labels = labels.masked_fill(positions[:, 1:] < prompts.unsqueeze(1), IGNORE)  # (B, L-1)
    return {
        "input_ids": ids,
        "attention_mask": mask.long(),
        # Explicit and contiguous: Opacus ghost clipping needs per-example position ids.
        "position_ids": positions.expand(B, L).contiguous(),
        "labels": labels,
    }

