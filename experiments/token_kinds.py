"""Test perplexity split by token kind: the control-code prompt, the review text and eos.

The table's metric (non-overlapping windows of the joined test records) mixes the prompts,
which are short and easy to predict, with the text itself. This splits the same windows'
negative log-likelihood by the kind of the predicted token, so that two students can be
compared on the text alone (docs/reference.md, "What the KL changes").

    .venv/bin/python experiments/token_kinds.py --config configs/reference.yaml \
        DP-SGD=runs/reference/<run>/student/model ours=runs/reference/<run>/student/model

It reads the config's test split: configs/reference.yaml's is the Yelp split in ../shared/data
beside the checkout (not shipped; experiments/shared.py); without it, one line and exit code 2.

Aggregates of the held-out test split, like the evaluation stage's (not protected: docs/privacy.md,
"The guarantee and what it does not cover").
"""

import argparse
import math
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.config import load_config
from pipeline.prompts import HEADER
from pipeline.records import CODE_JOINER, encode_record, read_table
from pipeline.stages.data import _joined_texts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.shared import require_data  # noqa: E402  the data in ../shared

KINDS = ("prompt", "text", "eos")


def token_kinds(tokenizer, codes: list[str], texts: list[str]) -> tuple[list[int], list[int]]:
    """The joined stream of records (encode_record's, as the evaluation scores them) and each
    token's kind: encode_record tokenizes the prompt apart, so its tokens come first."""
    ids, kinds = [], []
    for code, text in zip(codes, texts):
        record = encode_record(tokenizer, code, text)
        prompt = len(HEADER.ids(tokenizer, code))
        ids += record
        kinds += [0] * prompt + [1] * (len(record) - prompt - 1) + [2]
    return ids, kinds


@torch.no_grad()
def nll_by_kind(model, ids: list[int], kinds: list[int], window: int) -> tuple[list[float], list[int]]:
    nll, count = [0.0] * len(KINDS), [0] * len(KINDS)
    for start in range(0, len(ids) - 1, window):
        x = torch.tensor([ids[start : start + window]])
        logp = torch.log_softmax(model(x, attention_mask=torch.ones_like(x)).logits[0, :-1].float(), -1)
        losses = -logp.gather(1, x[0, 1:, None])[:, 0]
        for offset, loss in enumerate(losses.tolist()):
            kind = kinds[start + 1 + offset]
            nll[kind] += loss
            count[kind] += 1
    return nll, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/reference.yaml")
    parser.add_argument("models", nargs="+", metavar="LABEL=MODEL_DIR")
    args = parser.parse_args()
    cfg = load_config(args.config)
    require_data(cfg, "experiments/token_kinds.py", args.config)
    table = read_table(cfg.data.test_path)
    table = table.slice(0, cfg.data.max_test_records or len(table))
    texts, _ = _joined_texts(table, cfg.data)  # the evaluation stage's records, as the data stage joins them
    codes = [CODE_JOINER.join(values) for values in zip(*(table[c].to_pylist() for c in cfg.data.code_columns))]
    torch.set_num_threads(1)
    print("| model | all | prompt | text | eos |\n|---|---:|---:|---:|---:|")
    for label, path in (item.rsplit("=", 1) for item in args.models):  # a label may hold "="
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        ids, kinds = token_kinds(tokenizer, codes, texts)
        nll, count = nll_by_kind(model, ids, kinds, cfg.evaluate.window)
        cells = [math.exp(sum(nll) / sum(count))] + [math.exp(n / c) for n, c in zip(nll, count)]
        print(f"| {label} | " + " | ".join(f"{v:.1f}" for v in cells) + " |", flush=True)
    print("\ntokens scored: " + ", ".join(f"{k} {c}" for k, c in zip(KINDS, count)))


if __name__ == "__main__":
    main()
