"""The fast decode loop (pipeline/models/decoding.py) against HF's generate, its reference.

Three exact checks (the cached forward gives the model's logits; the truncation gives HF's
warped distribution; the n-gram ban is HF's) and one statistical check of the whole loop:
per-position token frequencies of a few thousand samples from each engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from pipeline.config import GenerateConfig
from pipeline.models.decoding import _empty_slots, _forward_one, _Refill, ban_repeated_ngrams, truncated_logits
from pipeline.stages.sampling import sample_shard
from conftest import make_tiny_model

CODE = "Category: A"


@pytest.fixture(scope="module")
def peaked_model(tiny_tokenizer):
    """A tiny GPT-2 whose next-token distribution is far from uniform (the final layer norm's
    gain raised): top-k, top-p and the temperature each change what it samples."""
    torch.manual_seed(0)
    model = make_tiny_model(tiny_tokenizer).eval()
    with torch.no_grad():
        model.transformer.ln_f.weight.mul_(8.0)
    return model


def test_the_cached_forward_gives_the_models_logits(peaked_model):
    """Rows of different prompt lengths, prompts taken from the prefix cache, then fed one token
    a step side by side: every row's logits at every position are the full forward's."""
    torch.manual_seed(1)
    rows = [torch.randint(1, 300, (n,)).tolist() for n in (12, 7, 20)]
    prompts = [r[:n] for r, n in zip(rows, (3, 5, 1))]  # the first len(prompt) - 1 come from the cache
    state = _empty_slots(peaked_model, len(rows), 32)
    refill = _Refill(peaked_model, prompts, [0] * len(rows))
    got: list[list[torch.Tensor]] = [[] for _ in rows]
    with torch.no_grad():
        for slot, row in enumerate(rows):
            refill(state, slot)
            state.tokens[slot, : len(row)] = torch.tensor(row)
        for _ in range(max(map(len, rows))):
            logits = _forward_one(peaked_model, state)  # (S, V)
            for slot, row in enumerate(rows):
                if int(state.fed[slot]) < len(row):
                    got[slot].append(logits[slot])
            state.fed = (state.fed + 1).clamp(max=31)
        for row, prompt, logits in zip(rows, prompts, got):
            want = peaked_model(torch.tensor([row])).logits[0, len(prompt) - 1 :]  # (n - P + 1, V)
            torch.testing.assert_close(torch.stack(logits), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k, top_p, temperature", [
    (50, 0.9, 1.0), (20, 0.5, 0.7), (0, 0.8, 1.3), (0, 1.0, 1.0), (5, 1.0, 2.0), (400, 0.95, 1.0),
])
def test_truncation_is_hfs_warped_distribution(top_k, top_p, temperature):
    """The probabilities left after temperature, top-k and top-p equal those after HF's warpers,
    applied in generate's order (and only when generate applies them)."""
    logits = torch.randn(6, 300) * 3  # (R, V)
    warped = logits.clone()
    warpers = ([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []) + \
              ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
    for warper in warpers:
        warped = warper(None, warped)
    values, ids = truncated_logits(logits, top_k, top_p, temperature)
    probs = values.softmax(-1)
    ours = probs if ids is None else torch.zeros_like(logits).scatter(-1, ids, probs)
    torch.testing.assert_close(ours, warped.softmax(-1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_repeated_ngram_ban_is_hfs_for_rows_of_any_length(n):
    torch.manual_seed(2)
    tokens = torch.randint(0, 4, (5, 16))  # few distinct tokens: many repeats
    lengths = torch.tensor([16, 9, 3, 1, 12])
    logits = torch.randn(5, 6)
    ours = ban_repeated_ngrams(logits, tokens, lengths, n)
    for r, length in enumerate(lengths.tolist()):
        want = NoRepeatNGramLogitsProcessor(n)(tokens[r : r + 1, :length], logits[r : r + 1])
        torch.testing.assert_close(ours[r : r + 1], want)


N, NEW, ALPHA = 4000, 6, 1e-3


def _samples(model, tok, engine: str, seed: int, *, top_k: int, top_p: float, temperature: float) -> np.ndarray:
    """(N, NEW) new tokens of N samples of one prompt (eos kept as a token: -1 pads an early end)."""
    prompt = len(tok.encode(f"{CODE}\n\n", add_special_tokens=False))  # data.prompt_for's layout
    cfg = GenerateConfig(num_samples=N, batch_size=500, max_length=prompt + NEW, top_k=top_k, top_p=top_p,
                         temperature=temperature, validation_fraction=0.0, engine=engine)
    rows, _ = sample_shard(model, tok, cfg, {CODE: 1.0}, 0, N, seed, keep_empty=True)
    out = np.full((N, NEW), -1)
    for i, (seq, start) in enumerate(zip(rows["token_ids"], rows["n_prompt_tokens"])):
        new = seq[start:]
        out[i, : len(new)] = new
    return out


def _smallest_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest, over positions, chi-square homogeneity p-value of the two samples' token
    frequencies at that position (tokens seen fewer than 20 times in both pooled into one bin:
    the chi-square approximation wants ~10 expected a cell)."""
    p_values = []
    for t in range(a.shape[1]):
        tokens = np.union1d(a[:, t], b[:, t])
        table = np.array([[np.sum(x[:, t] == v) for v in tokens] for x in (a, b)])  # (2, tokens)
        rare = table.sum(0) < 20
        table = np.column_stack([table[:, ~rare], table[:, rare].sum(1)]) if rare.any() else table
        p_values.append(chi2_contingency(table[:, table.sum(0) > 0])[1])
    return min(p_values)


@pytest.mark.parametrize("top_k, top_p, temperature", [(20, 0.8, 0.8), (0, 0.9, 1.3)])
def test_fast_and_hf_engines_sample_the_same_distribution(peaked_model, tiny_tokenizer, top_k, top_p, temperature):
    """4000 samples of 6 tokens from each engine (independent seeds): at every position the token
    frequencies agree by a chi-square homogeneity test. The check fails when the smallest of
    the 6 p-values is below ALPHA / 6: a false alarm rate of at most ALPHA = 0.001 for a
    correct engine (Bonferroni). The next test shows that it sees a change of top-p."""
    sampling = dict(top_k=top_k, top_p=top_p, temperature=temperature)
    fast = _samples(peaked_model, tiny_tokenizer, "fast", seed=1, **sampling)
    hf = _samples(peaked_model, tiny_tokenizer, "hf", seed=2, **sampling)
    assert _smallest_p_value(fast, hf) >= ALPHA / NEW


def test_the_frequency_test_sees_a_changed_top_p(peaked_model, tiny_tokenizer):
    """The same test rejects when one engine truncates at top-p 0.8 and the other at 0.7."""
    fast = _samples(peaked_model, tiny_tokenizer, "fast", seed=1, top_k=20, top_p=0.8, temperature=0.8)
    hf = _samples(peaked_model, tiny_tokenizer, "hf", seed=2, top_k=20, top_p=0.7, temperature=0.8)
    assert _smallest_p_value(fast, hf) < ALPHA / NEW


def test_the_plans_steady_steps_decode_every_row_at_the_asked_depth(peaked_model, monkeypatch):
    """decoding.steady_steps, what the plan times for a token: every row feeds and samples at
    each step, from `position` on (clamped so that the steps fit in max_length)."""
    from pipeline.models import decoding

    seen = []
    forward = decoding._forward_one

    def spy(model, slots):
        seen.append((len(slots.fed), slots.fed.tolist(), (slots.n_tokens - slots.fed).tolist()))
        return forward(model, slots)

    monkeypatch.setattr(decoding, "_forward_one", spy)
    decoding.steady_steps(peaked_model, 5, 30, 4, max_length=64, top_k=50, top_p=0.9, temperature=1.0)
    assert [fed for _, fed, _ in seen] == [[30 + i] * 5 for i in range(4)]
    assert all(rows == 5 and ahead == [1] * 5 for rows, _, ahead in seen)  # each row samples at every step
    seen.clear()
    decoding.steady_steps(peaked_model, 2, 200, 4, max_length=64, top_k=0, top_p=1.0, temperature=1.0)
    assert [fed for _, fed, _ in seen] == [[59 + i] * 2 for i in range(4)]  # clamped: the last step at 62 < 64
