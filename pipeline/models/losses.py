"""Distillation losses: pure functions, shapes in comments, safe when every token is masked.

    loss = (1 - α) · CE(student, labels)
         + α · T² · KL(softmax(teacher / T) ‖ softmax(student / T))
         + β · MSE(student hidden, teacher hidden)

(Hinton et al. 2015; DistilDP, Flemings & Annavaram 2024.) The T² factor keeps the
soft-target gradients on the same scale as the CE gradients when T changes. The KL
skips the control-code prompt: those tokens were given to the teacher, not written by
it, so its distribution there carries no knowledge worth copying (DistilDP skips the
first 5 tokens for the same reason).

All inputs are already shifted: position t of the logits predicts `labels[:, t]`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pipeline.batching import IGNORE


class TopKLogits(NamedTuple):
    """The teacher's k largest logits per token (raw, before temperature) and their token ids."""

    indices: torch.Tensor  # (B, T, k) long
    logits: torch.Tensor  # (B, T, k)


class DistillLoss(NamedTuple):
    loss: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    mse: torch.Tensor


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` (B, T) over `mask` (B, T); 0 (not NaN) when nothing is selected."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE over non-ignored labels. logits (B, T, V), labels (B, T)."""
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1).clamp(min=0),
        reduction="none",
    ).view(labels.shape)  # (B, T)
    return _masked_mean(nll, labels != IGNORE)


def kl_teacher_student(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Mean per-token KL(teacher_T ‖ student_T) over `mask`. logits (B, T, V), mask (B, T)."""
    log_p_s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, T, V)
    log_p_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (B, T, V)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)  # (B, T)
    return _masked_mean(kl, mask)


def kl_teacher_student_topk(
    student_logits: torch.Tensor, teacher: TopKLogits, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Mean per-token KL(teacher_T ‖ student_T) with the teacher known on its top-k tokens only.

    The teacher distribution is softmax(top-k logits / T) renormalised over those k tokens
    (the tail mass is dropped); the student's full-vocabulary log-probs are read at the same
    k ids. With k = V this is exactly `kl_teacher_student`. student_logits (B, T, V),
    teacher (B, T, k), mask (B, T).
    """
    log_p_s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, T, V)
    log_p_s_k = log_p_s.gather(-1, teacher.indices.long())  # (B, T, k)
    log_p_t = F.log_softmax(teacher.logits.float() / temperature, dim=-1)  # (B, T, k), renormalised
    kl = (log_p_t.exp() * (log_p_t - log_p_s_k)).sum(-1)  # (B, T)
    return _masked_mean(kl, mask)


def hidden_mse(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error of hidden states over `mask`. hidden (B, T, H), mask (B, T)."""
    se = (student_hidden.float() - teacher_hidden.float()).pow(2).mean(-1)  # (B, T)
    return _masked_mean(se, mask)


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | TopKLogits,
    labels: torch.Tensor,
    kl_mask: torch.Tensor,
    *,
    alpha: float,
    temperature: float,
    beta: float = 0.0,
    student_hidden: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
) -> DistillLoss:
    """(1-α)·CE + α·T²·KL + β·MSE. logits (B, T, V); labels, kl_mask (B, T); hidden (B, T, H).

    `kl_mask` selects the positions where the KL and MSE count (after the prompt, not
    padding); the CE counts every non-ignored label. `teacher_logits` is either dense
    (B, T, V) or cached `TopKLogits` (B, T, k), see `kl_teacher_student_topk`.
    """
    kl_mask = kl_mask & (labels != IGNORE)
    ce = cross_entropy(student_logits, labels)
    if isinstance(teacher_logits, TopKLogits):
        kl = kl_teacher_student_topk(student_logits, teacher_logits, kl_mask, temperature)
    else:
        kl = kl_teacher_student(student_logits, teacher_logits, kl_mask, temperature)
    zero = ce.new_zeros(())
    mse = zero
    if beta > 0:
        if student_hidden is None or teacher_hidden is None:
            raise ValueError("beta > 0 needs student_hidden and teacher_hidden")
        mse = hidden_mse(student_hidden, teacher_hidden, kl_mask)
    loss = (1 - alpha) * ce + alpha * temperature**2 * kl + beta * mse
    return DistillLoss(loss=loss, ce=ce, kl=kl, mse=mse)


def prompt_mask(n_targets: int, skip: torch.Tensor) -> torch.Tensor:
    """(B, T) mask of shifted positions whose *target* token index (t + 1) is >= skip (B,)."""
    target_index = torch.arange(1, n_targets + 1).unsqueeze(0)  # (1, T)
    return target_index >= skip.unsqueeze(1)  # (B, T)


def per_sequence_distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, *, alpha: float, temperature: float
) -> torch.Tensor:
    """(1-α)·CE + α·T²·KL per sequence, for DP-SGD with a KD loss (DPKD), where each example's
    loss must stay separate to be clipped. logits (B, T, V), labels (B, T) -> (B,)."""
    mask = (labels != IGNORE).to(student_logits.dtype)  # (B, T)
    count = mask.sum(1).clamp(min=1.0)  # (B,)
    nll = F.cross_entropy(
        student_logits.reshape(-1, student_logits.shape[-1]).float(), labels.reshape(-1).clamp(min=0), reduction="none"
    ).view(labels.shape)  # (B, T)
    log_p_s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, T, V)
    log_p_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (B, T, V)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)  # (B, T)
    ce_seq = (nll * mask).sum(1) / count  # (B,)
    kl_seq = (kl * mask).sum(1) / count  # (B,)
    return (1 - alpha) * ce_seq + alpha * temperature**2 * kl_seq
