"""The evaluation's perplexities (pipeline/stages/evaluate.py, issue 37): the per-record
figures and the text-only ones checked against a plain forward pass per record, and a change
of the control codes alone that the text-only figures must not see."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from pipeline.prompts import header
from pipeline.records import encode_record
from pipeline.stages.evaluate import perplexity

TEXTS = [f"Review {i}: the soup was cold, the bread was fine." * (1 + i % 3) for i in range(6)]
WINDOW = 64


def _context_free(tok):
    """A 1-layer GPT-2 whose attention adds nothing (its output projection is zero): each
    position's prediction depends on its own token and position only, so a text token's NLL
    cannot depend on the control codes before it. Embeddings scaled up so that predictions
    differ from token to token (a fresh init predicts nearly uniformly)."""
    torch.manual_seed(0)
    model = make_tiny_model(tok, context=WINDOW)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.zero_()
            block.attn.c_proj.bias.zero_()
        model.transformer.wte.weight.mul_(50)  # tied to lm_head: sharp, token-dependent logits
    return model.eval()


@torch.no_grad()
def _by_hand(model, records: list[list[int]], headers: list[int]) -> tuple[list, list, list, list]:
    """Per record: summed NLL and targets over all its tokens, and over its text tokens
    (index >= its header's length), from one forward pass per window of `WINDOW` tokens."""
    nll, cnt, t_nll, t_cnt = [], [], [], []
    for ids, h in zip(records, headers):
        a = b = 0.0
        n = m = 0
        for start in range(0, len(ids), WINDOW):
            x = torch.tensor([ids[start : start + WINDOW]])
            if x.shape[1] < 2:
                continue
            logits = model(x, attention_mask=torch.ones_like(x)).logits[0, :-1].float()
            losses = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
            for offset, loss in enumerate(losses.tolist()):
                a, n = a + loss, n + 1
                if start + 1 + offset >= h:  # the predicted token is text (eos included)
                    b, m = b + loss, m + 1
        nll.append(a)
        cnt.append(n)
        t_nll.append(b)
        t_cnt.append(m)
    return nll, cnt, t_nll, t_cnt


def test_per_record_token_weighted_and_text_only_equal_a_forward_pass_per_record(tiny_tokenizer):
    tok = tiny_tokenizer
    model = _context_free(tok)
    codes = ["Stars: 5", "Stars: 1"] * 3
    records = [encode_record(tok, c, t) for c, t in zip(codes, TEXTS)]
    assert max(map(len, records)) > WINDOW  # a record cut into windows is covered too
    headers = [len(tok.encode(header(c), add_special_tokens=False)) for c in codes]
    nll, cnt, t_nll, t_cnt = _by_hand(model, records, headers)

    ppl = perplexity(model, tok, codes, TEXTS, window=WINDOW, batch_size=4)
    per_record = [math.exp(a / n) for a, n in zip(nll, cnt)]
    # the mean and median are what they were: each record's own perplexity, unweighted
    assert ppl.per_record_mean == pytest.approx(float(np.mean(per_record)), rel=1e-5)
    assert ppl.per_record_median == pytest.approx(float(np.median(per_record)), rel=1e-5)
    assert ppl.per_record_token_weighted == pytest.approx(math.exp(sum(nll) / sum(cnt)), rel=1e-5)
    text = ppl.text_only
    assert text["per_record_token_weighted"] == pytest.approx(math.exp(sum(t_nll) / sum(t_cnt)), rel=1e-5)
    text_per_record = [math.exp(a / n) for a, n in zip(t_nll, t_cnt)]
    assert text["per_record_mean"] == pytest.approx(float(np.mean(text_per_record)), rel=1e-5)
    assert text["per_record_median"] == pytest.approx(float(np.median(text_per_record)), rel=1e-5)
    assert text["records"] == ppl.records == len(TEXTS)
    # windowed: the header's targets are left out, nothing else (a window's first token is no target)
    is_text = [k >= h for r, h in zip(records, headers) for k in range(len(r))]
    assert text["tokens"] == sum(t for k, t in enumerate(is_text) if k % WINDOW) < ppl.tokens
    assert set(text["per_code"]) == set(ppl.per_code)


def test_a_change_of_the_control_codes_alone_moves_the_full_figures_not_the_text_only_ones(tiny_tokenizer):
    tok = tiny_tokenizer
    model = _context_free(tok)
    a_codes, b_codes = ["Stars: 5"] * len(TEXTS), ["Stars: 2"] * len(TEXTS)
    a_head, b_head = (tok.encode(header(c[0]), add_special_tokens=False) for c in (a_codes, b_codes))
    # the headers differ, but in as many tokens and not in the last one (the first text token's context)
    assert a_head != b_head and len(a_head) == len(b_head) and a_head[-1] == b_head[-1]

    a = perplexity(model, tok, a_codes, TEXTS, window=WINDOW, batch_size=4)
    b = perplexity(model, tok, b_codes, TEXTS, window=WINDOW, batch_size=4)
    for key in ("windowed", "per_record_mean", "per_record_median", "per_record_token_weighted"):
        assert getattr(a, key) != pytest.approx(getattr(b, key), rel=1e-3), key  # the header counts here
        assert a.text_only[key] == pytest.approx(b.text_only[key], rel=1e-6), key  # and not here
