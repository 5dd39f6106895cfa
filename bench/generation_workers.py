"""Generation throughput with 1 worker (in-process) vs N local Dask worker processes.

A tiny GPT-2 (built in memory, seeded; no downloads) generates the same synthetic set through
flows.generation.generate_with_workers inside a Prefect flow (a throwaway test server):
in-process with torch's default thread count, in-process with 1 torch thread (what each
Dask worker uses), and with each `--workers` count > 1, alternating for `--repeats` rounds
so background load hits each alike. Printed per run: wall seconds of the whole call (cluster
start and model loads included), new tokens per wall second and its ratio to the in-process
1-thread run of the same round, new tokens per second of shard time per process (the rate
while generating, start-up left out), and whether the shards equal the first run's.

Needs the ELTeC-eng novels in ../shared/data beside the checkout (bench/public.py); without
them it exits with one line (exit code 2) before any work. Run from the repository root:

    .venv/bin/python bench/generation_workers.py                 # ~5 min on 2 busy cores
    .venv/bin/python bench/generation_workers.py --samples 4096 --shard-size 256 --repeats 1 --skip-default-threads
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from public import eltec  # bench/public.py: the corpus in ../shared
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _setup(tmp: Path, layers: int, width: int) -> tuple[Path, Path]:
    import torch

    from pipeline.config import BaseModelsConfig, TinyModelSpec
    from pipeline.models.base import read_public_corpus, tiny_gpt2, train_tokenizer

    corpus = eltec()
    tok = train_tokenizer(read_public_corpus(BaseModelsConfig(corpus=corpus, max_corpus_chars=200_000)), 300)
    torch.manual_seed(0)
    model = tiny_gpt2(TinyModelSpec(n_layer=layers, n_embd=width, n_head=4), len(tok), 128, tok.eos_token_id)
    model.save_pretrained(tmp / "teacher")
    tok.save_pretrained(tmp / "teacher")
    codes = tmp / "control_codes.json"
    counts = {f"Category: {c}\tStars: {s}": 1 + (i * 7 + s) % 5 for i, c in enumerate("ABCDEFGH") for s in range(1, 6)}
    codes.write_text(json.dumps({"columns": ["label1", "label2"], "private": False, "note": "", "counts": counts}))
    return tmp / "teacher", codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2], help="worker counts > 1 to compare")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-default-threads", action="store_true",
                    help="leave out the in-process run with torch's default thread count (slow on busy cores)")
    args = ap.parse_args()
    eltec()  # before any work: one line and exit 2 without ../shared

    import torch
    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from flows.generation import generate_with_workers
    from pipeline.config import GenerateConfig
    from pipeline.stages.generate import read_synthetic

    @flow(name="bench-generation", persist_result=False, validate_parameters=False)
    def run(cfg: GenerateConfig, teacher: Path, codes: Path, out: Path):
        return generate_with_workers(cfg, teacher_dir=teacher, control_codes_path=codes, ledger=[], out_dir=out, seed=0)

    tmp = Path(tempfile.mkdtemp(prefix="bench-generation-"))
    teacher, codes = _setup(tmp, args.layers, args.width)
    print(f"{args.samples} samples in shards of {args.shard_size}, max_length {args.max_length}, "
          f"GPT-2 {args.layers} layers x {args.width}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    default_threads = torch.get_num_threads()
    runs = [("1 in-process", 1, 1)] + ([] if args.skip_default_threads else [("1 in-process", 1, default_threads)])
    runs += [(f"{w} Dask workers", w, 1) for w in args.workers if w > 1]
    rows, reference = [], None
    with prefect_test_harness(server_startup_timeout=120):
        for r in range(args.repeats):
            for i, (name, w, threads) in enumerate(runs):
                cfg = GenerateConfig(num_samples=args.samples, shard_size=args.shard_size, batch_size=32,
                                     max_length=args.max_length, workers=w)
                out = tmp / f"r{r}-{i}"
                torch.set_num_threads(threads)  # in this process; each Dask worker sets 1 itself
                t0 = time.perf_counter()
                res = run(cfg, teacher, codes, out)
                wall = time.perf_counter() - t0
                torch.set_num_threads(default_threads)
                manifest = json.loads((out / "manifest.json").read_text())
                table = read_synthetic(out)
                reference = table if reference is None else reference
                rows.append(dict(round=r, run=i, name=name, threads=threads, wall=wall, tokens=manifest["new_tokens"],
                                 tps=res.tokens_per_second, same=table.equals(reference),
                                 shard_tps=manifest["new_tokens"] / (manifest["seconds"] / manifest["processes"]),
                                 processes=manifest["processes"], load=os.getloadavg()[0]))
    base = {r["round"]: r["tps"] for r in rows if r["run"] == 0}
    print(f"{'round':>5} {'generation':<16} {'torch threads':>13} {'procs':>5} {'wall s':>7} {'new tokens':>10} "
          f"{'tokens/s':>9} {'ratio':>6} {'generating':>10} {'same shards':>11} {'load':>5}")
    for r in rows:
        print(f"{r['round']:>5} {r['name']:<16} {r['threads']:>13} {r['processes']:>5} {r['wall']:>7.1f} "
              f"{r['tokens']:>10} {r['tps']:>9.0f} {r['tps'] / base[r['round']]:>6.2f} {r['shard_tps']:>10.0f} "
              f"{'yes' if r['same'] else 'NO':>11} {r['load']:>5.1f}")
    for i, (name, _, threads) in enumerate(runs):
        ratios = [r["tps"] / base[r["round"]] for r in rows if r["run"] == i]
        print(f"{name}, {threads} torch thread(s): median tokens/s ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":  # Dask spawns its worker processes: keep the work behind this guard
    main()
