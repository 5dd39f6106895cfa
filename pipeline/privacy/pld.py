"""ε by Google's dp-accounting PLD accountant, under both adjacencies: add/remove and replace-one.

Opacus' ε (the ledger's `epsilon`) is add/remove-one: neighbouring datasets differ by one
record present or absent. But N (and δ = 1/(10N), q, the split sizes) is published exactly in
the ledger and manifests, so presence is learnt from N itself, and the guarantee that still
means something is replace-one: the datasets hold the same number of records, one of them
different (issue 21). Opacus accounts add/remove only; dp-accounting's PLD accountant takes
`NeighboringRelation.REPLACE_ONE`. Its add/remove figure for the same history is kept too, as
a check of Opacus' from a second library (the ledger's `epsilon_pld`).

    eps = epsilon([("subsampled_gaussian", [(σ, q, steps)], 2.0)], delta, REPLACE_ONE, pure=[0.5])

Every ε comes from the accountant; the pure-ε geometric histogram is added by basic
composition (ε, or 2ε under replace-one: see `pure_epsilon`), as the ledger's total does.
Imports dp-accounting (numpy, scipy) only when called: `dpdistill ledger show` stays light.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

ADD_REMOVE = "add_remove"
REPLACE_ONE = "replace_one"
RELATIONS = (ADD_REMOVE, REPLACE_ONE)

# dp-accounting's REPLACE_ONE Gaussian (GaussianPrivacyLoss with AdjacencyType.REPLACE: the
# sum of the remove and the add privacy losses) takes the worst replacement to move the output
# by 2 sensitivities: right for DP-SGD, where one clipped gradient g (‖g‖ ≤ C) can be replaced
# by -g. Other releases move less, so each ledger entry says its own replace-one sensitivity, in
# units of its add/remove one (the unit its noise multiplier is relative to), set by the
# mechanism that made it (LedgerEntry.replace_one_sensitivity):
# - DP-SGD: 2 (g replaced by -g), dp-accounting's own figure.
# - the Gaussian histogram: replacing one record moves one count from bin a to bin b,
#   Δ = e_b − e_a, ‖Δ‖₂ = √2 (tests/privacy/test_pld.py measures it on the released counts).
# - a clipped mean over a fixed number n of units (the validation-loss monitor, private
#   selection): one unit's clipped value in [0, C] replaced by another moves the mean by at most
#   C/n, the add/remove sensitivity itself (monitor.py), so 1 (issue 38 finding 3: √2 overstated
#   it, the demo monitor's 0.708 where 0.480 is right).
# A Gaussian mechanism's privacy depends on sensitivity / σ only, so a release of replace-one
# sensitivity s is the accountant's REPLACE_ONE Gaussian with noise multiplier σ · 2 / s.
# Ledgers written before the field say nothing: their entries keep the figure they were made
# with (2 for subsampled_gaussian, √2 for gaussian), an upper bound for a mean.
ACCOUNTANT_REPLACE_SENSITIVITY = 2.0
DP_SGD_REPLACE_SENSITIVITY = ACCOUNTANT_REPLACE_SENSITIVITY
HISTOGRAM_REPLACE_SENSITIVITY = math.sqrt(2)
MEAN_REPLACE_SENSITIVITY = 1.0
_LEGACY_REPLACE_SENSITIVITY = {"subsampled_gaussian": DP_SGD_REPLACE_SENSITIVITY,
                               "gaussian": HISTOGRAM_REPLACE_SENSITIVITY}

# The PLD's grid of privacy-loss values. dp-accounting's default, 1e-4, took ~1-3 s per ε
# and a run asks for a dozen (the plan, the ledger, the dataset's budget): ~30 s of a tiny run's
# 60. 1e-3 is ~10x faster and, the estimate being pessimistic, still an upper bound; it moved
# ε by at most 2.3e-4 on the airline, tiny and a Yelp-sized history (tests/privacy/test_pld.py).
VALUE_DISCRETIZATION_INTERVAL = 1e-3

Mechanism = tuple[str, list[tuple[float, float, int]]] | tuple[str, list[tuple[float, float, int]], float | None]
"""(ledger mechanism, its (σ, q, steps) history[, its replace-one sensitivity]): 'subsampled_gaussian'
(DP-SGD) or 'gaussian' (q = 1). Without the sensitivity (or None): the mechanism's legacy figure."""


def replace_sensitivity(mechanism: str, given: float | None = None) -> float:
    """A release's replace-one sensitivity in units of its add/remove one: `given` (its ledger
    entry's), else what entries written before the field were accounted with."""
    return float(given) if given is not None else _LEGACY_REPLACE_SENSITIVITY[mechanism]


def _events(mechanism: str, history, relation: str, sensitivity: float | None = None) -> list:
    import dp_accounting as dpa

    if mechanism == "subsampled_gaussian":
        wrap = lambda event, q: dpa.PoissonSampledDpEvent(q, event)  # noqa: E731
    else:
        assert mechanism == "gaussian" and all(q == 1.0 for _, q, _ in history), (mechanism, history)
        wrap = lambda event, q: event  # noqa: E731
    scale = (ACCOUNTANT_REPLACE_SENSITIVITY / replace_sensitivity(mechanism, sensitivity)
             if relation == REPLACE_ONE else 1.0)
    return [dpa.SelfComposedDpEvent(wrap(dpa.GaussianDpEvent(s * scale), q), int(n)) for s, q, n in history]


def pure_epsilon(epsilon: float, relation: str) -> float:
    """A pure ε-DP histogram (two-sided geometric, L1 sensitivity 1 under add/remove) under
    `relation`. Replacing a record changes two bins by one each, L1 sensitivity 2: the privacy
    loss is the sum of the two bins' (group privacy of two), 2ε, and tight. Basic arithmetic,
    the same exception as basic composition (pipeline/privacy/README.md invariant 2)."""
    return 2 * epsilon if relation == REPLACE_ONE else epsilon


def epsilon(mechanisms: list[Mechanism], delta: float, relation: str, pure: Sequence[float] = ()) -> float:
    """ε at `delta` of the Gaussian mechanisms composed by dp-accounting's PLD accountant under
    `relation`, plus the pure-ε ones by basic composition."""
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    frozen = tuple((m[0], tuple(tuple(h) for h in m[1]), replace_sensitivity(m[0], m[2] if len(m) > 2 else None))
                   for m in mechanisms)
    return _epsilon(frozen, float(delta), relation, tuple(pure))


def _remember_gaussian_plds() -> None:
    """dp-accounting builds each Gaussian's privacy-loss distribution from scratch for every ε
    (0.2-0.5 s each on the 1e-3 grid, most of an ε), and a run composes the same (σ, q) again
    and again: its plan's total, the ledger's, and the dataset budget's after each release,
    which holds the run's earlier releases. The library's own constructor, remembered: a pure
    function of its numbers returning an object that composition never changes (it builds new
    ones), so every ε is the one the accountant computes without it (tests/privacy/test_pld.py)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_module

    if not hasattr(pld_module.from_gaussian_mechanism, "cache_info"):  # once per process
        pld_module.from_gaussian_mechanism = functools.lru_cache(maxsize=64)(pld_module.from_gaussian_mechanism)


@functools.lru_cache(maxsize=256)
def _epsilon(mechanisms: tuple, delta: float, relation: str, pure: tuple[float, ...]) -> float:
    """`epsilon`, computed once per process for each history (the plan, the ledger and the
    dataset's budget ask for the same ones)."""
    eps = sum(pure_epsilon(e, relation) for e in pure)
    events = [ev for mechanism, history, sensitivity in mechanisms
              for ev in _events(mechanism, history, relation, sensitivity)]
    if not events:
        return eps
    import dp_accounting as dpa
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    _remember_gaussian_plds()

    neighbours = (dpa.NeighboringRelation.REPLACE_ONE if relation == REPLACE_ONE
                  else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant = PLDAccountant(neighboring_relation=neighbours, value_discretization_interval=VALUE_DISCRETIZATION_INTERVAL)
    accountant.compose(dpa.ComposedDpEvent(events))
    return eps + float(accountant.get_epsilon(delta))
