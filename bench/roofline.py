"""How close each stage's step runs to this machine's matrix-multiply speed (issue 22).

For the builtin teacher (4 x 256, vocabulary 8,192) at the demo's shapes, each row times one
step as the pipeline runs it and, beside it, the same step's matrix multiplies alone: every
Linear/Conv1D product of the forward (and, for training, the backward's two products per
weight), the attention's batched products and the vocabulary projection, each timed on its own
as a bare `torch.mm`/`torch.bmm` of the step's shapes, summed. That sum is what the step would
cost if nothing but its arithmetic took time; `step / matmuls` is how far the step is from it
(1.0: nothing left to remove but arithmetic; a step with less work, not a faster one, is then
the only way down).

  teacher, non-private   AdamW step of per-sequence CE, 32 x 128 tokens (the demo's physical batch)
  teacher, DP (bk)       the same batch through the book-keeping engine (pipeline/privacy/bk.py):
                         one backward, per-example norms, clipped sum, noise (noise_multiplier 1);
                         its matmuls include the per-example norms' products
  evaluation forward     16 windows of 128 tokens, logits and their CE (evaluate.batch_size)
  generation step        one decode step of the fast engine (pipeline/models/decoding.py) on 64
                         and on 256 rows (generate.batch_size, shipped and default) at 64 cached
                         positions: the 4 blocks for one token a row, the vocabulary projection
                         and top-k/top-p sampling

Same process, the run's threads (torch's default unless OMP_NUM_THREADS/--threads), the
allocator as every stage sets it; medians of `--repeats` timed calls after one warm-up.

    .venv/bin/python bench/roofline.py          # ~1 min on 2 cores

Last line: `teacher_np=R1 teacher_bk=R2 evaluation=R3 generation=R4 generation256=R5` (step / matmuls
each). A stage sped up Sx whose step runs at R of its matmuls would reach at most S·R by removing
all but its arithmetic (generation: bench/pipeline_speed.py's generation_x times generation256).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEACHER = ROOT / "pipeline" / "models" / "builtin" / "teacher"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: allocation, lazy initialisation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_seconds(cfg, rows: int, batch: int, span: int, train: bool, repeats: int,
                   norms: bool = False) -> tuple[float, float]:
    """Seconds of the step's matrix products alone, and their GFLOP: the blocks' weights on
    `rows` tokens, attention over `span` keys for `batch` sequences of rows/batch queries, the
    vocabulary projection; with `train`, each weight product's two backward products too; with
    `norms`, book-keeping's per-example gradient norms of every weight (pipeline/privacy/bk.py:
    the ghost products aᵢaᵢᵀ and gᵢgᵢᵀ where 2T² < in·out, else each aᵢᵀgᵢ)."""
    import torch

    d, layers, vocab, heads = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.n_head
    queries = rows // batch
    mms = [(rows, d, 3 * d), (rows, d, d), (rows, d, 4 * d), (rows, 4 * d, d)] * layers + [(rows, d, vocab)]
    if train:  # grad of the input (rows, out) x (out, in) and of the weight (in, rows) x (rows, out)
        mms += [(m, o, i) for m, i, o in mms] + [(i, m, o) for m, i, o in mms]
    # attention: scores (B·H, q, hd) x (B·H, hd, span), then (B·H, q, span) x (B·H, span, hd); backward 2 each
    bmms = [(batch * heads, queries, d // heads, span), (batch * heads, queries, span, d // heads)] * layers
    if train:
        bmms = bmms * 3
    if norms:
        for m, i, o in [(rows, d, 3 * d), (rows, d, d), (rows, d, 4 * d), (rows, 4 * d, d)] * layers + [(rows, d, vocab)]:
            if 2 * queries**2 < i * o:  # (B, T, in) x (B, in, T) and (B, T, out) x (B, out, T)
                bmms += [(batch, queries, i, queries), (batch, queries, o, queries)]
            else:  # (B, in, T) x (B, T, out)
                bmms += [(batch, i, queries, o)]
    seconds = flops = 0.0
    for m, k, n in mms:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds += timed(lambda: torch.mm(a, b), repeats)
        flops += 2 * m * k * n
    for bh, m, k, n in bmms:
        a, b = torch.randn(bh, m, k), torch.randn(bh, k, n)
        seconds += timed(lambda: torch.bmm(a, b), repeats)
        flops += 2 * bh * m * k * n
    return seconds, flops / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch threads (default: the run's, pipeline.devices)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    from pipeline.batching import lm_batch
    from pipeline.devices import Runtime
    from pipeline.models import decoding
    from pipeline.models.base import load_causal_lm, untie_lm_head
    from pipeline.models.scoring import nll_by_owner
    from pipeline.privacy.bk import BookKeepingPrivacyEngine
    from pipeline.models.losses import per_sequence_loss
    from pipeline.tokenized import ListIds

    transformers.logging.set_verbosity_error()
    threads = Runtime(threads=a.threads).apply_threads()
    torch.manual_seed(0)
    model = load_causal_lm(str(TEACHER))
    cfg = model.config
    rows = []

    def row(name: str, step_s: float, rows_: int, batch: int, span: int, train: bool, norms: bool = False) -> None:
        mm_s, gflop = matmul_seconds(cfg, rows_, batch, span, train, a.repeats, norms)
        rows.append((name, step_s, mm_s, gflop))
        print(f"[{name}] step {step_s * 1e3:.1f} ms, its matmuls alone {mm_s * 1e3:.1f} ms "
              f"({gflop / mm_s:.0f} GFLOP/s), ratio {step_s / mm_s:.2f}", file=sys.stderr, flush=True)

    ids = torch.randint(0, cfg.vocab_size, (32, 128), generator=torch.Generator().manual_seed(1))
    batch = lm_batch(ids, torch.full((32,), 128))
    labels = batch.pop("labels")
    for private in (False, True):
        net = load_causal_lm(str(TEACHER))
        untie_lm_head(net)  # as the teacher stage trains it
        net.train()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
        if private:
            from torch.utils.data import DataLoader, TensorDataset

            engine = BookKeepingPrivacyEngine(accountant="prv", secure_mode=False)
            net, optimizer, _ = engine.make_private(
                module=net, optimizer=optimizer, noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="bk",
                data_loader=DataLoader(TensorDataset(ids), batch_size=32), poisson_sampling=False)

        def train_step(net=net, optimizer=optimizer, private=private):
            loss = per_sequence_loss(net(**batch).logits, labels)
            if private:
                net.backward_clipped(loss)
            else:
                loss.mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        row("teacher DP (bk)" if private else "teacher non-private", timed(train_step, a.repeats), 32 * 128, 32,
            128, True, norms=private)

    windows = ListIds(ids[:16].tolist(), 0)
    model.eval()
    row("evaluation forward", timed(lambda: nll_by_owner(model, windows, [0] * 16, 1, 16), a.repeats), 16 * 128, 16,
        128, False)

    for n in (64, 256):  # generate.batch_size: the shipped 64, the default since 2026-11-24
        slots = decoding._empty_slots(model, n, 128)
        slots.tokens.random_(0, cfg.vocab_size)
        slots.limit.fill_(128)
        slots.sample = list(range(n))

        def decode_step(slots=slots):
            slots.fed.fill_(64)
            slots.n_tokens.fill_(65)
            with torch.no_grad():
                decoding._step(model, slots, eos=-1, top_k=50, top_p=0.9, temperature=1.0, no_repeat_ngram_size=0)

        row(f"generation step, {n} rows", timed(decode_step, a.repeats * 4), n, n, 65, False)

    print(f"Builtin teacher ({cfg.n_layer} x {cfg.n_embd}, vocabulary {cfg.vocab_size}), fp32, {threads} torch "
          f"thread(s), torch {torch.__version__}\n")
    print("| step | step (ms) | its matmuls alone (ms) | GFLOP | matmul GFLOP/s | step / matmuls |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, step_s, mm_s, gflop in rows:
        print(f"| {name} | {step_s * 1e3:.1f} | {mm_s * 1e3:.1f} | {gflop:.2f} | {gflop / mm_s:.0f} | "
              f"{step_s / mm_s:.2f} |")
    keys = ("teacher_np", "teacher_bk", "evaluation", "generation", "generation256")
    print(" ".join(f"{k}={step_s / mm_s:.2f}" for k, (_, step_s, mm_s, _) in zip(keys, rows)))

if __name__ == "__main__":
    main()
