"""Stage 1: DP-SGD fine-tuning of the teacher on the private records, with Opacus 1.6.

Opacus is used as its API intends: `get_noise_multiplier` calibrates σ from the target
(ε, δ), the sampling rate and the exact number of steps, `PrivacyEngine.make_private`
wraps model, optimizer and loader; Poisson sampling;
BatchMemoryManager splits large logical batches into physical ones. ε in the ledger is
whatever the accountant says after the last step.

Two clipping modes: `ghost` (Li et al. 2021: per-example norms without materialising
per-example gradients, memory close to non-private training) and `hooks` (Opacus'
per-sample gradients, the reference). For ghost clipping GPT-2 needs an untied
`lm_head` and explicit contiguous (B, T) `position_ids`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.accountants.utils import get_noise_multiplier
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch.utils.data import DataLoader

from pipeline.batching import IGNORE, TokenizedRecords, lm_batch
from pipeline.config import TeacherConfig
from pipeline.data import encode_record, read_split
from pipeline.evaluate import perplexity
from pipeline.ledger import LedgerEntry
from pipeline.manifest import atomic_write_json, write_manifest
from pipeline.models import load_causal_lm, load_tokenizer, untie_lm_head
from pipeline import privacy  # noqa: F401  (registers Conv1D ghost-norm and grad samplers)

log = logging.getLogger(__name__)


class TeacherError(ValueError):
    """The teacher stage cannot run as configured; the message says what to change."""


@dataclass
class TeacherResult:
    checkpoint: Path
    ledger: LedgerEntry
    train_loss: list[float] = field(default_factory=list)
    validation_loss: float = float("nan")


def per_sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of each sequence: logits (B, L, V), labels (B, L-1) -> (B,)."""
    logits = logits[:, :-1]  # (B, L-1, V)
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="none"
    ).view(labels.shape)  # (B, L-1)
    valid = (labels != IGNORE).sum(1).clamp(min=1)  # (B,)
    return nll.sum(1) / valid


def _noise_only_step(model: torch.nn.Module, optimizer, mode: str) -> None:
    """Poisson sampling drew an empty logical batch: the step still happens (noise only),
    so the accountant's step count matches what was released."""
    for p in model.parameters():
        if p.requires_grad:
            if mode == "ghost":
                p.grad = torch.zeros_like(p)
            else:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _steps_accounted(engine: PrivacyEngine) -> int:
    return int(sum(steps for _, _, steps in engine.accountant.history))


def train_teacher(
    cfg: TeacherConfig,
    *,
    train_path: Path,
    validation_path: Path,
    base_model: str,
    out_dir: Path,
    seed: int,
) -> TeacherResult:
    """DP fine-tune `base_model` on the private training split; save it to `out_dir/model`."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    out_dir = Path(out_dir)
    tok = load_tokenizer(base_model)
    model = load_causal_lm(base_model)
    untie_lm_head(model)
    n_positions = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    if cfg.max_length > n_positions:
        raise TeacherError(
            f"teacher.max_length={cfg.max_length} exceeds the model's {n_positions} positions; "
            f"set teacher.max_length <= {n_positions}"
        )

    codes, texts = read_split(train_path)
    n = len(texts)
    train = TokenizedRecords(
        [encode_record(tok, c, t, cfg.max_length) for c, t in zip(codes, texts)], tok.pad_token_id, cfg.max_length
    )
    if cfg.batch_size >= n:
        raise TeacherError(
            f"teacher.batch_size={cfg.batch_size} is not smaller than the {n} training records; "
            "Poisson sampling needs a sampling rate below 1: lower teacher.batch_size"
        )
    delta = cfg.target_delta if cfg.target_delta is not None else 1.0 / n
    if delta > 1.0 / n:
        log.warning("teacher: δ=%.3g is not below 1/N=%.3g; the guarantee is weak", delta, 1.0 / n)

    if not cfg.secure_mode:
        log.warning(
            "teacher: secure_mode is off, DP noise comes from a non-cryptographic RNG; fine for "
            "experiments, set teacher.secure_mode=true for a production release"
        )
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(train, batch_size=cfg.batch_size, shuffle=False, generator=generator)
    model.train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    )
    try:
        engine = PrivacyEngine(accountant=cfg.accountant, secure_mode=cfg.secure_mode)
    except ImportError as e:
        raise TeacherError(
            "teacher.secure_mode=true needs the torchcsprng package, which is not installed "
            "(and has no release for every torch version); install it, or set "
            "teacher.secure_mode=false to draw the noise from torch's default generator"
        ) from e
    # Poisson sampling set up as make_private would, but here, so that σ is calibrated for
    # exactly the steps that run and the rate the accountant records. Opacus' sampler runs
    # int(1 / q) steps per epoch and make_private accounts q' = 1 / steps >= q (for q = 1/99:
    # 98 steps accounted at 1/98). make_private_with_epsilon calibrates for
    # int(epochs / q) steps instead, which can differ by one and overspend the budget.
    poisson_loader = DPDataLoader.from_data_loader(
        loader, generator=engine.secure_rng if cfg.secure_mode else generator
    )
    sampling_probability = poisson_loader.sample_rate
    sample_rate = 1.0 / len(poisson_loader)  # the rate make_private hands the accountant
    total_steps = cfg.epochs * len(poisson_loader)
    try:
        sigma = get_noise_multiplier(
            target_epsilon=cfg.target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=total_steps,
            accountant=cfg.accountant,
        )
    except ValueError as e:
        raise TeacherError(
            f"Opacus could not calibrate the noise for ε={cfg.target_epsilon}, δ={delta:.3g}, "
            f"q={sample_rate:.4g}, {total_steps} steps: {e}. Raise teacher.target_epsilon, "
            "or change teacher.batch_size / teacher.epochs"
        ) from e
    private = dict(
        module=model,
        optimizer=optimizer,
        data_loader=poisson_loader,
        noise_multiplier=sigma,
        max_grad_norm=cfg.max_grad_norm,
        poisson_sampling=False,  # the loader above already samples with Poisson
        grad_sample_mode=cfg.grad_sample_mode,
    )
    if cfg.grad_sample_mode == "ghost":
        private["criterion"] = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
        dp_model, optimizer, criterion, loader = engine.make_private(**private)
    else:
        dp_model, optimizer, loader = engine.make_private(**private)
        criterion = None
    dp_model.forbid_grad_accumulation()  # what make_private does for Poisson sampling
    log.info(
        "teacher: N=%d, q=%.4f, %d steps, σ=%.4f, C=%.2f, target ε=%.2f, δ=%.3g, %s clipping",
        n, sample_rate, total_steps, optimizer.noise_multiplier, cfg.max_grad_norm,
        cfg.target_epsilon, delta, cfg.grad_sample_mode,
    )

    history: list[dict] = []
    t0 = time.time()
    for epoch in range(cfg.epochs):
        with BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=cfg.physical_batch_size, optimizer=optimizer
        ) as physical_loader:
            step_loss, step_count = 0.0, 0
            for ids, lengths in physical_loader:
                if ids.shape[0] == 0:
                    _noise_only_step(dp_model, optimizer, cfg.grad_sample_mode)
                else:
                    batch = lm_batch(ids, lengths)
                    labels = batch.pop("labels")
                    logits = dp_model(**batch).logits  # (B, L, V)
                    if criterion is not None:
                        shifted = logits[:, :-1]  # (B, L-1, V)
                        loss = criterion(
                            shifted.reshape(-1, shifted.shape[-1]), labels.reshape(-1), shape=shifted.shape
                        )
                    else:
                        loss = per_sequence_loss(logits, labels).mean()
                    loss.backward()
                    step_loss += loss.item() * ids.shape[0]
                    step_count += ids.shape[0]
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if optimizer._is_last_step_skipped:
                    continue  # logical batch not finished yet
                done = _steps_accounted(engine)
                record = {"step": done, "epoch": epoch, "loss": step_loss / max(step_count, 1)}
                step_loss, step_count = 0.0, 0
                if done % cfg.log_every == 0 or done == total_steps:
                    record["epsilon"] = engine.get_epsilon(delta)
                    log.info(
                        "teacher: step %d/%d loss %.4f ε=%.3f (%.0f s)",
                        done, total_steps, record["loss"], record["epsilon"], time.time() - t0,
                    )
                history.append(record)

    steps = _steps_accounted(engine)
    epsilon = engine.get_epsilon(delta)
    assert steps == total_steps, (steps, total_steps)
    assert {q for _, q, _ in engine.accountant.history} == {sample_rate}
    if epsilon > cfg.target_epsilon * (1 + 1e-6):
        raise TeacherError(
            f"accountant reports ε={epsilon:.4f} above the target {cfg.target_epsilon}; "
            "refusing to release this teacher"
        )
    dp_model._close()  # remove Opacus hooks and per-sample state before saving
    model.eval()
    val_codes, val_texts = read_split(validation_path)
    validation_loss = float("nan")
    if val_texts:
        ppl = perplexity(model, tok, val_codes, val_texts, cfg.max_length, cfg.physical_batch_size)
        validation_loss = math.log(ppl.windowed)
        log.info("teacher: validation perplexity %.2f", ppl.windowed)

    ckpt = out_dir / "model"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    torch.save(
        {"accountant": engine.accountant.state_dict(), "mechanism": engine.accountant.mechanism()},
        out_dir / "accountant_state.pt",
    )
    entry = LedgerEntry(
        stage="teacher",
        private=True,
        epsilon=epsilon,
        delta=delta,
        accountant=cfg.accountant,
        noise_multiplier=optimizer.noise_multiplier,
        sample_rate=sample_rate,
        steps=steps,
        max_grad_norm=cfg.max_grad_norm,
        privacy_unit="record",
        note=f"DP-SGD on the private training split (N={n}), Poisson sampling with probability "
        f"{sampling_probability:.6g} (accounted as q={sample_rate:.6g}), "
        f"{cfg.grad_sample_mode} clipping, lm_head untied from the input embedding; "
        f"σ calibrated by Opacus for target ε={cfg.target_epsilon}",
    )
    atomic_write_json(
        out_dir / "training_log.json",
        {"history": history, "validation_loss": validation_loss, "seconds": time.time() - t0},
    )
    write_manifest(
        out_dir,
        stage="teacher",
        inputs={"train": train_path, "validation": validation_path},
        outputs={"model": ckpt, "accountant_state": out_dir / "accountant_state.pt"},
        extra={"base_model": base_model, "ledger": entry.model_dump()},
    )
    return TeacherResult(
        checkpoint=ckpt, ledger=entry, train_loss=[h["loss"] for h in history], validation_loss=validation_loss
    )


def load_training_log(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "training_log.json").read_text())
