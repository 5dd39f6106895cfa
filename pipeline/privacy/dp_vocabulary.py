"""A DP tokenizer: the byte-level BPE vocabulary learned from a noised, thresholded word
histogram of the private training split (Ponomareva et al. 2022, Algorithm 1).

    words, entry = dp_word_counts(train_path, epsilon=0.5, max_words=64, delta=δ, ...)
    tokenizer = train_tokenizer(weighted_words(words), vocab_size)   # pipeline/models/base.py

A tokenizer trained on the private text as it is would publish its rare words (a name, an
address) in its vocabulary. Here:

- each privacy unit (a record, or a user's records together) counts each distinct word it
  uses once, and at most `max_words` = k of them (the first ones it uses): one unit changes at
  most k counts, each by one, an L2 sensitivity of √k;
- every count gets Gaussian noise of standard deviation z·√k, z calibrated by the accountant
  for ε at the run's δ (a Gaussian mechanism, one step at q = 1, composed with the rest of
  the run like the control-code histogram; replace-one moves up to k counts down and k up:
  √2 times the sensitivity, as the histogram's);
- a word is kept only if its noisy count exceeds τ = 1 + z·√k·Φ̄⁻¹(δ_τ / 2k). Unlike the
  control codes' declared domain, the words are not known in advance, so which words appear
  at all is itself private: a word that only one unit uses (count 1) passes τ with
  probability below δ_τ / 2k, so any of a unit's k words, or of a replaced unit's 2k, with
  probability below δ_τ. That probability is added to the run's δ (`delta_threshold`; the
  ledger's total δ is the accountant's δ plus it; Gopi et al. 2020, "Differentially private
  set union", for this thresholding argument).

The BPE merges are then learned from the kept words weighted by their noisy counts
(post-processing). Words are the pieces the byte-level pre-tokenizer splits text into, so the
trained tokenizer splits new text the same way. The raw counts never leave this module; the
noisy ones are not written anywhere either (the tokenizer's vocabulary and merges are the release).
The noise comes from secret entropy (pipeline/privacy/noise.py), never from the run's seed.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path

from scipy.stats import norm
from tokenizers.pre_tokenizers import ByteLevel

from pipeline.privacy import noise
from pipeline.privacy.accountant import epsilon_of
from pipeline.privacy.control_codes import gaussian_sigma
from pipeline.privacy.ledger import LedgerEntry, with_pld_epsilons
from pipeline.privacy.pld import HISTOGRAM_REPLACE_SENSITIVITY
from pipeline.records import parquet_batches, read_users

log = logging.getLogger(__name__)

STAGE = "base-models"
"""The release's name in the ledger and the dataset budget: the flow stage that builds the pair."""
_WORDS = ByteLevel(add_prefix_space=False, use_regex=True)  # how ByteLevelBPETokenizer splits text


def unit_words(text: str, max_words: int) -> list[str]:
    """The first `max_words` distinct words of `text`, as the byte-level pre-tokenizer splits it
    (raw text pieces, e.g. ' restaurant')."""
    seen: dict[str, None] = {}
    for _, (start, end) in _WORDS.pre_tokenize_str(text):
        seen.setdefault(text[start:end])
        if len(seen) == max_words:
            break
    return list(seen)


def true_counts(train_path: Path, max_words: int) -> tuple[Counter, int, str]:
    """(units using each word, counting at most `max_words` words per unit; units; 'record' or
    'user'). A user's records are joined in split order before their words are taken."""
    texts = [t for batch in parquet_batches(train_path, columns=["text"]) for t in batch.column(0).to_pylist()]
    users = read_users(train_path)
    if users is not None:
        by_user: dict[str, list[str]] = {}
        for u, t in zip(users, texts, strict=True):
            by_user.setdefault(u, []).append(t)
        texts = ["\n".join(v) for _, v in sorted(by_user.items())]
    counts: Counter = Counter()
    for text in texts:
        counts.update(unit_words(text, max_words))
    return counts, len(texts), "record" if users is None else "user"


def threshold(z: float, max_words: int, delta_threshold: float) -> float:
    """τ: a count of 1 (a word of one unit only) passes with probability δ_τ / 2k."""
    return 1.0 + z * math.sqrt(max_words) * norm.isf(delta_threshold / (2 * max_words))


def planned_entry(epsilon: float, max_words: int, delta: float, accountant: str, unit: str,
                  note: str = "planned") -> LedgerEntry:
    """The release as the ledger records it (no data read): z, ε and the threshold's δ."""
    z, calibrate = gaussian_sigma(epsilon, delta, accountant, "base_models.tokenizer_epsilon")  # z: σ over √k
    history = [(z, 1.0, 1)]
    return LedgerEntry(
        stage=STAGE, private=True, epsilon=epsilon_of(calibrate, history, delta), delta=delta,
        delta_threshold=delta, accountant=calibrate, mechanism="gaussian", noise_multiplier=z, sample_rate=1.0,
        steps=1, privacy_unit=unit, epsilon_rdp=epsilon_of("rdp", history, delta), history=history,
        replace_one_sensitivity=HISTOGRAM_REPLACE_SENSITIVITY, note=note,
    )


def dp_word_counts(train_path: Path, *, epsilon: float, max_words: int, delta: float, accountant: str,
                   secure_mode: bool = False) -> tuple[dict[str, float], LedgerEntry]:
    """The kept words with their noisy counts, and the release's ledger entry (replace-one ε
    filled in). δ_τ, the threshold's, is the run's δ again: the total δ doubles (module doc)."""
    counts, n_units, unit = true_counts(train_path, max_words)
    entry = planned_entry(epsilon, max_words, delta, accountant, unit)
    z = entry.noise_multiplier
    tau = threshold(z, max_words, delta)
    words = sorted(counts)
    rng = noise.generator("tokenizer", secure=secure_mode)
    noisy = noise.normal(rng, z * math.sqrt(max_words), len(words)).numpy()
    noisy += [counts[w] for w in words]
    kept = {w: float(c) for w, c in zip(words, noisy) if c > tau}
    entry = with_pld_epsilons(entry.model_copy(update={
        "noise_source": noise.source(secure_mode),
        "note": f"DP tokenizer: Gaussian noise (σ = {z:.4g}·√{max_words}) on the counts of the words of {n_units} "
                f"{unit}s (at most {max_words} distinct words each), words kept above τ = {tau:.1f} "
                f"(a word of one {unit} passes with probability below δ_τ = {delta:.3g}, added to the total δ); "
                f"{len(kept)} words kept; the BPE vocabulary is learned from them",
    }))
    log.info("DP tokenizer: %d %ss, σ = %.4g·√%d, τ = %.1f, ε = %.4f at δ = %.3g (+ δ_τ = %.3g); %d words kept",
             n_units, unit, z, max_words, tau, entry.epsilon, delta, delta, len(kept))
    return kept, entry


def weighted_words(words: dict[str, float]):
    """The kept words for the BPE trainer, each as often as its noisy count says, rounded
    (post-processing): batches of n copies ('a' * n would be one word 'aaa…')."""
    for word, count in words.items():
        if (n := round(count)) > 0:
            yield [word] * n
