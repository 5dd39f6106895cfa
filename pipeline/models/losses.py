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
    """The teacher's k largest logits per token (raw, before temperature) and their token ids;
    with `logsumexp` (of all V raw logits, per token) the mass of the other V - k tokens is
    known too (the "rest" bucket of `kl_teacher_student_topk`)."""

    indices: torch.Tensor  # (B, T, k) long
    logits: torch.Tensor  # (B, T, k)
    logsumexp: torch.Tensor | None = None  # (B, T)


class DistillLoss(NamedTuple):
    loss: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    mse: torch.Tensor


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` (B, T) over `mask` (B, T); 0 (not NaN) when nothing is selected."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) in fp32 (B, T, V). No division at T = 1: on (B, T, V) every
    elementwise pass is a copy of the largest tensor of the step, forward and backward (issue 22)."""
    logits = logits.float()
    return F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)


def _nll(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log p(label) (B, T) from log-probs (B, T, V); ignored labels read token 0 (masked later)."""
    return -log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def _kl(log_p_t: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-token KL(p_t ‖ q) = Σ p_t·log p_t − Σ p_t·log q (B, T) from log-probs (B, T, V).

    Two dot products over V, each one fused pass that writes no (B, T, V) temporary (the
    difference-then-product form took four passes and two such tensors); the teacher's term
    carries no gradient. Identical inputs give exactly 0: the two dots are the same sums."""
    p_t = log_p_t.exp()  # (B, T, V)
    return torch.einsum("btv,btv->bt", p_t, log_p_t) - torch.einsum("btv,btv->bt", p_t, log_q)


def next_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token NLL, fp32: logits (B, L, V) of whole `lm_batch` rows, labels
    (B, L-1) as `lm_batch` makes them (position t predicts labels[:, t]) -> (B, L-1), 0 where
    a label is IGNORE. The logits are not cut to `[:, :-1]`: that view is not contiguous, so
    flattening it copied the (B, L-1, V) logits, and in training their gradient back into a
    (B, L, V) one; the last position gets an IGNORE label instead. The same values and
    gradients, bitwise. Alone in a process that copy cost ~120 ms of a 32 × 128 × 8192 CE
    forward and backward, but in the stages, whose allocator reuses freed memory
    (devices.reuse_freed_memory), no step changed beyond the noise (bench/kernel_choices.py:
    0.99-1.05x): the one NLL of the teacher's loss and every scoring pass."""
    B, L, V = logits.shape
    targets = F.pad(labels, (0, 1), value=IGNORE)  # (B, L)
    nll = F.cross_entropy(logits.float().reshape(B * L, V), targets.reshape(B * L), ignore_index=IGNORE,
                          reduction="none")  # (B·L,)
    return nll.view(B, L)[:, :-1]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE over non-ignored labels. logits (B, T, V), labels (B, T)."""
    return _masked_mean(_nll(_log_softmax(logits), labels), labels != IGNORE)


def kl_teacher_student(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Mean per-token KL(teacher_T ‖ student_T) over `mask`. logits (B, T, V), mask (B, T)."""
    return _masked_mean(_kl(_log_softmax(teacher_logits, temperature), _log_softmax(student_logits, temperature)), mask)


def kl_teacher_student_topk(
    student_logits: torch.Tensor, teacher: TopKLogits, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Mean per-token KL(teacher_T ‖ student_T) with the teacher known on its top-k tokens only.

    With the teacher's `logsumexp` and T = 1: the KL between the two distributions coarsened to
    k + 1 outcomes, the k tokens and one bucket for the rest of the vocabulary, whose teacher
    mass is 1 - Σ_k p_t and student mass 1 - Σ_k q. The student is pulled to the teacher's
    probabilities on the k tokens and to its total mass on the rest, not to the rest's shape
    (a lower bound of the dense KL, equal to it when the rest carries no mass). Without it,
    or at T ≠ 1 (the cached sum is at T = 1): softmax(top-k logits / T) renormalised over
    the k tokens, the rest's mass dropped, which pulls the student's whole mass onto them.
    With k = V both are exactly `kl_teacher_student`. student_logits (B, T, V), teacher
    (B, T, k), mask (B, T).
    """
    return _masked_mean(_kl_topk(_log_softmax(student_logits, temperature), teacher, temperature), mask)


def _kl_topk(log_q: torch.Tensor, teacher: TopKLogits, temperature: float) -> torch.Tensor:
    """Per-token KL (B, T) of the top-k teacher (with its rest bucket when known) against the
    log-probs (B, T, V)."""
    log_q_k = log_q.gather(-1, teacher.indices.long())  # (B, T, k)
    if teacher.logsumexp is None or temperature != 1.0:
        return _kl(_log_softmax(teacher.logits, temperature), log_q_k)  # teacher (B, T, k), renormalised
    log_p_k = teacher.logits.float() - teacher.logsumexp.float().unsqueeze(-1)  # (B, T, k): exact log-probs
    p_rest = (1 - log_p_k.exp().sum(-1)).clamp(min=0.0)  # (B, T)
    # log(1 - Σ_k q) from log Σ_k q, kept below 0 so that the rest's log stays finite
    # (-expm1 near 0, log1p(-exp) below log 1/2: both stable).
    s = torch.logsumexp(log_q_k, -1).clamp(max=-1e-6)  # (B, T)
    log_q_rest = torch.where(s > -0.6931, torch.log(-torch.expm1(s)), torch.log1p(-torch.exp(s)))  # (B, T)
    rest = torch.xlogy(p_rest, p_rest) - p_rest * log_q_rest  # (B, T): 0 when the teacher's rest is empty
    return _kl(log_p_k, log_q_k) + rest


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
    log_p_s = _log_softmax(student_logits)  # (B, T, V): the CE's, and the KL's at T = 1 (computed once)
    ce = _masked_mean(_nll(log_p_s, labels), labels != IGNORE)
    log_q_s = log_p_s if temperature == 1.0 else _log_softmax(student_logits, temperature)  # (B, T, V)
    if isinstance(teacher_logits, TopKLogits):
        kl = _masked_mean(_kl_topk(log_q_s, teacher_logits, temperature), kl_mask)
    else:
        kl = _masked_mean(_kl(_log_softmax(teacher_logits, temperature), log_q_s), kl_mask)
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


def per_sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of each sequence: logits (B, L, V), labels (B, L-1) -> (B,)."""
    nll = next_token_nll(logits, labels)  # (B, L-1); fp32 under bf16 autocast too
    valid = (labels != IGNORE).sum(1).clamp(min=1)  # (B,)
    return nll.sum(1) / valid
