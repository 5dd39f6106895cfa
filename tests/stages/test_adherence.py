"""Code adherence (pipeline/stages/adherence.py): the aggregation on hand-made outcomes, and a tiny
teacher trained to follow its code that the measure must tell from one that does not."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import make_tiny_model
from pipeline.stages.adherence import AdherenceError, SampleOutcome, code_adherence, declared_values, summarize
from pipeline.batching import TokenizedRecords, lm_batch
from pipeline.config import DataConfig
from pipeline.prompts import header
from pipeline.records import encode_record
from pipeline.stages.sampling import SCHEMA

COLOR = {"red": "Color: red", "blue": "Color: blue"}  # value -> code part ('{column}: {value}', column Color)
# Public toy text: each code is followed by its own word, repeated.
TEXTS = {v: [" ".join([v] * k) for k in range(2, 12)] for v in COLOR}


def test_summarize_counts_per_value_column_and_sample():
    outcomes = [
        SampleOutcome({"a": "x", "b": "p"}, {"a": True, "b": True}),
        SampleOutcome({"a": "x", "b": "q"}, {"a": False, "b": True}),
        SampleOutcome({"a": "y", "b": "p"}, {"a": True, "b": False}),
        SampleOutcome({"a": "y", "b": "q"}, {"a": True, "b": True}),
    ]
    result = summarize(outcomes, {"a": ["x", "y", "z"], "b": ["p", "q"]}, skipped=2, truncated=1)
    a, b = result["columns"]["a"], result["columns"]["b"]
    assert (a["share"], a["chance"], a["n"]) == (0.75, pytest.approx(1 / 3), 4)
    assert a["values"] == {"x": {"share": 0.5, "n": 2}, "y": {"share": 1.0, "n": 2}, "z": {"share": None, "n": 0}}
    assert (b["share"], b["chance"], b["values"]["p"]) == (0.75, 0.5, {"share": 0.5, "n": 2})
    assert result["overall"] == 6 / 8  # (sample, column) pairs won
    assert result["all_columns"] == 2 / 4  # samples 1 and 4 win on both columns
    assert (result["samples"], result["skipped"], result["truncated"]) == (4, 2, 1)
    assert summarize([], {"a": ["x", "y"]})["overall"] is None


def test_declared_values_from_the_domain_or_the_released_codes(tmp_path):
    data = DataConfig(path=tmp_path / "unused.csv", code_columns=["Color", "Size"], code_template="{column}: {value}")
    values = declared_values(data, {"Color": ["red", "blue"], "Size": ["S"]}, None)
    assert values == {"Color": {"red": "Color: red", "blue": "Color: blue"}, "Size": {"S": "Size: S"}}
    released = tmp_path / "control_codes.json"  # what generation samples from when no domain is declared
    released.write_text(json.dumps({"counts": {"Color: red\tSize: S": 3.0, "Color: blue\tSize: S": 1.0}}))
    assert declared_values(data, None, released) == {"Color": {"blue": "Color: blue", "red": "Color: red"},
                                                     "Size": {"S": "Size: S"}}


def _teacher_that_follows_its_code(tok):
    """A 1-layer GPT-2 trained (plain Adam, public toy text) until each code predicts its word."""
    torch.manual_seed(0)
    model = make_tiny_model(tok)
    records = [encode_record(tok, COLOR[v], t) for v in COLOR for t in TEXTS[v]]
    data = TokenizedRecords(records, tok.pad_token_id, max(map(len, records)))
    batch = lm_batch(data.ids, data.lengths)
    labels = batch.pop("labels")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        logits = model(**batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _shard(path, tok, samples: list[tuple[str, str]]) -> None:
    """A synthetic shard as generation writes it: (requested value, text) per sample."""
    rows = {name: [] for name in SCHEMA.names}
    for i, (value, text) in enumerate(samples):
        prompt = tok.encode(header(COLOR[value]), add_special_tokens=False)
        ids = prompt + tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        for name, x in zip(SCHEMA.names, (i, "train", COLOR[value], text, len(ids), len(prompt), ids, True)):
            rows[name].append(x)
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows, schema=SCHEMA), path / "shard-00000.parquet")


def test_adherence_is_high_when_text_follows_the_code_and_low_when_the_codes_are_swapped(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    model = _teacher_that_follows_its_code(tok)
    samples = [(v, t) for v in COLOR for t in TEXTS[v][::2]]
    swapped = [("blue" if v == "red" else "red", t) for v, t in samples]
    _shard(tmp_path / "right", tok, samples)
    _shard(tmp_path / "swapped", tok, swapped)
    values = {"Color": COLOR}

    right = code_adherence(model, tok, tmp_path / "right", values, n=100, batch_size=4)
    assert right["samples"] == len(samples) and right["skipped"] == right["truncated"] == 0
    assert right["columns"]["Color"]["share"] > 0.9 and right["all_columns"] > 0.9
    assert right["columns"]["Color"]["chance"] == 0.5
    assert {v: x["n"] for v, x in right["columns"]["Color"]["values"].items()} == {"red": 5, "blue": 5}
    wrong = code_adherence(model, tok, tmp_path / "swapped", values, n=100, batch_size=4)
    assert wrong["columns"]["Color"]["share"] < 0.1 and wrong["overall"] < 0.1
    # the first n samples only, in shard order
    assert code_adherence(model, tok, tmp_path / "right", values, n=3, batch_size=4)["samples"] == 3


def test_a_sample_too_long_for_the_context_is_cut_the_same_for_every_candidate(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    model = _teacher_that_follows_its_code(tok)
    long = " ".join(["red"] * 200)  # far beyond the model's 64 positions
    _shard(tmp_path / "s", tok, [("red", long), ("red", "red red")])
    result = code_adherence(model, tok, tmp_path / "s", {"Color": COLOR}, n=10, batch_size=4)
    assert (result["samples"], result["truncated"], result["skipped"]) == (2, 1, 0)


def test_a_code_outside_the_declared_values_names_the_sample_and_column(tmp_path, tiny_tokenizer):
    _shard(tmp_path / "s", tiny_tokenizer, [("red", "red red"), ("blue", "blue")])
    with pytest.raises(AdherenceError, match=r"synthetic sample 1, column 'Color'.*regenerate"):
        code_adherence(make_tiny_model(tiny_tokenizer), tiny_tokenizer, tmp_path / "s",
                       {"Color": {"red": "Color: red", "green": "Color: green"}}, n=10, batch_size=4)


def test_padded_scores_equal_scores_one_sequence_at_a_time(tiny_tokenizer):
    """Candidates of different prompt lengths share a right-padded batch: padding changes no score."""
    from pipeline.stages.adherence import _continuation_logprobs

    model = make_tiny_model(tiny_tokenizer).eval()
    seqs = [([5, 6, 7, 8, 9, 10], 2), ([5, 6, 8, 9, 10], 3), ([11, 9, 10], 1)]
    batched = _continuation_logprobs(model, seqs, tiny_tokenizer.pad_token_id)
    alone = [_continuation_logprobs(model, [s], tiny_tokenizer.pad_token_id)[0] for s in seqs]
    assert batched == pytest.approx(alone, abs=1e-4)
    ids, start = seqs[0]  # the same number from the model's own log-softmax
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].detach(), -1)
    assert alone[0] == pytest.approx(sum(float(logp[t - 1, ids[t]]) for t in range(start, len(ids))), abs=1e-4)
