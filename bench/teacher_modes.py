"""Cost of each DP teacher mode relative to non-private full fine-tuning, in one run.

For one GPT-2-shaped model (built in memory, seeded; no downloads) and one fixed batch of
random token ids (every row full length, so no padding), this measures the step time
(forward + backward + optimizer.step + zero_grad; median of --steps after --warmup) and
the peak memory of the training steps for:

  non-private full   plain AdamW on the mean per-sequence loss (the baseline, ratio 1.00)
  DP full ghost      ghost clipping, the project default
  DP full hooks      Opacus per-sample gradients
  DP bitfit ghost    bias terms only
  DP lora ghost      peft LoRA r=8 on the project default targets (None -> peft's ["c_attn"])
  DP full ghost, no Conv1D/LayerNorm norm samplers (pipeline.privacy not imported)

DP rows use Opacus' PrivacyEngine.make_private as pipeline/teacher.py does, with
noise_multiplier=1.0, max_grad_norm=1.0 and poisson_sampling=False (a fixed batch). lm_head
is untied in every row, the baseline included. Each mode runs in its own fresh subprocess
(`--one MODE`), so peak memory is per mode: CUDA max_memory_allocated above the memory held
before the first step, or on CPU the growth of the process' peak RSS (ru_maxrss) over the
steps. Run from the repository root:

    .venv/bin/python bench/teacher_modes.py                  # tiny preset, CPU (a few minutes)
    .venv/bin/python bench/teacher_modes.py --preset gpt2    # GPT-2 small shape, on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESETS = {
    # tiny = the project's builtin:teacher shape (configs' base_models defaults) at its physical batch
    "tiny": dict(layers=4, width=192, heads=4, vocab=4096, seq=128, batch=16, steps=5),
    "gpt2": dict(layers=12, width=768, heads=12, vocab=50257, seq=128, batch=32, steps=10),
}
MODES = {  # name: (row label, teacher mode, grad_sample_mode or None for non-private)
    "nonprivate": ("non-private full", "full", None),
    "full-ghost": ("DP full, ghost (default)", "full", "ghost"),
    "full-hooks": ("DP full, per-sample hooks", "full", "hooks"),
    "bitfit-ghost": ("DP bitfit, ghost", "bitfit", "ghost"),
    "lora-ghost": ("DP lora r=8 on c_attn, ghost", "lora", "ghost"),
    "full-ghost-nosamplers": ("DP full, ghost, no Conv1D/LayerNorm norm samplers", "full", "ghost"),
}


def quiet() -> None:
    for msg in ("Full backward hook", "Secure RNG", "Optimal order", "is_gradient_checkpointing"):
        warnings.filterwarnings("ignore", message=f".*{msg}.*")
    import transformers

    transformers.logging.set_verbosity_error()


def peak_now(device: str) -> float:
    """MiB: CUDA peak allocated since the last reset, or this process' peak RSS."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(mode: str, a: argparse.Namespace) -> None:
    """Set up one mode, then run one step per `step` line on stdin; `done` reports and exits."""
    import torch
    from opacus import PrivacyEngine
    from opacus.grad_sample import GradSampleModuleFastGradientClipping as GSM
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    from pipeline.batching import IGNORE, lm_batch
    from pipeline.config import TeacherConfig
    from pipeline.models import untie_lm_head

    quiet()
    label, teacher_mode, gsm = MODES[mode]
    if mode == "full-ghost-nosamplers":  # pipeline.teacher imports pipeline.privacy: avoid it
        assert Conv1D not in GSM.NORM_SAMPLERS, "pipeline.privacy was imported"
        prepare_trainable = per_sequence_loss = None
    else:
        from pipeline.teacher import per_sequence_loss, prepare_trainable

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=a.vocab, n_positions=max(a.seq, 1024), n_embd=a.width, n_layer=a.layers,
        n_head=a.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # deterministic steps
    )
    model = GPT2LMHeadModel(config)
    untie_lm_head(model)
    if prepare_trainable is not None:
        model = prepare_trainable(model, TeacherConfig(mode=teacher_mode, grad_sample_mode=gsm or "ghost"))
    model.to(a.device).train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
    lengths = torch.full((a.batch,), a.seq, dtype=torch.long)  # every row full: no padding
    batch = {k: v.to(a.device) for k, v in lm_batch(ids, lengths).items()}
    labels = batch.pop("labels")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    criterion = None
    if gsm is not None:
        engine = PrivacyEngine(accountant="prv", secure_mode=False)
        private = dict(
            module=model, optimizer=optimizer, noise_multiplier=1.0, max_grad_norm=1.0,
            data_loader=DataLoader(TensorDataset(ids, lengths), batch_size=a.batch),
            poisson_sampling=False, grad_sample_mode=gsm,
        )
        if gsm == "ghost":
            private["criterion"] = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
            model, optimizer, criterion, _ = engine.make_private(**private)
        else:
            model, optimizer, _ = engine.make_private(**private)

    def step() -> float:
        logits = model(**batch).logits  # (B, T, V)
        if criterion is not None:
            shifted = logits[:, :-1]
            loss = criterion(shifted.reshape(-1, shifted.shape[-1]), labels.reshape(-1), shape=shifted.shape)
        else:
            loss = per_sequence_loss(logits, labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = peak_now(a.device)  # right before the first step, after model + engine setup
    print("READY", flush=True)
    times, losses = [], []
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t0 = time.perf_counter()
        losses.append(step())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print("STEP", flush=True)
    timed = times[a.warmup:]
    print("RESULT " + json.dumps(dict(mode=mode, label=label, trainable=trainable, time=statistics.median(timed),
                                      mem=peak_now(a.device) - before, first_loss=losses[0])), flush=True)


def drive(proc: subprocess.Popen, expect: str, command: str | None = None) -> str:
    """Send `command` to a child (if any) and return its next stdout line, checked against `expect`."""
    if command:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    if not line.startswith(expect):
        proc.kill()
        proc.wait()
        proc.errfile.seek(0)
        err = (proc.errfile.read().strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(err)
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    for name in ("layers", "width", "heads", "vocab", "seq", "batch", "steps"):
        p.add_argument(f"--{name}", type=int, help="overrides the preset")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction,
                   help="keep all modes' processes alive and step them round-robin (default on CPU)")
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # child: run one mode
    a = p.parse_args()
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.warmup = max(1, a.warmup)
    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.interleave is None:
        a.interleave = a.device == "cpu"
    if a.one:
        return child(a.one, a)

    import opacus
    import torch

    shape = [f"--{k}={getattr(a, k)}" for k in ("layers", "width", "heads", "vocab", "seq", "batch", "steps")]
    t_start, procs, rows, load0 = time.time(), {}, {}, os.getloadavg()[0]

    def fail(mode: str, e: Exception) -> None:
        rows[mode] = dict(mode=mode, label=MODES[mode][0], error=str(e))
        procs.pop(mode, None)
        print(f"[{mode}] FAILED: {e}", file=sys.stderr)

    def start(mode: str) -> None:  # one child at a time: setups do not overlap
        cmd = [sys.executable, __file__, "--one", mode, "--device", a.device, "--warmup", str(a.warmup), *shape]
        errfile = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty child cannot block
        procs[mode] = subprocess.Popen(cmd, cwd=ROOT, text=True, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=errfile)
        procs[mode].errfile = errfile
        try:
            drive(procs[mode], "READY")
        except RuntimeError as e:
            fail(mode, e)

    def finish(mode: str) -> None:
        try:
            rows[mode] = json.loads(drive(procs[mode], "RESULT", "done")[len("RESULT "):])
            procs.pop(mode).wait()
            print(f"[{mode}] {rows[mode]['time']:.3f} s/step, {rows[mode]['mem']:.0f} MiB", file=sys.stderr)
        except RuntimeError as e:
            fail(mode, e)

    def steps(order: list[str], n: int) -> None:
        for i in range(n):
            for mode in order[i % len(order):] + order[: i % len(order)]:  # rotate who goes first
                if mode in procs:
                    try:
                        drive(procs[mode], "STEP", "step")
                    except RuntimeError as e:
                        fail(mode, e)

    if a.interleave:  # every mode alive at once, steps round-robin: background load hits all alike
        for mode in a.modes:
            start(mode)
        steps(a.modes, a.warmup + a.steps)
        for mode in list(procs):
            finish(mode)
    else:
        for mode in a.modes:
            start(mode)
            steps([mode], a.warmup + a.steps)
            if mode in procs:
                finish(mode)
    rows = [rows[m] for m in a.modes]

    base = next((r for r in rows if r["mode"] == "nonprivate" and "error" not in r), None)
    mem_name = "peak CUDA memory above setup" if a.device == "cuda" else "peak RSS growth"
    print(f"GPT-2 shape: {a.layers} layers, width {a.width}, {a.heads} heads, vocab {a.vocab}, "
          f"seq {a.seq}, batch {a.batch} | device {a.device}, {torch.get_num_threads()} torch threads | "
          f"torch {torch.__version__}, opacus {opacus.__version__} | load average before/after "
          f"{load0:.2f}/{os.getloadavg()[0]:.2f}")
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    print(f"Command: `{shlex.join([exe, os.path.relpath(__file__, ROOT), *sys.argv[1:]])}`\n")
    print(f"| mode | trainable params | step time (s) | time ratio vs non-private | {mem_name} (MiB) "
          f"| memory ratio vs non-private |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | – | failed: {r['error'][:80]} | – | – | – |")
            continue
        tr = f"{r['time'] / base['time']:.2f}" if base else "–"
        mr = f"{r['mem'] / base['mem']:.2f}" if base and base["mem"] > 0 else "–"
        print(f"| {r['label']} | {r['trainable']:,} | {r['time']:.3f} | {tr} | {r['mem']:.0f} | {mr} |")
    losses = sorted({round(r["first_loss"], 4) for r in rows if "error" not in r})
    print(f"\nStep = forward + backward + optimizer.step + zero_grad on one fixed batch; time is the median "
          f"of {a.steps} steps after {a.warmup} warm-up step(s). DP rows: noise_multiplier=1.0, "
          "max_grad_norm=1.0, poisson_sampling=False (fixed batch, not Poisson-sampled; privacy accounting "
          "is irrelevant here). Same seeded weights and batch in every row (first-step loss: "
          f"{', '.join(map(str, losses))}); lm_head untied in every row; dropout off.")
    if a.interleave:
        print("Timing: every mode has its own process, all alive at once and stepped round-robin (one step "
              "each in turn, rotating who goes first), so background load on the machine hits every mode "
              "alike; only one process computes at a time.")
    if a.device == "cuda":
        print("Memory: torch.cuda.max_memory_allocated during the steps minus memory_allocated right before "
              "the first step (model and engine already set up; optimizer state, activations, gradients "
              "and per-sample tensors are counted).")
    else:
        print("Memory: each mode runs in its own fresh process; the figure is ru_maxrss (peak RSS) after the "
              "timed steps minus ru_maxrss right before the first step (after model + engine setup). It is "
              "coarse: it counts optimizer state, activations and per-sample tensors, but also allocator "
              "caching and fragmentation, and it misses whatever fits under the setup's earlier peak.")
    print(f"Benchmark wall time: {time.time() - t_start:.0f} s.")


if __name__ == "__main__":
    main()
