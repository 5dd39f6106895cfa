"""Two students distilled from one synthetic set: teacher logits on the fly vs a top-k cache.

Builds, seeded and offline, a tokenizer on the public corpus (the ELTeC-eng novels in
../shared/data beside the checkout, bench/public.py: without them it exits with one line, exit
code 2, before any work) and GPT-2s of the default
`builtin:` shapes (teacher 4 x 192, student 2 x 96, BPE vocabulary 4,096, 128 positions;
random weights: timing does not depend on them), generates one synthetic set with the
teacher (`pipeline.stages.generate`), then distils two students (seeds 0 and 1) with
`pipeline.stages.distill.distill` at the default DistillConfig except epochs and batch size:

  on the fly   the teacher's forward pass at every step of every student (the default)
  cached       distill.teacher_top_k = k: the first student builds the cache, the second reuses it

Runs alternate (fly 0, cached 0, fly 1, cached 1) so background load on a shared machine
hits both alike; torch uses one thread (`--threads`), which keeps figures steadier there.
Prints, per student, the wall time of distill() (loading, cache building, training,
validation, saving) and of its training loop alone, the totals and their ratio. Run from
the repository root:

    .venv/bin/python bench/teacher_cache.py              # ~6 min on 2 CPU cores
    .venv/bin/python bench/teacher_cache.py --k 20 --samples 256 --epochs 3
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

from public import eltec  # bench/public.py: the corpus in ../shared
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=50, help="distill.teacher_top_k")
    parser.add_argument("--samples", type=int, default=512, help="synthetic samples")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    eltec()  # before any work: one line and exit 2 without ../shared
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_teacher_cache_") as work:
        _run(args, Path(work))


def _run(args: argparse.Namespace, work: Path) -> None:
    import torch

    from pipeline.config import BaseModelsConfig, DistillConfig, GenerateConfig
    from pipeline.stages.distill import distill
    from pipeline.stages.generate import generate_synthetic, read_synthetic
    from pipeline.models.base import read_public_corpus, tiny_gpt2, train_tokenizer

    torch.manual_seed(0)
    base = BaseModelsConfig(corpus=eltec(), max_corpus_chars=2_000_000)
    tok = train_tokenizer(read_public_corpus(base), base.vocab_size)
    for name, spec in (("teacher", base.teacher), ("student", base.student)):
        tiny_gpt2(spec, len(tok), base.context_length, tok.eos_token_id).save_pretrained(work / name)
        tok.save_pretrained(work / name)
    codes = work / "codes.json"
    codes.write_text('{"counts": {"Review Stars: 5.0": 3, "Review Stars: 1.0": 1}}')
    t0 = time.time()
    syn = generate_synthetic(GenerateConfig(num_samples=args.samples, batch_size=64, max_length=base.context_length),
                             teacher_dir=work / "teacher", control_codes_path=codes, ledger=[],
                             out_dir=work / "synthetic", seed=0)
    tokens = sum(len(x) for x in read_synthetic(syn.path)["token_ids"].to_pylist())
    print(f"synthetic set: {syn.n_samples} samples, {tokens} tokens ({time.time() - t0:.0f} s to generate)")

    common = dict(epochs=args.epochs, batch_size=args.batch_size, eval_every=10_000, log_every=10_000)
    modes = {"on the fly": DistillConfig(**common), f"cached k={args.k}": DistillConfig(teacher_top_k=args.k, **common)}
    wall: dict[str, list[float]] = {m: [] for m in modes}
    loop: dict[str, list[float]] = {m: [] for m in modes}
    for seed in (0, 1):
        for mode, cfg in modes.items():
            t0 = time.time()
            result = distill(cfg, synthetic_path=syn.path, teacher_dir=work / "teacher",
                             student_model=str(work / "student"), out_dir=work / f"{mode.split()[0]}_{seed}", seed=seed)
            wall[mode].append(time.time() - t0)
            loop[mode].append(result.seconds)
            print(f"  student {seed + 1}, {mode}: {wall[mode][-1]:.1f} s ({result.seconds:.1f} s training loop, "
                  f"{len(result.train_loss)} steps)")
    cache = syn.path / f"teacher_topk_k{args.k}"
    size = sum(p.stat().st_size for p in cache.iterdir()) / 2**20
    print(f"\ncache on disk: {size:.1f} MB; torch threads: {torch.get_num_threads()}")
    print("| teacher logits | student 1 (s) | student 2 (s) | both (s) | both, training loops (s) | ratio to on the fly |")
    print("|---|---:|---:|---:|---:|---:|")
    fly = sum(wall["on the fly"])
    for mode, times in wall.items():
        print(f"| {mode} | {times[0]:.1f} | {times[1]:.1f} | {sum(times):.1f} | {sum(loop[mode]):.1f} | "
              f"{sum(times) / fly:.2f} |")


if __name__ == "__main__":
    main()
