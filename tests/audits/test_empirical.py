"""The statistics of the empirical audit (pipeline/audits/empirical.py), against hand-computed cases."""

import math

import numpy as np
import pytest

from pipeline.audits.empirical import (auc, choices, edit_distance, epsilon_lower_bound, extraction_figures, guesses,
                                       membership_figures, one_run_audit, p_value, tpr_at_fpr)


def test_p_value_by_hand():
    # ε = 0, δ = 0: two fair coins both right, 1/4
    assert p_value(2, 2, 2, 0.0, 0.0) == pytest.approx(0.25)
    # δ term: max_i (f(v-i) - f(v)) / i = max(P[B=1] / 1, P[B<2] / 2) = max(0.5, 0.375) = 0.5; + 2 m δ 0.5
    assert p_value(2, 2, 2, 0.0, 0.01) == pytest.approx(0.25 + 2 * 2 * 0.01 * 0.5)
    # ε = log 3: randomized response right with probability 3/4; all 3 right: (3/4)^3
    assert p_value(3, 3, 3, math.log(3), 0.0) == pytest.approx(0.75 ** 3)
    assert p_value(10, 4, 0, 1.0, 0.0) == 1.0
    with pytest.raises(ValueError):
        p_value(3, 4, 2, 1.0, 0.0)


def test_all_right_pure_dp_matches_closed_form():
    # δ = 0 and v = r: p = q^r, so the bound solves q = β^(1/r), ε = log(q / (1 - q))
    for r in (10, 100, 1000):
        q = 0.05 ** (1 / r)
        assert epsilon_lower_bound(r, r, r, 0.0) == pytest.approx(math.log(q / (1 - q)), abs=1e-5)
    assert epsilon_lower_bound(1000, 1000, 1000, 0.0) > 5.7


def test_chance_level_gives_zero():
    assert epsilon_lower_bound(100, 100, 50, 1e-5) == 0.0
    assert epsilon_lower_bound(100, 100, 58, 1e-5) == 0.0  # 58 of 100 is within chance at 95 %
    assert epsilon_lower_bound(100, 0, 0, 1e-5) == 0.0


def test_monotone():
    # more right guesses -> larger bound; larger δ -> smaller bound; p-value grows with ε
    by_v = [epsilon_lower_bound(200, 100, v, 1e-5) for v in range(50, 101, 5)]
    assert all(a <= b for a, b in zip(by_v, by_v[1:])) and by_v[-1] > by_v[0]
    by_delta = [epsilon_lower_bound(200, 100, 95, d) for d in (0.0, 1e-6, 1e-4, 1e-3)]
    assert all(a >= b for a, b in zip(by_delta, by_delta[1:])) and by_delta[0] > by_delta[-1]
    by_eps = [p_value(200, 100, 90, e, 1e-5) for e in np.linspace(0, 5, 11)]
    assert all(a <= b for a, b in zip(by_eps, by_eps[1:]))


def test_bound_is_valid_for_randomized_response():
    # canaries guessed by ε-DP randomized response: the 95 % bound stays below ε in >= 95 % of trials
    rng, eps, m = np.random.default_rng(1), 1.0, 200
    q = 1 / (1 + math.exp(-eps))
    above = sum(epsilon_lower_bound(m, m, int(rng.binomial(m, q)), 0.0) > eps for _ in range(200))
    assert above <= 0.05 * 200 + 5


def test_guesses_and_choices():
    scores, included = [0.9, 0.8, 0.1, 0.2, 0.5], [True, False, False, True, True]
    assert guesses(scores, included, 2, 0) == (2, 1)  # 0.9 in (right), 0.8 in (wrong)
    assert guesses(scores, included, 1, 2) == (3, 2)  # 0.9 right; out: 0.2 wrong, 0.1 right
    assert choices(100) == [(2, 2), (2, 0), (5, 5), (5, 0), (10, 10), (10, 0), (20, 20), (20, 0), (30, 30),
                            (30, 0), (50, 50), (50, 0)]


def test_one_run_audit_separates_perfect_from_random():
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    perfect = one_run_audit(included + 0.01 * rng.random(1000), included, delta=1e-5)
    assert perfect["epsilon_lower_bound"] > 4 and perfect["right"] == perfect["guesses"]
    random = one_run_audit(rng.random(1000), included, delta=1e-5)
    assert random["epsilon_lower_bound"] < 0.3
    assert perfect["choices_scanned"] == 12 and perfect["included"] == int(included.sum())


def test_membership_figures():
    assert auc([3, 4], [1, 2]) == 1.0 and auc([1, 2], [3, 4]) == 0.0 and auc([1, 1], [1, 1]) == 0.5
    assert auc([2, 4], [1, 3]) == pytest.approx(0.75)
    non = np.arange(200.0)  # 1 % of 200: two non-members may pass; threshold 197
    assert tpr_at_fpr([198.5, 197.5, 10.0, 197.0], non) == pytest.approx(0.5)
    assert tpr_at_fpr([5.0], [1.0, 2.0]) == 1.0 and tpr_at_fpr([1.5], [1.0, 2.0]) == 0.0
    figures = membership_figures([0.1, 0.2], [1.0, 2.0])  # lower loss: member
    assert figures["auc"] == 1.0 and figures["tpr_at_1pct_fpr"] == 1.0


def test_extraction_figures():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance([], [1, 2]) == 2
    f = extraction_figures([([1, 2, 3], [1, 2, 3]), ([1, 9, 3], [1, 2, 3]), ([4, 5], [1, 2, 3, 4])])
    assert f["exact_match"] == pytest.approx(1 / 3)
    assert f["token_accuracy"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert f["median_edit_distance"] == 1.0 and f["records"] == 3


def test_power_says_when_the_noise_off_bound_is_not_above_the_ledger_epsilon_and_which_m_would_be():
    """Issue 62 item 8: with 256 canaries the demo's noise-off bound (1.980) was below the DP run's
    ledger ε (1.998), so its DP bound of 0 said nothing, and nothing said so. A noise-off result
    like it (144 of 154 guesses right, bound 1.82) is named powerless, with the m at which the
    same rate of right guesses would pass ε; one near chance gets no m."""
    from pipeline.audits.empirical import _scaled_bound, power
    from pipeline.audits.empirical_run import format_summary

    rng = np.random.default_rng(0)
    included = rng.random(256) < 0.5
    leaky = one_run_audit(included + 0.6 * rng.standard_normal(256), included, 5.2e-5)
    assert 1.0 < leaky["epsilon_lower_bound"] < 1.998
    p = power(256, 5.2e-5, 1.998, leaky)
    assert p["has_power"] is False and p["noise_off_lower_bound"] == leaky["epsilon_lower_bound"]
    need = p["canaries_for_power"]
    share, accuracy = leaky["guesses"] / 256, leaky["right"] / leaky["guesses"]
    assert _scaled_bound(need, share, accuracy, 5.2e-5, 0.95) > 1.998 > _scaled_bound(need * 49 // 50 - 1, share,
                                                                                      accuracy, 5.2e-5, 0.95)
    chance = one_run_audit(rng.standard_normal(256), included, 5.2e-5)
    assert power(256, 5.2e-5, 1.998, chance)["canaries_for_power"] is None

    figures = {"auc": 0.5, "tpr_at_1pct_fpr": 0.0, "exact_match": 0.0, "token_accuracy": 0.0,
               "median_edit_distance": 16.0}
    model = lambda o: {"one_run": o, "membership": figures, "extraction": figures}  # noqa: E731
    report = {"ledger_epsilon_teacher": 1.998, "audit_training_epsilon": 1.998, "audit_training_epsilon_replace_one": 3.0,
              "delta": 5.2e-5, "noise_multiplier": 1.2, "power": p,
              "models": {"dp": model(chance), "noise_off": model(leaky)}}
    printed = format_summary(report)
    assert "NO POWER: the noise-off training's bound" in printed and f"--canaries {need} would" in printed
    report["power"] = power(256, 5.2e-5, 1.998, None)  # not measured: 256 canaries could show 3.66
    assert "power: not measured" in format_summary(report) and "--noise-off" in format_summary(report)


def test_a_dp_bound_above_the_epsilon_is_said_to_happen_at_the_confidence_level_not_called_a_bug():
    from pipeline.audits.empirical_run import format_summary

    rng = np.random.default_rng(1)
    included = rng.random(64) < 0.5
    o = one_run_audit(included + 0.01 * rng.standard_normal(64), included, 1e-5)
    figures = {"auc": 0.5, "tpr_at_1pct_fpr": 0.0, "exact_match": 0.0, "token_accuracy": 0.0,
               "median_edit_distance": 16.0}
    report = {"ledger_epsilon_teacher": 0.5, "audit_training_epsilon": 0.5, "audit_training_epsilon_replace_one": 0.9,
              "delta": 1e-5, "noise_multiplier": 3.0, "power": None,
              "models": {"dp": {"one_run": o, "membership": figures, "extraction": figures}}}
    assert o["epsilon_lower_bound"] > 0.5
    assert "up to 5 % of audits" in format_summary(report)
