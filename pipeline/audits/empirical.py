"""Empirical privacy figures: an ε lower bound from one training run, loss-based membership
inference, and extraction. The statistics only; `pipeline/audits/empirical_run.py` trains
the models and scores them.

ε lower bound (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run",
arXiv:2305.08846). m canaries, each included in training independently with probability ½
(secret coins). After training, each canary gets a score (higher = more likely a member); the
auditor guesses "in" for the k+ highest scores and "out" for the k- lowest and abstains on the
rest. With r = k+ + k- guesses of which v are right, the paper's Theorem 5.2 (its
Algorithm 2 for δ > 0) bounds, for an (ε, δ)-DP training,

    P[W >= v] <= f(v) + 2 m δ · max_{i = 1..v} (f(v - i) - f(v)) / i,
    f(v) = P[Binomial(r, e^ε / (1 + e^ε)) >= v],

and the lower bound at confidence 1 - β is the largest ε whose p-value is below β: an
(ε, δ)-DP training would have given so many right guesses with probability under β.

Choosing k+ and k-: the paper reports the best of several (k+, k-); we scan a small fixed grid
(`GRID`: k = 2, 5, 10, 20, 30, 50 % of m, guessing k "in" and k "out", or k "in" only) and test
each choice at β / (number of choices) (Bonferroni), so the maximum over the grid still holds
at confidence 1 - β. With few canaries the bound is capped (all m guesses right at 95 %
gives ε ≈ 2.9 for m = 100 and 5.1 for m = 1000
(δ = 1e-5, the grid's correction included)): it shows leakage, it cannot show
that an accountant's large ε is tight.

Power: a bound of 0 from the DP training means something only if the same attack would have
seen a training that leaks. The noise-off training (`--noise-off`: no DP, made on request) is
that check: when its bound does not exceed the ledger's ε the audit had no power there, and
`canaries_needed` says how many canaries the same rate of right guesses would need (more
canaries tighten the binomial test; they do not make a training leak). Without it, `max_bound`
says what m canaries can show at best (every guess right); the issue-62 review measured, on
the demo config at the ledger's ε 1.998, a noise-off bound of 1.980 with 256 canaries (no power)
and 2.774 with 1,000 (docs/privacy.md).

Membership inference: the loss of each training member against each held-out (test)
non-member; AUC (ties count ½) and the TPR at 1 % FPR (the threshold no more than 1 % of
non-members pass; with fewer than 100 non-members that is none of them).

Extraction (Ponomareva et al. 2022, "Training text-to-text transformers with privacy
guarantees", Appendix: each training record's first tokens as a prompt, greedy decoding):
the exact-match rate of the decoded continuation, its mean token accuracy against the true
continuation, and the median token edit distance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


# --- the one-run ε lower bound ----------------------------------------------------------


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[>= v right guesses of r] for an (ε, δ)-DP training with m canaries (Theorem 5.2)."""
    if not (0 <= v <= r <= m) or epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need 0 <= v <= r <= m, ε >= 0, 0 <= δ <= 1; got m={m} r={r} v={v} ε={epsilon} δ={delta}")
    q = 1.0 / (1.0 + math.exp(-epsilon))  # accuracy of ε-DP randomized response
    beta = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[Binomial(r, q) >= v]
    alpha = 0.0
    if v and delta:  # max over i of (f(v - i) - f(v)) / i = P[v > Binomial(r, q) >= v - i] / i
        mass = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))  # i = 1..v
        alpha = float(np.max(mass / np.arange(1, v + 1)))
    return min(beta + 2 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 1 - CONFIDENCE) -> float:
    """The largest ε (to 1e-6) at which `v` right guesses of `r` have p-value below `beta`; 0
    when even ε = 0 explains them. Bisection: the p-value grows with ε."""
    if r == 0 or p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < beta:
        low, high = high, 2 * high
        if high > 1e3:
            return low
    while high - low > 1e-6:
        mid = (low + high) / 2
        low, high = (mid, high) if p_value(m, r, v, mid, delta) < beta else (low, mid)
    return low


def guesses(scores: Sequence[float], included: Sequence[bool], k_plus: int, k_minus: int) -> tuple[int, int]:
    """(r, v): guess "in" for the k+ highest scores, "out" for the k- lowest (ties broken by
    position, the same for every choice of k), abstain on the rest; v of the r guesses right."""
    if k_plus + k_minus > len(scores):
        raise ValueError(f"k+ + k- = {k_plus + k_minus} guesses of {len(scores)} canaries")
    order = np.argsort(-np.asarray(scores, dtype=float), kind="stable")
    inc = np.asarray(included, dtype=bool)[order]
    right = int(inc[:k_plus].sum()) + int((~inc[len(inc) - k_minus:]).sum() if k_minus else 0)
    return k_plus + k_minus, right


def choices(m: int, grid: Sequence[float] = GRID) -> list[tuple[int, int]]:
    """The (k+, k-) pairs scanned: k = max(1, round(f m)) for f in `grid`, as (k, k) and (k, 0)."""
    out = []
    for f in grid:
        k = max(1, round(f * m))
        for pair in ((k, k), (k, 0)):
            if sum(pair) <= m and pair not in out:
                out.append(pair)
    return out


def one_run_audit(scores: Sequence[float], included: Sequence[bool], delta: float,
                  confidence: float = CONFIDENCE, grid: Sequence[float] = GRID) -> dict:
    """The ε lower bound at `confidence` from one training run's canary scores (higher = more
    likely a member): the best over `choices`, each tested at (1 - confidence) / len(choices)."""
    m = len(scores)
    if m != len(included) or m == 0:
        raise ValueError(f"{m} scores for {len(included)} canaries")
    pairs = choices(m, grid)
    beta = (1 - confidence) / len(pairs)
    tried = []
    for k_plus, k_minus in pairs:
        r, v = guesses(scores, included, k_plus, k_minus)
        tried.append({"epsilon_lower_bound": epsilon_lower_bound(m, r, v, delta, beta), "k_plus": k_plus,
                      "k_minus": k_minus, "guesses": r, "right": v})
    best = max(tried, key=lambda t: (t["epsilon_lower_bound"], t["guesses"]))  # none above 0: the most guesses
    return {**best, "canaries": m, "included": int(np.sum(included)), "delta": delta, "confidence": confidence,
            "choices_scanned": len(pairs)}


# --- power ----------------------------------------------------------------------------------

MAX_CANARIES = 1 << 15  # beyond this many canaries `canaries_needed` stops looking (a training of them is impractical)


def _scaled_bound(m: int, share: float, accuracy: float, delta: float, confidence: float) -> float:
    """The bound of `m` canaries when the same share of them is guessed, as often right."""
    r = max(1, round(share * m))
    return epsilon_lower_bound(m, r, round(accuracy * r), delta, (1 - confidence) / len(choices(m)))


def max_bound(m: int, delta: float, confidence: float = CONFIDENCE) -> float:
    """The largest bound `m` canaries can give: every guess of the grid's best choice right."""
    return max(_scaled_bound(m, (k_plus + k_minus) / m, 1.0, delta, confidence) for k_plus, k_minus in choices(m))


def canaries_needed(result: dict, epsilon: float, confidence: float = CONFIDENCE) -> tuple[int | None, float]:
    """The fewest canaries with which `result`'s best choice (`one_run_audit`: the same share of the
    canaries guessed, as often right) would give a bound above `epsilon`, or None when no m up to
    MAX_CANARIES would; and the largest bound seen. Not monotone in m: the test's δ term grows
    with m (2mδ), so a large δ caps what any m can show; m is scanned in steps of 25 %."""
    m, delta = result["canaries"], result["delta"]
    share, accuracy = result["guesses"] / m, result["right"] / max(result["guesses"], 1)
    bound = lambda n: _scaled_bound(n, share, accuracy, delta, confidence)  # noqa: E731
    prev, n, best = None, m, 0.0
    while n <= MAX_CANARIES:
        b = bound(n)
        best = max(best, b)
        if b > epsilon:
            if prev is None:
                return n, best
            low, high = prev, n
            while high - low > max(1, low // 50):  # to 2 %: a count to round up, not a measurement
                mid = (low + high) // 2
                low, high = (mid, high) if bound(mid) <= epsilon else (low, mid)
            return high, best
        prev, n = n, max(n + 1, round(n * 1.25))
    return None, best


def power(m: int, delta: float, epsilon: float | None, noise_off: dict | None) -> dict:
    """Whether the audit could show `epsilon`: measured by the noise-off training's result when
    there is one, else only what m canaries can show at best (every guess right).
    `canaries_for_power`: the m that would (None: none would, `best_lower_bound` says how close
    any came)."""
    cap = max_bound(m, delta)
    out = {"epsilon": epsilon, "max_lower_bound": cap, "noise_off_lower_bound": None, "has_power": None,
           "canaries_for_power": None, "best_lower_bound": None}
    if epsilon is None:
        return out
    if noise_off is not None:
        out["noise_off_lower_bound"] = noise_off["epsilon_lower_bound"]
        out["has_power"] = noise_off["epsilon_lower_bound"] > epsilon
        if not out["has_power"]:
            out["canaries_for_power"], out["best_lower_bound"] = canaries_needed(noise_off, epsilon)
    elif cap <= epsilon:
        out["has_power"] = False
        out["canaries_for_power"], out["best_lower_bound"] = canaries_needed(
            {"canaries": m, "guesses": m, "right": m, "delta": delta}, epsilon)
    return out


# --- membership inference ---------------------------------------------------------------


def auc(members: Sequence[float], non_members: Sequence[float]) -> float:
    """P[a member's score > a non-member's] + ½ P[equal] (Mann-Whitney); scores: higher = member."""
    a, b = np.asarray(members, dtype=float), np.asarray(non_members, dtype=float)
    if not len(a) or not len(b):
        raise ValueError("need at least one member and one non-member")
    ranks = stats.rankdata(np.concatenate([a, b]))  # ties get their mean rank
    return float((ranks[: len(a)].sum() - len(a) * (len(a) + 1) / 2) / (len(a) * len(b)))


def tpr_at_fpr(members: Sequence[float], non_members: Sequence[float], fpr: float = 0.01) -> float:
    """The fraction of members above the lowest threshold that at most `fpr` of non-members pass."""
    b = np.sort(np.asarray(non_members, dtype=float))[::-1]
    allowed = int(math.floor(fpr * len(b)))  # non-members allowed above the threshold
    threshold = b[allowed] if allowed < len(b) else -np.inf
    return float(np.mean(np.asarray(members, dtype=float) > threshold))


def membership_figures(member_losses: Sequence[float], non_member_losses: Sequence[float]) -> dict:
    """Loss-based membership inference (lower loss = guessed member)."""
    a, b = -np.asarray(member_losses, dtype=float), -np.asarray(non_member_losses, dtype=float)
    return {"auc": auc(a, b), "tpr_at_1pct_fpr": tpr_at_fpr(a, b, 0.01), "members": len(a), "non_members": len(b)}


# --- extraction -------------------------------------------------------------------------


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance between two token sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def extraction_figures(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict:
    """(decoded, true) continuations -> exact-match rate, mean token accuracy (position by
    position over the true continuation's length), median token edit distance."""
    if not pairs:
        raise ValueError("no records to extract")
    exact = [list(d) == list(t) for d, t in pairs]
    accuracy = [sum(x == y for x, y in zip(d, t)) / len(t) for d, t in pairs if len(t)]
    distance = [edit_distance(d, t) for d, t in pairs]
    return {"exact_match": float(np.mean(exact)), "token_accuracy": float(np.mean(accuracy)) if accuracy else 0.0,
            "median_edit_distance": float(np.median(distance)), "records": len(pairs)}
