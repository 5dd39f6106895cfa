"""Analytic identities of the distillation loss and its helpers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.batching import IGNORE
from pipeline.models.losses import TopKLogits, distillation_loss, next_token_nll, prompt_mask

B, T, V, H = 3, 5, 11, 4


def _logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g) * scale


def _labels_with_padding() -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 3:] = IGNORE  # row 0: 3 real targets
    labels[2, 1:] = IGNORE  # row 2: 1 real target
    return labels


def _all_true() -> torch.Tensor:
    return torch.ones(B, T, dtype=torch.bool)


def test_alpha_zero_is_plain_cross_entropy():
    """alpha=0 gives exactly F.cross_entropy(ignore_index=-100) over the same tokens."""
    s, t, labels = _logits(0), _logits(1), _labels_with_padding()
    out = distillation_loss(s, t, labels, _all_true(), alpha=0.0, temperature=2.0)
    expected = F.cross_entropy(s.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE)
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.ce, expected)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 5.0])
def test_identical_logits_have_zero_kl(temperature):
    """Student == teacher logits give KL == 0 at any temperature."""
    s = _logits(0)
    out = distillation_loss(s, s.clone(), _labels_with_padding(), _all_true(), alpha=1.0, temperature=temperature)
    assert abs(out.kl.item()) < 1e-6
    assert abs(out.loss.item()) < 1e-6


@pytest.mark.parametrize("temperature", [1.0, 2.0, 3.0])
def test_kl_matches_hand_computation_and_t_squared_factor(temperature):
    """KL = mean over tokens of sum p_t (log p_t - log p_s) at T; alpha=1 loss = T² · KL."""
    s = torch.tensor([[[1.0, 0.0, -1.0], [0.5, 0.5, 2.0]]])  # (1, 2, 3)
    t = torch.tensor([[[0.0, 2.0, 0.0], [1.0, -1.0, 0.0]]])
    labels = torch.tensor([[0, 2]])
    mask = torch.ones(1, 2, dtype=torch.bool)

    per_token = []
    for pos in range(2):
        ps = torch.softmax(s[0, pos] / temperature, -1).tolist()
        pt = torch.softmax(t[0, pos] / temperature, -1).tolist()
        per_token.append(sum(q * (math.log(q) - math.log(p)) for q, p in zip(pt, ps)))
    hand_kl = sum(per_token) / 2

    out = distillation_loss(s, t, labels, mask, alpha=1.0, temperature=temperature)
    assert out.kl.item() == pytest.approx(hand_kl, rel=1e-5)
    assert out.loss.item() == pytest.approx(temperature**2 * hand_kl, rel=1e-5)


def test_positions_outside_kl_mask_do_not_change_kl():
    """Changing student/teacher logits where kl_mask is False leaves the KL unchanged."""
    s, t, labels = _logits(0), _logits(1), torch.randint(0, V, (B, T))
    kl_mask = prompt_mask(T, torch.tensor([3, 1, 4]))
    base = distillation_loss(s, t, labels, kl_mask, alpha=1.0, temperature=2.0)
    s2, t2 = s.clone(), t.clone()
    s2[~kl_mask] += torch.randn(int((~kl_mask).sum()), V) * 10
    t2[~kl_mask] -= torch.randn(int((~kl_mask).sum()), V) * 10
    changed = distillation_loss(s2, t2, labels, kl_mask, alpha=1.0, temperature=2.0)
    torch.testing.assert_close(changed.kl, base.kl)
    torch.testing.assert_close(changed.loss, base.loss)
    assert base.kl.item() > 0


def test_padding_positions_do_not_change_ce_or_kl():
    """Logits at labels == -100 (padding) do not count in CE nor KL."""
    s, t, labels = _logits(0), _logits(1), _labels_with_padding()
    pad = labels == IGNORE
    base = distillation_loss(s, t, labels, _all_true(), alpha=0.5, temperature=1.5)
    s2, t2 = s.clone(), t.clone()
    s2[pad] = torch.randn(int(pad.sum()), V) * 10
    t2[pad] = torch.randn(int(pad.sum()), V) * 10
    changed = distillation_loss(s2, t2, labels, _all_true(), alpha=0.5, temperature=1.5)
    torch.testing.assert_close(changed.ce, base.ce)
    torch.testing.assert_close(changed.kl, base.kl)
    torch.testing.assert_close(changed.loss, base.loss)


def test_everything_masked_gives_zero_not_nan():
    """With every label ignored, loss/ce/kl/mse are finite zeros."""
    s, t = _logits(0), _logits(1)
    labels = torch.full((B, T), IGNORE)
    hs, ht = torch.randn(B, T, H), torch.randn(B, T, H)
    out = distillation_loss(
        s, t, labels, _all_true(), alpha=0.5, temperature=2.0, beta=1.0, student_hidden=hs, teacher_hidden=ht
    )
    for name, value in out._asdict().items():
        assert torch.isfinite(value), name
        assert value.item() == 0.0, name


def test_prompt_mask_keeps_targets_at_or_after_skip():
    """prompt_mask keeps position t iff t + 1 >= skip[b]."""
    skip = torch.tensor([0, 1, 3, 6])
    n = 5
    mask = prompt_mask(n, skip)
    assert mask.shape == (4, n)
    for b in range(4):
        for t in range(n):
            assert bool(mask[b, t]) == (t + 1 >= int(skip[b])), (b, t)
    assert mask[0].all() and mask[1].all() and not mask[3].any()


def test_hidden_mse_matches_hand_computation_over_masked_positions():
    """beta>0: mse = mean over kept positions of mean_h (hs - ht)² and adds beta·mse to the loss."""
    s, t, labels = _logits(0), _logits(1), _labels_with_padding()
    kl_mask = prompt_mask(T, torch.tensor([2, 1, 1]))
    hs, ht = torch.randn(B, T, H), torch.randn(B, T, H)
    keep = kl_mask & (labels != IGNORE)
    per_pos = ((hs - ht) ** 2).mean(-1)
    hand = per_pos[keep].sum() / keep.sum()

    out = distillation_loss(
        s, t, labels, kl_mask, alpha=0.3, temperature=2.0, beta=0.7, student_hidden=hs, teacher_hidden=ht
    )
    torch.testing.assert_close(out.mse, hand)
    torch.testing.assert_close(out.loss, 0.7 * out.ce + 0.3 * 4.0 * out.kl + 0.7 * hand)


def test_beta_without_hidden_states_raises():
    """beta>0 without hidden states raises ValueError."""
    with pytest.raises(ValueError, match="hidden"):
        distillation_loss(
            _logits(0), _logits(1), _labels_with_padding(), _all_true(), alpha=0.5, temperature=1.0, beta=0.1
        )


def test_gradient_reaches_student_logits():
    """loss.backward() gives a nonzero gradient on the student logits; detached teacher gets none."""
    s = _logits(0).requires_grad_(True)
    t = _logits(1).detach()
    out = distillation_loss(s, t, _labels_with_padding(), _all_true(), alpha=0.5, temperature=2.0)
    out.loss.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0
    assert t.grad is None


def _top_k(logits: torch.Tensor, k: int, rest: bool = False) -> TopKLogits:
    """The top-k as the cache holds them; `rest`: with the logsumexp of all V logits."""
    values, indices = logits.topk(k, dim=-1)  # (B, T, k)
    return TopKLogits(indices=indices, logits=values, logsumexp=logits.logsumexp(-1) if rest else None)


@pytest.mark.parametrize("rest", [False, True])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_kl_with_k_equal_vocab_is_the_dense_kl(temperature, rest):
    """Cached top-k teacher logits with k = V give the dense loss (KL, CE, total) to 1e-5, with
    padding and a prompt mask, with or without the logsumexp of the rest bucket."""
    s, t, labels = _logits(0), _logits(1), _labels_with_padding()
    kl_mask = prompt_mask(T, torch.tensor([2, 1, 1]))
    dense = distillation_loss(s, t, labels, kl_mask, alpha=0.6, temperature=temperature)
    sparse = distillation_loss(s, _top_k(t, V, rest), labels, kl_mask, alpha=0.6, temperature=temperature)
    assert dense.kl.item() > 0
    for name in ("loss", "ce", "kl"):
        torch.testing.assert_close(getattr(sparse, name), getattr(dense, name), rtol=1e-5, atol=1e-5)


def test_top_k_kl_with_the_rest_bucket_is_the_kl_of_the_coarsened_distributions():
    """k < V with the logsumexp at T = 1: the KL between teacher and student each reduced to k + 1
    outcomes (the teacher's top-k tokens, and everything else as one), written out densely here;
    it lies below the dense KL (coarsening loses information) and above the renormalised one's
    floor of 0, and the gradient is finite even where the student puts ~all its mass on the k."""
    s, t, labels = _logits(0), _logits(1), _labels_with_padding()
    k = 4
    top = _top_k(t, k, rest=True)
    p, q = t.softmax(-1), s.softmax(-1)  # (B, T, V)
    p_k, q_k = p.gather(-1, top.indices), q.gather(-1, top.indices)  # (B, T, k)
    p_c = torch.cat([p_k, 1 - p_k.sum(-1, keepdim=True)], -1)  # (B, T, k + 1)
    q_c = torch.cat([q_k, 1 - q_k.sum(-1, keepdim=True)], -1)
    expected = (p_c * (p_c.log() - q_c.log())).sum(-1)[labels != IGNORE].mean()  # the loss counts real targets
    got = distillation_loss(s, top, labels, _all_true(), alpha=1.0, temperature=1.0)
    torch.testing.assert_close(got.kl, expected, rtol=1e-5, atol=1e-6)
    dense = distillation_loss(s, t, labels, _all_true(), alpha=1.0, temperature=1.0)
    assert 0 < got.kl.item() < dense.kl.item()
    confident = torch.full_like(s, -30.0).scatter(-1, top.indices, 30.0).requires_grad_(True)  # rest mass ~e^-60
    out = distillation_loss(confident, top, labels, _all_true(), alpha=1.0, temperature=1.0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(confident.grad).all() and confident.grad.abs().sum() > 0


def test_top_k_kl_renormalises_the_teacher_over_its_k_tokens():
    """k < V: the KL against a teacher with only its top-k tokens kept (the rest at a logit of
    -1e4, probability 0) and renormalised; identical top-k student logits give KL 0."""
    s, t, labels = _logits(0), _logits(1), _labels_with_padding()
    k = 4
    top = _top_k(t, k)
    truncated = torch.full_like(t, -1e4).scatter(-1, top.indices, top.logits)  # (B, T, V)
    sparse = distillation_loss(s, top, labels, _all_true(), alpha=1.0, temperature=2.0)
    dense = distillation_loss(s, truncated, labels, _all_true(), alpha=1.0, temperature=2.0)
    torch.testing.assert_close(sparse.kl, dense.kl, rtol=1e-5, atol=1e-5)
    same = distillation_loss(truncated, top, labels, _all_true(), alpha=1.0, temperature=2.0)
    assert abs(same.kl.item()) < 1e-6


def test_top_k_kl_everything_masked_is_zero_and_gradient_flows():
    """The sparse KL is 0 (not NaN) with every token masked, and trains the student otherwise."""
    s, t = _logits(0).requires_grad_(True), _logits(1)
    masked = distillation_loss(s, _top_k(t, 3), torch.full((B, T), IGNORE), _all_true(), alpha=1.0, temperature=1.0)
    assert masked.kl.item() == 0.0 and torch.isfinite(masked.loss)
    out = distillation_loss(s, _top_k(t, 3), _labels_with_padding(), _all_true(), alpha=1.0, temperature=1.0)
    out.loss.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0


def test_next_token_nll_is_the_sliced_cross_entropy_bitwise_values_and_gradients():
    """The whole-row form gives what CE on logits[:, :-1] gave (the form it replaced, which
    copied the logits), values and gradients bitwise, 0 at ignored labels; bf16 logits in,
    fp32 out."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 11, generator=g)
    labels = torch.randint(0, 11, (3, 8), generator=g)
    labels[1, 5:] = IGNORE
    labels[2, 0] = IGNORE
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    sliced = F.cross_entropy(a[:, :-1].reshape(-1, 11), labels.reshape(-1), ignore_index=IGNORE,
                             reduction="none").view(3, 8)
    whole = next_token_nll(b, labels)
    assert whole.shape == (3, 8) and torch.equal(whole, sliced) and (whole[labels == IGNORE] == 0).all()
    (sliced * torch.arange(1.0, 9.0)).sum().backward()
    (whole * torch.arange(1.0, 9.0)).sum().backward()
    assert torch.equal(a.grad, b.grad) and (b.grad[:, -1] == 0).all()
    assert next_token_nll(logits.bfloat16(), labels).dtype == torch.float32
