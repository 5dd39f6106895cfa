"""The validation loss of a DP-SGD stage as an accounted Gaussian release (teacher.monitor=dp).

Issue 21 item 1: the teacher published the exact mean loss on the first 64 validation records
(which follow from the published seed and N) every `log_every` steps, with the model that
produced it. Knowing the other 63 records, the published figure confirmed a candidate record
to the last digit. The validation records are private records too, so a loss computed from
them leaves the stage only as a DP release:

    release = mean over n units of clip(unit's mean per-token loss, 0, C) + N(0, (z·C/n)²)

Sensitivity. Replacing one validation record (or, at user level, one user's records) moves
the clipped mean by at most C/n. Adding or removing one record can also shift which records
are the first n: one enters and one leaves, which is again one replacement, C/n. n itself is
min(monitor_records, the split's size), and the split sizes are published by the data stage
(data/manifest.json), as N is in the ledger: they are treated as public, as the teacher's
δ = 1/(10N) already treats N. (How a record added to data.path moves the seeded split is a
question for the data stage, the same for the teacher's training split.) Under replace-one
the sensitivity is the same C/n, so the ledger entry's `replace_one_sensitivity` is 1 and its
replace-one ε is its add/remove one (pipeline/privacy/pld.py; issue 38 finding 3).

Accounting. The k releases of a stage (one per monitor point, the final one included: the
stage counts them before training) are k steps of the Gaussian mechanism at sampling rate 1
with noise multiplier z; z is what the accountant calibrates for (monitor_epsilon, δ) over
those k steps, and the ledger entry's history [(z, 1, k)] is composed with every other
mechanism of the run by the accountant (ledger.compose) and across runs (budget.py). ε is
the accountant's, never ours. The validation and training splits are disjoint, so parallel
composition might apply; we compose sequentially, which is valid whatever the split does.

The noise comes from a secret generator of pipeline/privacy/noise.py (OS entropy, or ChaCha20
with secure_mode), never from torch's global RNG or the config's seed: anyone could otherwise
regenerate it and subtract it. Its state is saved only in the private resume checkpoint, so a
resumed stage draws the same noise for the monitor points it repeats (no extra release).
"""

from __future__ import annotations

import torch

from pipeline.privacy import noise
from pipeline.privacy.accountant import CalibrationTimeout, calibrate_sigma, epsilon_of
from pipeline.privacy.ledger import LedgerEntry
from pipeline.privacy.pld import MEAN_REPLACE_SENSITIVITY

STAGE_SUFFIX = "-validation"
"""The ledger stage of a DP-SGD stage's validation-loss release: 'teacher-validation'."""


class MonitorError(ValueError):
    """The validation-loss release cannot be made as configured; the message says what to change."""


def calibrate(epsilon: float, delta: float, releases: int, accountant: str, *,
              setting: str = "teacher.monitor_epsilon",
              fewer: str = "teacher.log_every (fewer releases)") -> tuple[float, str]:
    """(noise multiplier z for `releases` Gaussian releases at (ε, δ), the accountant that
    calibrated it). gdp cannot account q = 1 mechanisms composed with others: rdp does.
    `setting` and `fewer` name, in the error, the settings that fix it."""
    used = "rdp" if accountant == "gdp" else accountant
    try:
        return calibrate_sigma(used, epsilon, delta, sample_rate=1.0, steps=releases), used
    except (CalibrationTimeout, ValueError) as e:
        raise MonitorError(
            f"{setting}={epsilon}: the {used} accountant found no noise multiplier for {releases} "
            f"validation-loss releases at δ={delta:.3g} ({e}); raise {setting} or {fewer}"
        ) from e


def first_units(column, users: list[str] | None, limit: int | None):
    """(records, each record's unit index or None, n) of the first `limit` units (all: None)
    of a split, in its order. At user level a unit is every record of one user."""
    if users is None:
        n = len(column) if limit is None else min(limit, len(column))
        return column.slice(0, n), None, n
    first = list(dict.fromkeys(users))[:limit]
    index = {u: i for i, u in enumerate(first)}
    rows = [r for r, u in enumerate(users) if u in index]
    return column.take(rows), torch.tensor([index[users[r]] for r in rows]), len(first)


def unit_means(per_record: torch.Tensor, units: torch.Tensor | None) -> torch.Tensor:
    """Each privacy unit's clipped-input value: per_record (R,) losses; units (R,) the unit
    index 0..n-1 of each record (user level) or None (record level: each record is a unit)."""
    if units is None:
        return per_record.double()
    n = int(units.max()) + 1
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, units, per_record.double())  # (n,)
    counts = torch.zeros(n, dtype=torch.float64).index_add_(0, units, torch.ones_like(per_record, dtype=torch.float64))
    return sums / counts  # (n,)


def noisy_mean(per_unit: torch.Tensor, clip: float, z: float, generator: noise.Generator) -> float:
    """One release: the mean of per_unit (n,) clipped to [0, clip], plus N(0, (z·clip/n)²)
    drawn from the secret `generator`."""
    n = per_unit.numel()
    assert n > 0, "the stage refuses monitor=dp without validation records"
    exact = per_unit.double().clamp(0.0, clip).mean().item()
    return exact + noise.normal(generator, z * clip / n, 1).item()


def gaussian_entry(stage: str, *, z: float, releases: int, delta: float, accountant: str, unit: str,
                   secure: bool, note: str) -> LedgerEntry:
    """The ledger entry of `releases` clipped-mean Gaussian releases at q = 1 (noise multiplier z):
    the validation-loss monitor's, and the private selection's (private_selection.py)."""
    history = [(z, 1.0, releases)]
    return LedgerEntry(
        stage=stage, private=True, epsilon=epsilon_of(accountant, history, delta), delta=delta,
        accountant=accountant, mechanism="gaussian", noise_multiplier=z, sample_rate=1.0, steps=releases,
        privacy_unit=unit, epsilon_rdp=epsilon_of("rdp", history, delta), history=history,
        replace_one_sensitivity=MEAN_REPLACE_SENSITIVITY,  # one unit replaced moves the mean by C/n, as add/remove
        noise_source=noise.source(secure), note=note,
    )


def ledger_entry(stage: str, *, z: float, releases: int, n: int, clip: float, target_epsilon: float,
                 delta: float, accountant: str, unit: str, secure: bool) -> LedgerEntry:
    """The ledger entry of a stage's validation-loss releases: k Gaussian steps at q = 1."""
    return gaussian_entry(
        f"{stage}{STAGE_SUFFIX}", z=z, releases=releases, delta=delta, accountant=accountant, unit=unit, secure=secure,
        note=f"the {stage}'s validation loss (teacher.monitor=dp): {releases} releases of the mean over the "
        f"first {n} validation {unit}s of each {unit}'s mean per-token loss clipped to [0, {clip:g}] nats, plus "
        f"Gaussian noise of sd z·{clip:g}/{n} = {z * clip / n:.4g} (z={z:.4g} calibrated by Opacus for "
        f"ε={target_epsilon} over the {releases} releases); only the noisy values are published",
    )
