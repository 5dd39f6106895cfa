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


def lm_batch(ids: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """Model inputs and next-token labels for right-padded rows.

    Returns input_ids / attention_mask / position_ids (B, L) and labels (B, L-1), where
    L is the longest length in the batch and padded targets are IGNORE: `logits[:, :-1]`
    predicts `labels`.
    """
    L = int(lengths.max())
    ids = ids[:, :L].contiguous()  # (B, L); Opacus' embedding ghost norms need contiguous ids
    B = ids.shape[0]
    positions = torch.arange(L).unsqueeze(0)  # (1, L)
    mask = positions < lengths.unsqueeze(1)  # (B, L)
    labels = ids[:, 1:].masked_fill(~mask[:, 1:], IGNORE)  # (B, L-1)
    return {
        "input_ids": ids,
        "attention_mask": mask.long(),
        # Explicit and contiguous: Opacus ghost clipping needs per-example position ids.
        "position_ids": positions.expand(B, L).contiguous(),
        "labels": labels,
    }


def length_bucketed_batches(lengths: torch.Tensor, batch_size: int, generator: torch.Generator,
                            chunk_batches: int) -> list[torch.Tensor]:
    """One epoch's batches of sample indices (every sample once), shuffled but with little padding.

    The epoch's random permutation is cut into chunks of `chunk_batches` batches; each chunk is
    sorted by length and cut into batches, and all the batches are shuffled. A batch holds
    samples of about one length drawn from a random chunk (the bucketing of Megatron and
    fairseq), so it pads little where a shuffled batch pads to its longest sample: ~30% of
    the demo's synthetic batches were padding. `chunk_batches=0`: the permutation cut into
    batches, as plain shuffling does. lengths (N,) -> batches of at most `batch_size` indices.
    """
    order = torch.randperm(len(lengths), generator=generator)  # (N,)
    if chunk_batches == 0:
        return list(order.split(batch_size))
    batches = []
    for chunk in order.split(batch_size * chunk_batches):
        by_length = chunk[torch.sort(lengths[chunk], stable=True).indices]
        batches += list(by_length.split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
