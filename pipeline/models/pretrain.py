"""Non-private training of a model on public token blocks, resumable, and its figures.

    figures = train_on_blocks(model, blocks, steps=500, batch_size=4, learning_rate=2e-4, name="student")

What builds models from public text uses it: the builtin pair's pretraining
(pipeline/models/base.py) and the student cut from a real model, healed against its teacher
(pipeline/models/student.py). Also the figures they report: parameters outside the embeddings
and perplexity on held-out public tokens. Never sees a private record.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.devices import adamw
from pipeline.models.scoring import mean_token_nll, token_windows
from pipeline.progress import ProgressLog
from pipeline.tokenized import ListIds

log = logging.getLogger(__name__)

VALIDATION_TOKENS = 100_000  # held-out public tokens scored after pretraining


def _lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a (B, L) block of token ids."""
    return model(input_ids=batch, labels=batch).loss


def train_on_blocks(
    model: torch.nn.Module, blocks: torch.Tensor, *, steps: int, batch_size: int, learning_rate: float, name: str,
    loss_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = _lm_loss,
    checkpoint: Path | None = None, checkpoint_every: int = 50, autocast: Callable[[], Any] = contextlib.nullcontext,
) -> dict:
    """Non-private training on random (batch_size, L) draws of public token `blocks` (N, L):
    AdamW, 10 % linear warm-up then cosine decay, gradients clipped to norm 1. `loss_of(model,
    batch)` is the loss (default: next-token CE; the student builder passes a distillation
    loss, pipeline/models/student.py). Progress lines with a rate and ETA. With `checkpoint`,
    the state (model, optimiser, schedule, the draws' generator) is saved there every
    `checkpoint_every` steps and a run that finds one continues from it, to the same result as
    an uninterrupted run; the caller deletes it once the model is saved. Batches go to the
    model's device; the losses run inside `autocast()` (bf16 mixed precision on a GPU, fp32
    master weights). Returns its figures."""
    # torch's loop, not the fused step: a rebuilt public model (e.g. `dpdistill models student`
    # in a new checkout) stays bit-identical to the one earlier runs of a study used
    opt = adamw(model.parameters(), learning_rate, weight_decay=0.01, fused=False)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup)
        * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps)))),
    )
    model.train()
    loss_value, t0 = float("nan"), time.monotonic()
    first = _resume_blocks(checkpoint, model, opt, sched) if checkpoint is not None else 0
    progress = ProgressLog(log, name, "steps", steps, done=first)
    device = next(model.parameters()).device
    for step in range(first, steps):
        idx = torch.randint(0, blocks.shape[0], (batch_size,))
        batch = blocks[idx].to(device)
        with autocast():
            loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        progress.update(step + 1, values={"loss": f"{loss_value:.3f}"})
        if checkpoint is not None and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            _save_blocks(checkpoint, step + 1, model, opt, sched)
    model.eval()
    return {
        "final_loss": loss_value,
        "tokens_seen": steps * batch_size * blocks.shape[1],
        "seconds": round(time.monotonic() - t0, 1),
        "non_embedding_parameters": non_embedding_parameters(model),
    }


def _save_blocks(path: Path, step: int, model, opt, sched) -> None:
    """The training state after `step` steps, written atomically (a kill mid-write leaves the last one)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "schedule": sched.state_dict(), "rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)


def _resume_blocks(path: Path, model, opt, sched) -> int:
    """The steps done by an interrupted run whose state is at `path` (0 without one), restored."""
    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["schedule"])
    torch.set_rng_state(state["rng"])
    log.info("resuming from step %d (%s)", state["step"], path)
    return state["step"]


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters outside the token and position embeddings (and a tied head), the size the
    issue's 'teacher at least 4x the student' compares."""
    emb = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    pos = getattr(getattr(model, "transformer", None), "wpe", None)
    if pos is not None:
        emb.add(id(pos.weight))
    return sum(p.numel() for p in model.parameters() if id(p) not in emb)


def encode_paragraphs(tok, paragraphs: list[str]) -> list[int]:
    """One token stream: each paragraph followed by eos (batch-encoded: fast on 60 MB)."""
    ids: list[int] = []
    for start in range(0, len(paragraphs), 10_000):
        for p in tok(paragraphs[start : start + 10_000], add_special_tokens=False)["input_ids"]:
            ids.extend(p)
            ids.append(tok.eos_token_id)
    return ids


def validation_perplexity(model, ids: list[int], context_length: int, pad_id: int, *,
                          max_tokens: int = VALIDATION_TOKENS, batch_size: int = 32) -> float | None:
    """Perplexity on non-overlapping windows of the first `max_tokens` held-out public tokens
    (None without any)."""
    windows = token_windows(ids[:max_tokens], context_length)
    if not windows:
        return None
    return round(math.exp(mean_token_nll(model, ListIds(windows, pad_id), batch_size=batch_size)), 2)
