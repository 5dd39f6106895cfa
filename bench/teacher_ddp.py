"""Wall time of the DP teacher stage in 1 process vs N data-parallel processes (DPDDP, gloo).

The real `train_teacher` runs on the same config, seed and data: with teacher.processes=1 at
torch's default thread count, with processes=1 on one thread, and with processes=N (torchrun,
gloo, CPU; `train_teacher` gives each process cpu_count / N threads, as torchrun would give 1
by default). The two single-process rows separate the gain of data parallelism from that of
avoiding thread oversubscription on a busy machine. It reports for each: the stage's wall
time (N processes: torchrun start, imports, σ calibration and validation included) and the
training loop's time per logical step, from the first to the last step record `on_progress`
received (N processes: relayed by polling rank 0's records every 0.5 s, so ±0.5 s over the
span). It checks that ε, σ, q and steps agree and prints how far the weights are apart.
Model: a GPT-2 built in memory (no downloads) with a 1,000-token tokenizer trained on the
ELTeC-eng novels in ../shared/data beside the checkout (bench/public.py: without them it exits
with one line, exit code 2, before any work). Run from the repository root:

    .venv/bin/python bench/teacher_ddp.py                  # 2 processes, ~4 min on 2 busy cores
    .venv/bin/python bench/teacher_ddp.py --processes 4 --records 1400 --layers 4 --width 192
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from public import eltec  # bench/public.py: the corpus in ../shared
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(cfg, splits, model_dir: Path, out: Path, threads: int) -> dict:
    import torch

    from pipeline.stages.teacher.recipe import train_teacher

    stamps: list[float] = []
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # this process only; data-parallel workers set their own
    t0 = time.perf_counter()
    try:
        result = train_teacher(cfg, train_path=splits.train, validation_path=splits.validation,
                               base_model=str(model_dir), out_dir=out, seed=0,
                               on_progress=lambda record: stamps.append(time.perf_counter()))
    finally:
        torch.set_num_threads(default_threads)
    wall = time.perf_counter() - t0
    per_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return {"result": result, "wall": wall, "per_step": per_step, "steps": len(stamps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--records", type=int, default=600, help="private training records (Yelp sample)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--physical-batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=96)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--grad-sample-mode", default="ghost", choices=["ghost", "hooks"])
    a = p.parse_args()
    eltec()  # before any work: one line and exit 2 without ../shared
    for msg in ("Full backward hook", "Secure RNG", "Optimal order"):
        warnings.filterwarnings("ignore", message=f".*{msg}.*")
    logging.basicConfig(level=logging.WARNING)

    import torch
    import transformers
    from safetensors.torch import load_file

    from pipeline.config import BaseModelsConfig, DataConfig, TeacherConfig, TinyModelSpec
    from pipeline.stages.data import prepare_data
    from pipeline.models.base import read_public_corpus, tiny_gpt2, train_tokenizer

    transformers.logging.set_verbosity_error()
    data = ROOT / "data"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = BaseModelsConfig(corpus=eltec(), max_corpus_chars=300_000)
        tok = train_tokenizer(read_public_corpus(corpus), vocab_size=1000)
        torch.manual_seed(0)
        spec = TinyModelSpec(n_layer=a.layers, n_embd=a.width, n_head=4)
        model_dir = tmp / "base"
        tiny_gpt2(spec, len(tok), 128, tok.eos_token_id).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        splits = prepare_data(DataConfig(path=data / "yelp_sample" / "train.csv",
                                         test_path=data / "yelp_sample" / "test.csv", max_records=a.records,
                                         max_test_records=50, validation_fraction=0.05), tmp / "data")
        cfg = TeacherConfig(target_epsilon=3.0, epochs=a.epochs, batch_size=a.batch_size,
                            physical_batch_size=a.physical_batch_size, max_length=a.max_length,
                            learning_rate=1e-3, accountant="rdp", grad_sample_mode=a.grad_sample_mode)
        threads = torch.get_num_threads()
        per_process = max(1, (os.cpu_count() or 1) // a.processes)
        plan = {  # label: (processes, threads per process)
            f"1 process x {threads} threads (torch default)": (1, threads),
            "1 process x 1 thread": (1, 1),
            f"{a.processes} processes x {per_process} thread(s), gloo": (a.processes, per_process),
        }
        rows = {label: run(cfg.model_copy(update={"processes": n}), splits, model_dir, tmp / f"run{i}", t)
                for i, (label, (n, t)) in enumerate(plan.items())}
        one, many = list(rows.values())[0], list(rows.values())[-1]
        l1, ln = one["result"].ledger, many["result"].ledger
        same = (l1.epsilon, l1.noise_multiplier, l1.sample_rate, l1.steps) == (
            ln.epsilon, ln.noise_multiplier, ln.sample_rate, ln.steps)
        w1 = load_file(one["result"].checkpoint / "model.safetensors")
        wn = load_file(many["result"].checkpoint / "model.safetensors")
        gap = max((w1[k] - wn[k]).abs().max().item() for k in w1)

    print(f"\nDP teacher, {a.layers} layers x {a.width} wide, vocab {len(tok)}, N={splits.n_train} records, "
          f"batch {a.batch_size} (physical {a.physical_batch_size}), max_length {a.max_length}, "
          f"{a.grad_sample_mode} clipping, {l1.steps} steps, CPU ({os.cpu_count()} cores)")
    print("| run | stage wall time (s) | s per logical step | step time / first row |")
    print("|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['wall']:.1f} | {r['per_step']:.2f} | {r['per_step'] / one['per_step']:.2f} |")
    print(f"ledger (ε, σ, q, steps) identical: {same}  (ε={ln.epsilon:.4f}, σ={ln.noise_multiplier:.4f}, "
          f"q={ln.sample_rate:.4g}, steps={ln.steps}); max |weight difference| = {gap:.2e}")


if __name__ == "__main__":
    main()
