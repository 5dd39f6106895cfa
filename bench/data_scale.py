"""Benchmark: the teacher's data setup at scale, today's path and the Arrow path side by side.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/data_scale.py --records 100000

Builds N records by repeating the shipped Yelp sample (configs/demo.yaml data.path), runs the
data stage once, then the teacher's data setup (no model, no training) twice, each in its
own subprocess so that each peak RSS is its own:
- `list` (the path before issue 11): every record `encode_record`ed into a Python list, then
  a dense (N, max_length) int64 `TokenizedRecords` tensor;
- `arrow`: `tokenized_split` (the split streamed through the tokenizer into list<int32> ids in
  a 0600 file of the run directory) opened memory-mapped as `TokenIds`, one padded batch drawn.
Peak RSS is ru_maxrss minus the RSS just before the data setup (tokenizer loaded, imports
done). The tokenizer is the demo's kind: byte-level BPE, 4096 tokens, trained on the public
WikiText sample. The last line is the Arrow path's figures:
`records=N tokenize_s=S peak_rss_mb=M bytes_per_record=B` (bytes per training record tokenized).
`--only arrow` skips today's path (slow at 1M records: about 1 ms a record).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from public import eltec  # bench/public.py: the corpus in ../shared
ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "yelp_sample" / "train.csv"
MAX_LENGTH = 128  # the demo teacher's context


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _setup(path: str, train: str, tokenizer_dir: str) -> dict:
    """One data setup in this (fresh) process; returns seconds and RSS figures."""
    # Every import before the baseline: the figures are the data's, not the libraries'.
    from pipeline.batching import TokenizedRecords
    from pipeline.stages.data import encode_record, read_split, read_users
    from pipeline.models.base import load_tokenizer
    from pipeline.tokenized import TokenIds, token_column, tokenized_split

    tok = load_tokenizer(tokenizer_dir)
    baseline = _rss_mb()
    t0 = time.perf_counter()
    if path == "list":
        codes, texts = read_split(train)
        users = read_users(train)
        records = TokenizedRecords([encode_record(tok, c, t, MAX_LENGTH) for c, t in zip(codes, texts)],
                                   tok.pad_token_id, MAX_LENGTH)
        del codes, texts
        n = len(records)
    else:
        users = read_users(train)
        records = TokenIds(token_column(tokenized_split(Path(train), tok)), MAX_LENGTH,
                           tok.pad_token_id)
        ids, _ = records.collate([records[i] for i in range(0, len(records), max(1, len(records) // 128))])
        n = len(records)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return {"path": path, "records": n, "users": users is not None, "seconds": seconds,
            "baseline_mb": baseline, "peak_mb": peak, "peak_above_baseline_mb": peak - baseline,
            "rss_after_mb": _rss_mb()}


def _in_subprocess(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, stdout=subprocess.PIPE, text=True,
                         cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _data_stage(source: Path, out: Path) -> dict:
    from pipeline.config import DataConfig
    from pipeline.stages.data import prepare_data

    t0 = time.perf_counter()
    result = prepare_data(DataConfig(path=source, validation_fraction=0.05, test_fraction=0.01), out, seed=0)
    return {"seconds": time.perf_counter() - t0, "train": str(result.train), "n_train": result.n_train,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--only", choices=["arrow", "list"], help="run one path only")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "data":
            print(json.dumps(_data_stage(Path(rest[0]), Path(rest[1]))))
        else:
            print(json.dumps(_setup(kind, *rest)))
        return

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.config import BaseModelsConfig
    from pipeline.stages.data import read_table
    from pipeline.models.base import read_public_corpus, train_tokenizer

    with tempfile.TemporaryDirectory(prefix="data_scale-") as tmp:
        tmp = Path(tmp)
        sample = read_table(SAMPLE)
        reps = -(-args.records // sample.num_rows)
        pq.write_table(pa.concat_tables([sample] * reps).slice(0, args.records), tmp / "records.parquet")
        corpus = read_public_corpus(BaseModelsConfig(corpus=eltec(), max_corpus_chars=3_000_000))
        train_tokenizer(corpus, vocab_size=4096).save_pretrained(tmp / "tokenizer")

        data = _in_subprocess("data", str(tmp / "records.parquet"), str(tmp / "run" / "data"))
        print(f"data stage: {data['n_train']} training records in {data['seconds']:.1f} s, "
              f"peak RSS {data['peak_mb']:.0f} MB (the same for both paths)")
        results = {}
        for path in ("list", "arrow"):
            if args.only and path != args.only:
                continue
            results[path] = r = _in_subprocess(path, data["train"], str(tmp / "tokenizer"))
            print(f"{path:>5}: {r['seconds']:.1f} s ({r['records'] / r['seconds']:.0f} records/s), peak RSS "
                  f"{r['peak_above_baseline_mb']:.0f} MB above a {r['baseline_mb']:.0f} MB baseline "
                  f"({r['peak_above_baseline_mb'] * 2**20 / r['records']:.0f} bytes/record)")
        if len(results) == 2:
            old, new = results["list"], results["arrow"]
            print(f"arrow / list: {old['seconds'] / new['seconds']:.2f}x the throughput, "
                  f"{new['peak_above_baseline_mb'] / old['peak_above_baseline_mb']:.2f}x the peak RSS")
        arrow = results.get("arrow")
        if arrow:
            ids_bytes = sum(f.stat().st_size for f in (tmp / "run" / "data" / "tokenized").rglob("*.arrow"))
            print(f"tokenized train ids on disk: {ids_bytes / data['n_train']:.0f} bytes/record")
            print(f"records={args.records} tokenize_s={arrow['seconds']:.1f} "
                  f"peak_rss_mb={arrow['peak_above_baseline_mb']:.0f} "
                  f"bytes_per_record={arrow['peak_above_baseline_mb'] * 2**20 / arrow['records']:.0f}")


if __name__ == "__main__":
    main()
