"""The DP tokenizer (base_models.tokenizer=dp, pipeline/privacy/dp_vocabulary.py): each unit
counts at most k distinct words, the noisy counts are thresholded so that a word of one unit
passes with probability δ_τ / 2k, and the ledger adds δ_τ to the total δ."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy.stats import norm

from pipeline.config import BaseModelsConfig
from pipeline.models.base import train_tokenizer
from pipeline.privacy.dp_vocabulary import (dp_word_counts, planned_entry, threshold, true_counts, unit_words,
                                            weighted_words)
from pipeline.privacy.ledger import LedgerEntry, compose, with_pld_epsilons

CANARY = "Zqxvbnmwort"
COMMON = "the food was good and the service was slow but the staff were kind"


def _split(path, texts, users=None):
    columns = {"control_code": ["c"] * len(texts), "text": texts}
    if users is not None:
        columns["user"] = users
    pq.write_table(pa.table(columns), path)
    return path


def test_a_unit_counts_each_word_once_and_at_most_k_words(tmp_path):
    many = " ".join(f"w{a}{b}" for a in "abcdefghij" for b in "abcdefghij")  # 100 distinct words
    assert unit_words("the cat the cat sat", 10) == ["the", " cat", " the", " sat"]
    assert len(unit_words(many, 8)) == 8
    counts, n, unit = true_counts(_split(tmp_path / "r.parquet", [many, "the the the"]), max_words=8)
    assert (n, unit) == (2, "record") and sum(counts.values()) == 8 + 2  # 'the', ' the'
    # a user's records are one unit: three records of one user count each word once, at most k in all
    users = _split(tmp_path / "u.parquet", [many, many, "x y"], users=["a", "a", "b"])
    counts, n, unit = true_counts(users, max_words=8)
    assert (n, unit) == (2, "user") and max(counts.values()) == 1 and sum(counts.values()) == 8 + 2


def test_the_threshold_passes_a_word_of_one_unit_with_probability_delta_over_2k():
    z, k, delta = 1.3, 32, 1e-5
    tau = threshold(z, k, delta)
    # a count of 1 plus N(0, (z√k)²) above τ: δ/2k per word, so below δ for the 2k words of a replaced unit
    assert norm.sf((tau - 1) / (z * math.sqrt(k))) == pytest.approx(delta / (2 * k), rel=1e-9)


def test_a_word_of_a_few_records_leaks_from_a_plain_tokenizer_and_not_from_the_dp_one(tmp_path):
    """The attack: read the vocabulary. A name that three records use becomes a token of a
    tokenizer trained on the private text (the test has power); the DP one keeps only words
    that many records use."""
    texts = [COMMON] * 300 + [f"ask for {CANARY} at the bar"] * 3
    train = _split(tmp_path / "train.parquet", texts)
    plain = train_tokenizer(texts, vocab_size=400)
    assert any(CANARY[1:] in t for t in plain.get_vocab())
    words, entry = dp_word_counts(train, epsilon=4.0, max_words=16, delta=1e-5, accountant="prv")
    assert " food" in words and " service" in words  # 300 records: far above τ
    assert not any(CANARY in w for w in words)
    vocab = train_tokenizer(weighted_words(words), vocab_size=400).get_vocab()
    assert not any(CANARY[1:5] in t for t in vocab)
    assert "Ġfood" in vocab
    assert entry.private and entry.delta_threshold == 1e-5 and entry.noise_source.startswith("os-entropy")
    assert entry.replace_one_sensitivity == math.sqrt(2) and entry.epsilon == pytest.approx(4.0, abs=0.01)


def test_the_threshold_delta_is_added_to_the_total_and_not_to_the_accountants():
    delta = 1e-5
    vocab = with_pld_epsilons(planned_entry(1.0, 64, delta, "prv", "record"))
    sgd = with_pld_epsilons(LedgerEntry(stage="teacher", private=True, epsilon=1.0, delta=delta, accountant="prv",
                                        mechanism="subsampled_gaussian", history=[(1.0, 0.01, 500)],
                                        privacy_unit="record", replace_one_sensitivity=2.0, note="t"))
    without = compose([vocab.model_copy(update={"delta_threshold": None}), sgd], "prv", delta)
    total = compose([vocab, sgd], "prv", delta)
    assert total.epsilon == without.epsilon and total.epsilon_replace_one == without.epsilon_replace_one
    assert total.delta == pytest.approx(2 * delta) and total.accountant_delta() == pytest.approx(delta)
    assert without.delta == delta and without.accountant_delta() == delta
    assert "threshold δ of base-models" in total.composition


def test_a_dp_tokenizer_needs_a_pair_built_from_a_corpus():
    with pytest.raises(ValueError, match="base_models.tokenizer=dp .* base_models.corpus is not set"):
        BaseModelsConfig(tokenizer="dp")
