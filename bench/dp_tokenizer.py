"""The DP tokenizer (base_models.tokenizer=dp) against the public one, side by side.

For a config's private training split (its data section), the vocabulary of
`pipeline/privacy/dp_vocabulary.py` at a few (ε, k) settings against the public tokenizer the
builtin pair uses (the shipped pair's, or one trained on base_models.corpus), all at
base_models.vocab_size: the words the threshold kept, the vocabulary size reached, the seconds,
and how each tokenizer encodes the *test* split (tokens per 100 characters, and the share of
test words that are one token): aggregates of the test split, which the README lists as not
protected. The splits are written to a private temporary folder and deleted. Run from the
repository root:

    .venv/bin/python bench/dp_tokenizer.py --config configs/reference.yaml
    .venv/bin/python bench/dp_tokenizer.py --config configs/demo.yaml --epsilons 0.5 2 8 --words 16 64
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from pipeline.config import load_config
from pipeline.models.base import load_tokenizer, public_corpus, shipped_path, train_tokenizer
from pipeline.privacy.accountant import resolve_delta
from pipeline.privacy.dp_vocabulary import dp_word_counts, unit_words, weighted_words
from pipeline.records import read_split, split_key
from pipeline.stages.data import prepare_data


def encoding(tok, texts: list[str]) -> tuple[float, float]:
    """(tokens per 100 characters, share of words that are one token) over `texts`."""
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    chars = sum(len(t) for t in texts)
    words = [w for t in texts for w in unit_words(t, 10**9)]
    single = sum(len(tok(w, add_special_tokens=False)["input_ids"]) == 1 for w in words)
    return 100 * sum(map(len, ids)) / chars, single / len(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/reference.yaml")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 2.0, 8.0])
    parser.add_argument("--words", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--test-records", type=int, default=2000, help="test records encoded")
    args = parser.parse_args()
    cfg = load_config(args.config)
    work = Path(tempfile.mkdtemp(prefix="dp-tokenizer-"))  # 0700
    try:
        root = Path(cfg.run_root).resolve()
        data = prepare_data(cfg.data, work / "data", cfg.control_codes.domain, split_key(root))
        test = read_split(data.test)[1][: args.test_records]
        delta = resolve_delta(cfg.teacher.target_delta, data.n_train)
        vocab_size = cfg.base_models.vocab_size
        rows = []
        t0 = time.monotonic()
        if cfg.base_models.corpus is None:
            public, how = load_tokenizer(shipped_path("builtin:student")), "shipped pair's (public novels)"
        else:
            public, how = train_tokenizer(public_corpus(cfg.base_models)[0], vocab_size), "public corpus"
        rows.append(("public", how, "-", len(public), time.monotonic() - t0, *encoding(public, test)))
        for eps in args.epsilons:
            for k in args.words:
                t0 = time.monotonic()
                words, entry = dp_word_counts(data.train, epsilon=eps, max_words=k, delta=delta,
                                              accountant=cfg.teacher.accountant)
                tok = train_tokenizer(weighted_words(words), vocab_size)
                rows.append((f"dp ε={eps:g} k={k}", f"σ={entry.noise_multiplier:.3g}·√k", len(words), len(tok),
                             time.monotonic() - t0, *encoding(tok, test)))
        print(f"{args.config}: N = {data.n_train} training records, δ = {delta:.3g} (+ the threshold's δ, the same), "
              f"vocabulary size asked {vocab_size}; test: {len(test)} records")
        print(f"{'tokenizer':<18} {'noise':<16} {'kept words':>10} {'vocabulary':>10} {'seconds':>8} "
              f"{'tokens/100 chars':>16} {'one-token words':>15}")
        for name, how, kept, size, seconds, per_100, single in rows:
            print(f"{name:<18} {how if name != 'public' else '-':<16} {kept!s:>10} {size:>10} {seconds:>8.1f} "
                  f"{per_100:>16.2f} {single:>15.3f}")
        print(f"public: {rows[0][1]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
