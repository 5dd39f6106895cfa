"""The downstream classifier: does a classifier trained on the synthetic text predict the real
test split's control codes? (issue 20)"""

from __future__ import annotations

import random

from pipeline.stages.downstream import code_classification
from pipeline.stages.evaluate import diagnose

WORDS = ["nice", "place", "went", "again", "the", "a", "staff", "time", "good", "bad"]
CATEGORIES = ["Bars", "Hotels", "Grocery"]
STARS = ["1.0", "5.0"]


def _records(n: int, rng: random.Random, copy_words: bool = True) -> tuple[list[str], list[str]]:
    """Joined codes (category, stars) and texts; with `copy_words` the category's word is in the text."""
    codes, texts = [], []
    for _ in range(n):
        cat, stars = rng.choice(CATEGORIES), rng.choice(STARS)
        filler = " ".join(rng.choice(WORDS) for _ in range(10))
        codes.append(f"{cat}\t{stars}")
        texts.append(f"{cat.lower()} {filler}" if copy_words else filler)
    return codes, texts


def test_a_synthetic_set_that_copies_the_codes_words_scores_above_chance_and_a_shuffled_one_at_chance():
    rng = random.Random(0)
    test_codes, test_texts = _records(300, rng)
    syn_codes, syn_texts = _records(400, rng)
    good = code_classification(syn_codes, syn_texts, test_codes, test_texts, ["category", "stars"])
    cat = good["columns"]["category"]
    assert cat["synthetic"]["accuracy"] > 0.95 and not cat["at_chance"]
    assert cat["real_reference"]["macro_f1"] > 0.95  # the words are in the real texts too
    assert cat["majority"]["accuracy"] < 0.5 and cat["chance_macro_f1"] >= 1 / 3
    assert good["columns"]["stars"]["at_chance"]  # no text carries the stars
    assert good["useful"] is True  # one column above chance is enough

    shuffled = syn_codes[:]
    rng.shuffle(shuffled)
    bad = code_classification(shuffled, syn_texts, test_codes, test_texts, ["category", "stars"])
    assert all(c["at_chance"] for c in bad["columns"].values()) and bad["useful"] is False


def test_a_column_with_one_value_is_skipped_not_scored():
    rng = random.Random(1)
    codes, texts = _records(60, rng)
    one = [c.split("\t")[0] + "\tonly" for c in codes]
    result = code_classification(one, texts, one, texts, ["category", "stars"])
    assert "skipped" in result["columns"]["stars"] and "synthetic" in result["columns"]["category"]


def _metrics(downstream=None, synthetic_mean=60.0, real_mean=70.0, synthetic_median=None, real_median=None) -> dict:
    tokens = lambda m, median: {"mean": m, "median": m if median is None else median, "p90": m}  # noqa: E731
    return {"perplexity": {}, "downstream": downstream,
            "text_properties": {"synthetic": {"tokens": tokens(synthetic_mean, synthetic_median)},
                                "real_test": {"tokens": tokens(300.0, None),
                                              "tokens_capped": tokens(real_mean, real_median)}}}


def test_useless_synthetic_data_is_said_in_plain_words():
    rng = random.Random(2)
    test_codes, test_texts = _records(200, rng)
    syn_codes, syn_texts = _records(200, rng, copy_words=False)  # text says nothing of the codes
    downstream = code_classification(syn_codes, syn_texts, test_codes, test_texts, ["category", "stars"])
    assert downstream["useful"] is False
    lines = diagnose(_metrics(downstream))
    assert any("no better than chance on any code column" in line for line in lines)
    assert not any("average" in line for line in lines)  # 60 against 70 tokens: comparable

    short = diagnose(_metrics(synthetic_mean=23.0, real_mean=81.0))  # the news corpus of issue 20
    assert any("23 tokens (median 23) against 81" in line and "mean 0.28x" in line for line in short)
    assert not diagnose(_metrics(synthetic_mean=66.0, real_mean=90.0))  # uncut reviews: 160 tokens, cut: 90


def test_the_length_warning_fires_on_the_medians_too():
    """Issue 37's news demo: a mean of 0.52x the real length (inside the 2x bound) hid medians of
    26.5 against 78 tokens (0.34x): a few long synthetic texts lifted the mean of mostly short ones."""
    [line] = diagnose(_metrics(synthetic_mean=40.6, real_mean=78.0, synthetic_median=26.5, real_median=78.0))
    assert "median 26) against 78 (median 78)" in line and "mean 0.52x, median 0.34x" in line
    assert not diagnose(_metrics(synthetic_mean=40.6, real_mean=78.0, synthetic_median=50.0, real_median=78.0))
    assert diagnose(_metrics(synthetic_mean=70.0, real_mean=78.0, synthetic_median=160.0, real_median=78.0))  # long


def test_mauve_tells_a_copy_of_the_real_texts_from_unrelated_ones(tiny_model_dir, tiny_tokenizer):
    """On the DP teacher's features, a synthetic set equal to the real texts scores near 1 and
    a set of another kind (digit strings) clearly lower."""
    from pipeline.models.base import load_causal_lm
    from pipeline.stages.downstream import mauve_score

    rng = random.Random(3)
    model = load_causal_lm(str(tiny_model_dir))
    _, real = _records(80, rng)
    other = [" ".join(str(rng.randrange(10)) for _ in range(12)) for _ in range(80)]
    same = mauve_score(model, tiny_tokenizer, real[::-1], real)
    far = mauve_score(model, tiny_tokenizer, other, real)
    assert same["texts"] == 80 and same["mauve"] > 0.9
    assert far["mauve"] < same["mauve"] - 0.3
    assert mauve_score(model, tiny_tokenizer, other[:10], real) is None  # too few texts to say
