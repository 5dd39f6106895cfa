"""Benchmark: the teacher's data setup at scale, today's path and the Arrow path side by side.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/data_scale.py --records 100000

Builds N records by repeating the shipped Yelp sample (configs/demo.yaml data.path), runs the
data stage once, then the teacher's data setup (no model, no training) twice, each in its
own subprocess so that each peak RSS is its own:
- `list` (the path before issue 11): every record `encode_record`ed into a Python list, then
  a dense (N, max_length) int64 `TokenizedRecords` tensor;
- `arrow`: `tokenized_split` (the split streamed through the tokenizer into list<int32> ids in
  a 0600 file of the run directory) opened memory-mapped as `TokenIds`, one padded batch drawn.
Peak RSS is VmHWM minus the RSS just before the data setup (tokenizer loaded, imports
done). The tokenizer is the demo's kind: byte-level BPE, 4096 tokens, trained on the ELTeC-eng
novels in ../shared/data beside the checkout (bench/public.py; without them, and without
`--only data`, it exits with one line, exit code 2, before any work). The last line is the Arrow path's figures:
`records=N prepare_peak_rss_mb=P prepare_s=D tokenize_s=S peak_rss_mb=M bytes_per_record=B` (the data
stage's whole peak RSS and seconds; the tokenization's peak above its baseline, and that peak per
training record tokenized).
`--only arrow` skips today's path (slow at 1M records: about 1 ms a record); above 1M records it
is skipped unless `--only list` asks for it (~7 KB a record: ~70 GB at 10M).
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
LIST_LIMIT = 1_000_000  # records above which today's path is skipped by default


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux keeps that across exec, so a child
    forked from this benchmark's big parent would report the parent's size at the fork."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _setup(path: str, train: str, tokenizer_dir: str) -> dict:
    """One data setup in this (fresh) process; returns seconds and RSS figures."""
    # Every import before the baseline: the figures are the data's, not the libraries'.
    from pipeline.batching import TokenizedRecords
    from pipeline.records import encode_record, read_split, read_users
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
    peak = _peak_mb()
    return {"path": path, "records": n, "users": users is not None, "seconds": seconds,
            "baseline_mb": baseline, "peak_mb": peak, "peak_above_baseline_mb": peak - baseline,
            "rss_after_mb": _rss_mb()}


def _in_subprocess(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, stdout=subprocess.PIPE, text=True,
                         cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _data_stage(source: Path, out: Path) -> dict:
    from pipeline.config import DataConfig
    from pipeline.records import split_key
    from pipeline.stages.data import prepare_data

    key = split_key(out.parent)
    baseline = _rss_mb()
    t0 = time.perf_counter()
    result = prepare_data(DataConfig(path=source, validation_fraction=0.05, test_fraction=0.01), out, key=key)
    return {"seconds": time.perf_counter() - t0, "train": str(result.train), "n_train": result.n_train,
            "peak_mb": _peak_mb(), "baseline_mb": baseline}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--only", choices=["arrow", "list", "data"], help="run one path only (data: the data stage alone)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "data":
            print(json.dumps(_data_stage(Path(rest[0]), Path(rest[1]))))
        else:
            print(json.dumps(_setup(kind, *rest)))
        return
    if args.only != "data":
        eltec()  # before any work: one line and exit 2 without ../shared

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.config import BaseModelsConfig
    from pipeline.records import read_table
    from pipeline.models.base import read_public_corpus, train_tokenizer

    with tempfile.TemporaryDirectory(prefix="data_scale-") as tmp:
        tmp = Path(tmp)
        sample = read_table(SAMPLE)
        reps = -(-args.records // sample.num_rows)
        # Row groups of 64k records, as the stage writes its splits: a Parquet input is decoded a row
        # group at a time, so its row groups bound the stage's memory (1M-record groups add ~300 MB).
        pq.write_table(pa.concat_tables([sample] * reps).slice(0, args.records), tmp / "records.parquet",
                       row_group_size=65_536)
        if args.only != "data":
            corpus = read_public_corpus(BaseModelsConfig(corpus=eltec(), max_corpus_chars=3_000_000))
            train_tokenizer(corpus, vocab_size=4096).save_pretrained(tmp / "tokenizer")

        started = time.perf_counter()
        data = _in_subprocess("data", str(tmp / "records.parquet"), str(tmp / "run" / "data"))
        print(f"data stage: {data['n_train']} training records in {data['seconds']:.1f} s, "
              f"peak RSS {data['peak_mb']:.0f} MB ({data['peak_mb'] - data['baseline_mb']:.0f} MB above the "
              f"{data['baseline_mb']:.0f} MB of its imports; the same for both paths)")
        results = {}
        for path in ("list", "arrow"):
            if args.only and path != args.only:
                continue
            if path == "list" and args.only is None and args.records > LIST_LIMIT:
                print(f" list: skipped above {LIST_LIMIT:,} records (~7 KB a record; --only list runs it)")
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
        if args.only == "data":
            print(f"records={args.records} prepare_peak_rss_mb={data['peak_mb']:.0f} prepare_s={data['seconds']:.1f}")
        if arrow:
            ids_bytes = sum(f.stat().st_size for f in (tmp / "run" / "data" / "tokenized").rglob("*.arrow"))
            print(f"tokenized train ids on disk: {ids_bytes / data['n_train']:.0f} bytes/record")
            print(f"whole run (data stage and the paths, input and tokenizer excluded): "
                  f"{time.perf_counter() - started:.0f} s")
            print(f"records={args.records} prepare_peak_rss_mb={data['peak_mb']:.0f} "
                  f"prepare_s={data['seconds']:.1f} tokenize_s={arrow['seconds']:.1f} "
                  f"peak_rss_mb={arrow['peak_above_baseline_mb']:.0f} "
                  f"bytes_per_record={arrow['peak_above_baseline_mb'] * 2**20 / arrow['records']:.0f}")


if __name__ == "__main__":
    main()
