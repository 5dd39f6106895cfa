"""Release of the control-code distribution that prompts generation: exact, or a DP histogram.

This is the one DP mechanism besides the teacher that reads the private training split.

- `exact`: the true counts. NOT differentially private; the ledger says so.
- `gaussian`: counts + N(0, σ²) in every bin of the declared domain (L2 sensitivity 1),
  σ calibrated by Opacus for (ε, δ); composed with the teacher through the accountant.
- `geometric`: counts + two-sided geometric noise, P(k) ∝ exp(-ε|k|) (L1 sensitivity 1):
  pure ε-DP, composed with the teacher by adding ε (basic composition).

Noisy counts are floored at 0 and renormalised when sampled. The histogram covers every
combination of the declared per-column `domain`: bins that do not occur in the data get
noise too, otherwise the released support would reveal which combinations exist.

User-level: each user contributes the code of one of their records, chosen at random, so
one user changes one bin by one, the same sensitivity as one record at record level.

The noise and the per-user picks come from secret OS entropy (pipeline/privacy/noise.py), never
from the run's public seed: anyone could otherwise regenerate the noise and subtract it.
`secure_mode=True` draws them from a ChaCha20 CSPRNG instead of torch's mt19937.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from pipeline.privacy import noise
from pipeline.config import CodesConfig, ConfigError, DataConfig
from pipeline.records import CODE_JOINER, parquet_batches, read_users
from pipeline.privacy.ledger import LedgerEntry, with_pld_epsilons
from pipeline.privacy.pld import HISTOGRAM_REPLACE_SENSITIVITY  # one count moves between two bins
from pipeline.manifest import atomic_write_json, write_manifest
from pipeline.privacy.accountant import (
    DEFAULT_DELTA, CalibrationTimeout, calibrate_sigma, epsilon_of, resolve_delta, weak_delta_warning,
)

log = logging.getLogger(__name__)

STAGE = "control-codes"
"""The release's name in the ledger, stages.json and the dataset budget (its directory: control_codes/)."""
RELEASED = "control_codes.json"
MAX_BINS = 1_000_000


@dataclass(frozen=True)
class CodesResult:
    path: Path
    ledger: LedgerEntry

    def releases(self) -> dict[str, LedgerEntry]:
        """The stage's ledger entry (one release). A release cached before the ledger took the
        stage's name says "control_codes": the same release, named as today."""
        return {"": self.ledger.model_copy(update={"stage": STAGE})}


def domain_codes(data: DataConfig, domain: dict[str, list[str]]) -> list[str]:
    """Every control-code string the declared domain allows, in a fixed order."""
    per_column = [[data.code_template.format(column=c, value=v) for v in domain[c]] for c in data.code_columns]
    n_bins = math.prod(len(v) for v in per_column)
    if n_bins > MAX_BINS:
        raise ValueError(f"control_codes.domain spans {n_bins} combinations (> {MAX_BINS}); declare fewer values")
    return [CODE_JOINER.join(parts) for parts in itertools.product(*per_column)]


def gaussian_sigma(epsilon: float, delta: float, accountant: str,
                   field: str = "control_codes.epsilon") -> tuple[float, str]:
    """(σ of a Gaussian histogram for (ε, δ), the accountant that calibrated it). The Gaussian
    mechanism is one step of the subsampled Gaussian with q = 1; gdp cannot account it, so rdp does.
    `field` names the setting in the error (the DP tokenizer's histogram calibrates here too)."""
    calibrate = "rdp" if accountant == "gdp" else accountant
    try:
        return calibrate_sigma(calibrate, epsilon, delta, sample_rate=1.0, steps=1), calibrate
    except CalibrationTimeout as e:
        raise ConfigError(f"{field}={epsilon}: {e}; use a smaller {field}") from e


def _code_counts(train_path: Path) -> Counter:
    """Records per control code of the split, counted a batch at a time by Arrow: the codes
    are never one Python string per record (~70 bytes each: 700 MB at 10 M records)."""
    counts: Counter = Counter()
    for batch in parquet_batches(train_path, columns=["control_code"], batch_size=1 << 16):
        found = pc.value_counts(batch.column(0))
        counts.update(dict(zip(found.field("values").to_pylist(), found.field("counts").to_pylist())))
    return counts


def _one_per_user(train_path: Path, users: list[str], rng: noise.Generator) -> Counter:
    """One random record's code per user, counted."""
    codes = [c for batch in parquet_batches(train_path, columns=["control_code"]) for c in batch.column(0).to_pylist()]
    by_user: dict[str, list[str]] = {}
    for c, u in zip(codes, users, strict=True):
        by_user.setdefault(u, []).append(c)
    return Counter(v[noise.randbelow(rng, len(v))] for _, v in sorted(by_user.items()))


def _two_sided_geometric(epsilon: float, size: int, rng: noise.Generator) -> np.ndarray:
    """Integer noise with P(k) ∝ exp(-ε|k|): the difference of two Geometric(1 - e^-ε)
    variables on {1, 2, ...}, each by the inverse CDF of a uniform in (0, 1] with 53 random bits
    (noise.uniform). The uniforms' grid moves each P(g ≥ m) by at most 2⁻⁵³ and cuts the tail at
    53·ln 2 / ε, so each geometric is within total variation (37/ε + 2)·2⁻⁵³ of the ideal one
    (under 4·10⁻¹³ for ε ≥ 0.01), and the release is (ε', δ')-DP, ε' the ledger's ε for it, with
    δ' ≤ (1 + e^ε')·4 times that (two cells change, two geometrics each): below 10⁻¹¹ for
    0.01 ≤ ε ≤ 1, which the ledger leaves out. With torch's float32 uniforms (24 bits) the cut
    was at 24·ln 2 / ε and δ' of order 10⁻⁷ a cell."""
    u = 1.0 - noise.uniform(rng, 2 * size).numpy()
    g = np.floor(np.log(u) / -epsilon).astype(np.int64) + 1  # log(1 - p) = -ε
    return g[:size] - g[size:]


def release_control_codes(
    cfg: CodesConfig,
    data: DataConfig,
    *,
    train_path: Path,
    out_dir: Path,
    delta: float | str = DEFAULT_DELTA,
    accountant: str = "prv",
    secure_mode: bool = False,
) -> CodesResult:
    """Write `out_dir/control_codes.json` (the counts generation samples from) and its ledger entry.

    The recipe: read the split → `_exact` (NOT private, opted into) or the DP histogram
    (`_code_counts`, by user `_one_per_user` → `_gaussian` or `_geometric` noise → `_floored`) →
    `_save`, manifest last.
    The run's public seed drives nothing here: the mechanism's only randomness is its noise
    and per-user picks, which come from secret entropy (see the module doc).
    """
    if cfg.mechanism is None:
        raise ValueError(
            "control_codes.mechanism is unset and no control_codes.domain is declared: declare the domain "
            "(DP release) or set control_codes.mechanism=exact (NOT private)"
        )
    users = read_users(train_path)
    if cfg.mechanism == "exact":
        counts, entry = _exact(_code_counts(train_path))
        return _save(cfg.mechanism, data, Path(out_dir), counts, entry, train_path)
    rng = noise.generator("control_codes", secure=secure_mode)
    true = _code_counts(train_path) if users is None else _one_per_user(train_path, users, rng)
    unit, n_units = "record" if users is None else "user", sum(true.values())
    delta = resolve_delta(delta, n_units)
    if weak := weak_delta_warning(delta, n_units, unit, STAGE):
        log.warning("%s", weak)
    bins = domain_codes(data, cfg.domain)
    assert set(true) <= set(bins), "prepare_data checks every code against the domain"
    exact = np.array([true.get(b, 0) for b in bins], dtype=float)
    where = (f"histogram of {len(bins)} declared code combinations over {n_units} {unit}s"
             + ("" if users is None else ", one random record per user"))
    if cfg.mechanism == "gaussian":
        noisy, entry = _gaussian(exact, cfg.epsilon, delta, accountant, rng, unit, secure_mode, where)
    else:
        noisy, entry = _geometric(exact, cfg.epsilon, rng, unit, secure_mode, where)
    counts = _floored(noisy, bins, entry)
    return _save(cfg.mechanism, data, Path(out_dir), counts, with_pld_epsilons(entry), train_path)  # replace-one ε too


def _exact(counts: Counter) -> tuple[dict[str, float], LedgerEntry]:
    """control_codes.mechanism=exact: the counts as they are, and a ledger entry that says so."""
    entry = LedgerEntry(
        stage=STAGE, private=False, epsilon=None, mechanism="exact",
        note="NOT differentially private: generation prompts are drawn from the exact "
        f"control-code counts of the private training split ({counts.total()} records). Who wrote "
        "which text stays protected by the teacher's DP-SGD, but the counts per code "
        "combination are released as they are (set control_codes.mechanism to release them with DP)",
    )
    return {c: float(n) for c, n in counts.items()}, entry


def _gaussian(exact: np.ndarray, epsilon: float, delta: float, accountant: str, rng, unit: str, secure: bool,
              where: str) -> tuple[np.ndarray, LedgerEntry]:
    """The Gaussian histogram: σ calibrated by the accountant for (ε, δ), one step at q = 1."""
    sigma, calibrate = gaussian_sigma(epsilon, delta, accountant)
    noisy = exact + noise.normal(rng, sigma, len(exact)).numpy()
    history = [(sigma, 1.0, 1)]
    return noisy, LedgerEntry(
        stage=STAGE, private=True, epsilon=epsilon_of(calibrate, history, delta), delta=delta, accountant=calibrate,
        mechanism="gaussian", noise_multiplier=sigma, sample_rate=1.0, steps=1, privacy_unit=unit,
        epsilon_rdp=epsilon_of("rdp", history, delta), history=history,
        replace_one_sensitivity=HISTOGRAM_REPLACE_SENSITIVITY, noise_source=noise.source(secure),
        note=f"Gaussian noise (σ={sigma:.4g}) on the {where}; negative counts floored at 0",
    )


def _geometric(exact: np.ndarray, epsilon: float, rng, unit: str, secure: bool,
               where: str) -> tuple[np.ndarray, LedgerEntry]:
    """The two-sided geometric histogram: pure ε."""
    noisy = exact + _two_sided_geometric(epsilon, len(exact), rng)
    return noisy, LedgerEntry(
        stage=STAGE, private=True, epsilon=epsilon, delta=0.0, mechanism="geometric", privacy_unit=unit,
        noise_source=noise.source(secure),
        note=f"two-sided geometric noise (pure ε={epsilon}) on the {where}; negative counts floored at 0",
    )


def _floored(noisy: np.ndarray, bins: list[str], entry: LedgerEntry) -> dict[str, float]:
    """The noisy counts floored at 0 (post-processing); all noise: uniform over the domain."""
    floored = np.maximum(noisy, 0.0)
    if floored.sum() == 0:
        floored[:] = 1.0  # all noise: fall back to uniform over the domain (still DP)
        entry.note += "; every noisy count was ≤ 0, so prompts are uniform over the domain"
    return {b: float(v) for b, v in zip(bins, floored) if v > 0}


def public_control_codes(data: DataConfig, domain: dict[str, list[str]], out_dir: Path) -> CodesResult:
    """The ε = 0 control's prompts (distill.method=public_only): one count for every code
    combination the declared public domain allows. Reads no record: nothing to account."""
    entry = LedgerEntry(stage=STAGE, private=True, epsilon=0.0, epsilon_replace_one=0.0, epsilon_pld=0.0,
                        mechanism="public", note="no private record read: prompts uniform over the declared "
                        "public control_codes.domain")
    counts = dict.fromkeys(domain_codes(data, domain), 1.0)
    return _save("public", data, Path(out_dir), counts, entry, None)


def _save(mechanism: str, data: DataConfig, out_dir: Path, counts: dict[str, float], entry: LedgerEntry,
          train_path: Path | None) -> CodesResult:
    """control_codes.json (the counts, most frequent first), then the manifest."""
    path = out_dir / RELEASED
    atomic_write_json(
        path,
        {
            "columns": data.code_columns,
            "private": entry.private,
            "mechanism": mechanism,
            "note": entry.note,
            "counts": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        },
    )
    write_manifest(out_dir, stage=STAGE, inputs={"train": train_path} if train_path else {}, outputs={"released": path},
                   extra={"ledger": entry.model_dump()})
    return CodesResult(path=path, ledger=entry)
