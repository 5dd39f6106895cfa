"""Accounting and sampling: golden ε values, composition, the budget stop, Poisson rate."""

from __future__ import annotations

import time

import pytest
import torch
from opacus.data_loader import DPDataLoader

from conftest import noise_free_dp_gradient
from pipeline.privacy.ledger import LedgerEntry, compose
from pipeline.privacy import accountant as privacy
from pipeline.config import TeacherConfig
from pipeline.privacy.accountant import calibrate_sigma, epsilon_of, max_steps_within_budget
from pipeline.privacy.dpsgd import TeacherError, calibrate_noise
from pipeline.models.losses import per_sequence_loss


# Published in Opacus' own tests (opacus/tests/accountants_test.py, AccountingTest):
# σ = 1.5, q = 0.04, 90 epochs, δ = 1e-5.
def test_golden_rdp_epsilon_from_opacus_tests():
    """RDP: ε = 7.32911117143 for (1.5, 0.04, int(90 / 0.04)) at δ = 1e-5."""
    assert epsilon_of("rdp", [(1.5, 0.04, int(90 / 0.04))], 1e-5) == pytest.approx(7.32911117143, abs=1e-9)


def test_golden_prv_epsilon_from_opacus_tests():
    """PRV: ε = 6.777395712150674 for (1.5, 0.04, int(90 // 0.04)) at δ = 1e-5."""
    assert epsilon_of("prv", [(1.5, 0.04, int(90 // 0.04))], 1e-5) == pytest.approx(6.777395712150674, abs=1e-6)


def test_golden_gdp_epsilon_from_opacus_tests():
    """GDP: 6.59 < ε < 6.6 for (1.5, 0.04, int(90 // 0.04)) at δ = 1e-5."""
    assert 6.59 < epsilon_of("gdp", [(1.5, 0.04, int(90 // 0.04))], 1e-5) < 6.6


def _gaussian(stage: str, sigma: float, q: float, steps: int, delta: float = 1e-4) -> LedgerEntry:
    return LedgerEntry(
        stage=stage, private=True, epsilon=epsilon_of("prv", [(sigma, q, steps)], delta), delta=delta,
        mechanism="subsampled_gaussian", privacy_unit="record", history=[(sigma, q, steps)], note="",
    )


def test_total_composes_through_the_accountant_not_by_adding():
    """Two Gaussian mechanisms: the total is the accountant's ε over the joint history,
    below the sum of the separate ε's."""
    a, b = _gaussian("teacher", 1.0, 0.05, 200), _gaussian("codes", 5.0, 1.0, 1)
    total = compose([a, b], "prv", 1e-4)
    joint = epsilon_of("prv", [(1.0, 0.05, 200), (5.0, 1.0, 1)], 1e-4)
    assert total.epsilon == pytest.approx(joint)
    assert max(a.epsilon, b.epsilon) < total.epsilon < a.epsilon + b.epsilon
    assert total.complete and "prv accountant" in total.composition


def test_total_adds_pure_epsilon_and_flags_non_private_releases():
    """A geometric (pure ε) mechanism is added by basic composition; a non-DP entry
    makes the total incomplete."""
    a = _gaussian("teacher", 1.0, 0.05, 200)
    geo = LedgerEntry(stage="codes", private=True, epsilon=0.5, mechanism="geometric", privacy_unit="record", note="")
    exact = LedgerEntry(stage="control-codes", private=False, epsilon=None, note="exact counts")
    total = compose([a, geo], "prv", 1e-4)
    assert total.epsilon == pytest.approx(a.epsilon + 0.5) and "basic composition" in total.composition
    incomplete = compose([exact, a], "prv", 1e-4)
    assert not incomplete.complete and "control-codes" in incomplete.note
    assert incomplete.epsilon == pytest.approx(a.epsilon)


def test_gdp_total_of_different_mechanisms_falls_back_to_rdp():
    """Opacus' GDP accountant reads one history entry: composing two is done with RDP, said so."""
    a, b = _gaussian("teacher", 1.0, 0.05, 200), _gaussian("codes", 5.0, 1.0, 1)
    total = compose([a, b], "gdp", 1e-4)
    assert total.accountant == "rdp" and "gdp cannot compose" in total.note
    with pytest.raises(ValueError, match="gdp"):
        epsilon_of("gdp", [(1.0, 0.05, 200), (5.0, 1.0, 1)], 1e-4)


def test_budget_stop_is_the_last_step_within_target():
    """max_steps_within_budget returns k with ε(k) ≤ target < ε(k + 1)."""
    sigma, q, delta = 1.0, 0.1, 1e-4
    target = epsilon_of("prv", [(sigma, q, 100)], delta)
    assert max_steps_within_budget("prv", sigma, q, delta, target * 1.001, 100) == 100
    k = max_steps_within_budget("prv", sigma, q, delta, target, 150)
    assert epsilon_of("prv", [(sigma, q, k)], delta) <= target < epsilon_of("prv", [(sigma, q, k + 1)], delta)


def test_empirical_poisson_sampling_rate_matches_q():
    """The Poisson loader's batches hold each record with probability q (mean over draws)."""
    n, batch = 200, 20
    data = torch.utils.data.TensorDataset(torch.arange(n))
    loader = DPDataLoader.from_data_loader(
        torch.utils.data.DataLoader(data, batch_size=batch), generator=torch.Generator().manual_seed(0)
    )
    q = loader.sample_rate
    sizes = torch.tensor([len(b[0]) for _ in range(100) for b in loader], dtype=torch.float)  # 1,000 draws
    assert q == pytest.approx(batch / n)
    # mean of 1,000 Binomial(n, q) / n: standard error sqrt(q(1-q)/(n·1000)) ≈ 6.7e-4
    assert abs(sizes.mean().item() / n - q) < 4 * (q * (1 - q) / (n * len(sizes))) ** 0.5
    assert sizes.std() > 0  # variable batch sizes: Poisson, not fixed-size batches


@pytest.mark.parametrize("mode", ["ghost", "hooks", "bk"])
def test_no_noise_no_clipping_equals_an_ordinary_step(tiny_tokenizer, mode):
    """σ = 0 and C = ∞: the DP gradient is the ordinary gradient of the mean per-sequence loss."""
    model, plain, batch, labels, _ = noise_free_dp_gradient(tiny_tokenizer, mode, max_grad_norm=1e9)
    per_sequence_loss(plain(**batch).logits, labels).mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_total_is_incomplete_when_noise_came_from_the_test_hook():
    """A mechanism whose noise the test hook fixed can be regenerated by anyone: the total
    is marked incomplete and says why, though its ε is computed as usual."""
    a = _gaussian("teacher", 1.0, 0.05, 200)
    assert compose([a], "prv", 1e-4).complete
    hooked = a.model_copy(update={"noise_source": "TEST HOOK fixed seed (DPDISTILL_TEST_NOISE_SEED=1): NOT private"})
    total = compose([hooked], "prv", 1e-4)
    assert not total.complete and "test hook" in total.note and "teacher" in total.note
    assert total.epsilon == pytest.approx(a.epsilon)


def test_ledger_table_and_summary_name_the_noise_source():
    """`ledger show` and the privacy-summary artifact say where each mechanism's noise came from."""
    from flows.artifacts import ledger_summary
    from pipeline.privacy.ledger import PrivacyLedger, format_table

    entry = _gaussian("teacher", 1.0, 0.05, 200).model_copy(update={"noise_source": "csprng: ChaCha20"})
    ledger = PrivacyLedger(entries=[entry], total=compose([entry], "prv", 1e-4))
    assert "[noise: csprng: ChaCha20]" in format_table(ledger)
    assert "noise from csprng: ChaCha20" in ledger_summary(ledger)


def test_the_tables_say_what_each_stage_s_guarantee_is_in_words():
    """Issue 24: "private: yes" on generation read as "reads private data". The ledger table,
    the report and the artifact say DP release, post-processing or NOT DP instead."""
    from pipeline.privacy.ledger import PrivacyLedger, format_table, post_processing

    teacher = _gaussian("teacher", 1.0, 0.05, 200)
    not_dp = LedgerEntry(stage="control-codes", private=False, epsilon=None, note="released without noise")
    entries = [not_dp, teacher, post_processing("generation", "samples from the DP teacher")]
    table = format_table(PrivacyLedger(entries=entries, total=compose(entries, "prv", 1e-4))).splitlines()
    assert table[0].split()[:2] == ["stage", "guarantee"]
    words = {line.split()[0]: " ".join(line.split()[1:3]) for line in table[2:6]}
    assert words["control-codes"].startswith("NOT DP") and words["teacher"].startswith("DP release")
    assert words["generation"].startswith("post-processing") and words["TOTAL"].startswith("INCOMPLETE")
    assert "yes" not in " ".join(table[:6]).split()


@pytest.mark.parametrize("accountant,epsilon,q,steps", [("prv", 2.0, 1 / 12, 36), ("rdp", 0.5, 1.0, 1)])
def test_calibration_finds_opacus_sigma(accountant, epsilon, q, steps):
    """The deadline-bounded search gives exactly the σ of Opacus' get_noise_multiplier."""
    from opacus.accountants.utils import get_noise_multiplier

    expected = get_noise_multiplier(target_epsilon=epsilon, target_delta=1e-5, sample_rate=q, steps=steps,
                                    accountant=accountant)
    assert calibrate_sigma(accountant, epsilon, 1e-5, q, steps) == expected


def test_calibration_that_never_ends_stops_at_its_deadline_with_advice(monkeypatch):
    """PRV at ε=1000 (q=1/12, 36 steps, the demo's) overflows to ε=inf below some σ and Opacus'
    search never returns; the calibration stops at its deadline and says what to change."""
    monkeypatch.setattr(privacy, "CALIBRATION_DEADLINE_S", 2.0)
    cfg = TeacherConfig(target_epsilon=1000, accountant="prv")
    t0 = time.time()
    with pytest.raises(TeacherError) as err:
        calibrate_noise(cfg, sample_rate=1 / 12, steps=36, delta=1 / 14250)
    assert time.time() - t0 < 30  # the deadline plus at most one slow accountant call
    msg = str(err.value)
    assert "within 2 s" in msg and "teacher.accountant=rdp" in msg and "smaller teacher.target_epsilon" in msg
