"""Step time and peak memory of each DP teacher mode relative to non-private full fine-tuning.

One model (GPT-2-shaped, or with `--arch llama` Llama-shaped, e.g. the smollm2-135m preset;
built in memory, seeded; no downloads), one fixed batch of random
token ids (every row full length: no padding), and for each mode the median time of a
training step (forward + backward + optimizer.step + zero_grad) after warm-up, and the peak
memory the steps add:

  non-private full   plain AdamW on the mean per-sequence loss: the baseline, ratio 1.00
  DP full, bk        book-keeping clipping (pipeline/privacy/bk.py), one backward: the project default
  DP full, bk, fp32 factors  the same with bf16 layers' factors upcast and multiplied in fp32, as on a CPU
  DP full, bk, Opacus' noise draw  the same noise drawn whole into a new tensor and added (Opacus'
                     `_generate_noise`), not added in place chunk by chunk (pipeline/privacy/noise.py add_gaussian_)
  DP full, ghost     Opacus ghost clipping, two backward passes
  DP full, hooks     Opacus per-sample gradients
  DP bitfit, ghost   bias terms only
  DP lora, ghost     LoRA r=8 on the project default targets (None: peft's, ["c_attn"] for GPT-2)
  DP full, ghost without pipeline.privacy.accountant's Conv1D/LayerNorm norm samplers (never imported there)

DP rows call PrivacyEngine.make_private as pipeline/stages/teacher/recipe.py does (pipeline/privacy/bk.py's engine, Opacus' plus mode bk;
its secret noise generator), with noise_multiplier=1.0,
max_grad_norm=1.0 and poisson_sampling=False (a fixed batch). lm_head is untied in every row
(`--tied`: tied in every row, as teacher.untie_lm_head=false trains it).
Each mode runs in its own fresh process (`--one MODE`); memory is CUDA max_memory_allocated
above what was allocated before the first step, or on CPU the growth of the process' peak RSS
(ru_maxrss) over the steps; on CPU also, from torch.profiler's allocation records, the peak of
live tensor bytes in one more step (exact for tensors, blind to allocator caching). On CPU all
processes stay alive and are stepped round-robin, one at a time, so background load hits every
mode alike. Run from the repository root:

    .venv/bin/python bench/teacher_modes.py                  # tiny preset, CPU: ~1.5 min on 2 cores
    .venv/bin/python bench/teacher_modes.py --preset gpt2-cpu --modes nonprivate full-hooks full-ghost full-bk
                                                              # GPT-2 small shape, batch 4, on CPU: ~20 min
    .venv/bin/python bench/teacher_modes.py --preset gpt2    # GPT-2 small shape, batch 32, on a GPU
    .venv/bin/python bench/teacher_modes.py --preset smollm2-135m --modes nonprivate full-bk --accumulate 2
                                                              # SmolLM2-135M's shape (Llama), 2 x 8 x 64, on CPU: 11 min on 2 busy cores

`--profile DIR` profiles one more step of each mode into DIR/<mode>.txt: the step's wall against
its operators' host time and, on CUDA, the GPU's kernel time (a step whose kernels fill a small
part of its wall waits on the host), and the top operators by each.

Its last line, when bk ran beside non-private: `mode=bk time_ratio=X memory_ratio=Y` (memory:
tensor peak on CPU, CUDA peak on a GPU), with `--accumulate K` > 1 also `pass_ratio=P`: one
physical batch's forward, backward and clipping, the optimizer's step and noise left out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESETS = {  # tiny: BaseModelsConfig's default builtin:teacher shape, at the default physical batch
    "tiny": dict(layers=4, width=192, heads=4, vocab=4096, seq=128, batch=16, steps=8),
    "gpt2": dict(layers=12, width=768, heads=12, vocab=50257, seq=128, batch=32, steps=10),
    # GPT-2 small's shape at a batch a CPU steps in seconds (issue 13's measurement)
    "gpt2-cpu": dict(layers=12, width=768, heads=12, vocab=50257, seq=128, batch=4, steps=5),
    # SmolLM2-135M's shape (issue 35): a Llama with grouped-query attention, RMSNorm, a gated MLP
    # and a tied embedding (untied here, as the pipeline unties it for DP: +28M parameters)
    "smollm2-135m": dict(arch="llama", layers=30, width=576, heads=9, kv_heads=3, mlp=1536, vocab=49152,
                         seq=64, batch=8, steps=5),
}
SHAPE = ("layers", "width", "heads", "kv_heads", "mlp", "vocab", "seq", "batch", "steps")
MODES = {  # name: (row label, teacher mode, grad_sample_mode; None = non-private)
    "nonprivate": ("non-private full", "full", None),
    "full-ghost": ("DP full, ghost (Opacus, two backward passes)", "full", "ghost"),
    "full-hooks": ("DP full, per-sample hooks", "full", "hooks"),
    "full-bk": ("DP full, book-keeping (default, one backward)", "full", "bk"),
    # bk as on a CPU: layers run in bf16 upcast their factors and bk multiplies them in fp32
    "full-bk-fp32": ("DP full, book-keeping, fp32 factors", "full", "bk"),
    "full-bk-opacus-noise": ("DP full, book-keeping, Opacus' noise draw", "full", "bk"),
    "full-bk-one-stream": ("DP full, book-keeping, noise in one stream (no lanes)", "full", "bk"),
    "full-bk-onesum": ("DP full, book-keeping, one bf16 term per clipped sum", "full", "bk"),
    # bk on a GPU before bk_kernel: the clipped sum of bf16 factors as the split's two bf16 products
    "full-bk-split": ("DP full, book-keeping, the split's two products per clipped sum", "full", "bk"),
    "bitfit-ghost": ("DP bitfit, ghost", "bitfit", "ghost"),
    "lora-ghost": ("DP lora r=8 (default targets), ghost", "lora", "ghost"),
    "full-ghost-nosamplers": ("DP full, ghost, no Conv1D/LayerNorm norm samplers", "full", "ghost"),
}


# bk with one piece swapped, for side-by-side measurements: named with --modes, never run by default
TRIALS = ("full-bk-fp32", "full-bk-opacus-noise", "full-bk-one-stream", "full-bk-onesum", "full-bk-split")


def one_term_sums() -> None:
    """Mode full-bk-onesum (a trial, on a GPU in bf16): bk's clipped sum of bf16 factors as ONE
    bf16 product, bf16(C·x)ᵀg, with the bound 2⁻⁷ (twice bf16's rounding, 2⁻⁸) in place of the
    split's 2⁻¹⁵: what the split's second product costs. Its clipping factors are smaller by up
    to the bound (4.2 % at most, measured at 4ddee9b: docs/benchmarks.md)."""
    import torch

    from pipeline.privacy import bk, bk_kernel, bk_layers

    bk.SPLIT_ERROR = 2.0**-7
    bk_kernel.USE = False  # the product this trial replaces is the split's

    def weighted_sum(self, coef):
        if not self.split:
            return split_sum(self, coef)
        scale_a = self.a.shape[-1] <= self.g.shape[-1]
        x, other = (self.a, self.g) if scale_a else (self.g, self.a)
        x = (x * coef.view(-1, 1, 1)).to(torch.bfloat16).reshape(-1, x.shape[-1])
        other = other.reshape(-1, other.shape[-1])
        a, g = (x, other) if scale_a else (other, x)
        return bk_layers._mm32(a.t(), g) if self.transposed else bk_layers._mm32(g.t(), a)

    split_sum = bk_layers._MatmulUse.weighted_sum
    bk_layers._MatmulUse.weighted_sum = weighted_sum


def child(mode: str, a: argparse.Namespace) -> None:
    """Set up one mode, print READY, run one step per `step` line on stdin, then print RESULT."""
    for msg in ("Full backward hook", "Secure RNG", "Optimal order", "is_gradient_checkpointing"):
        warnings.filterwarnings("ignore", message=f".*{msg}.*")
    import torch
    import transformers
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from torch.utils.data import DataLoader, TensorDataset
    from transformers.pytorch_utils import Conv1D

    from pipeline.batching import IGNORE, lm_batch
    from pipeline.config import TeacherConfig
    from pipeline.devices import adamw
    from pipeline.models.base import untie_lm_head
    from pipeline.privacy import noise

    from pipeline.privacy.bk import BookKeepingPrivacyEngine as PrivacyEngine  # Opacus' engine plus mode "bk"

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)  # the same for every mode
    if a.allocator == "reuse":  # as every stage runs (Runtime.apply_threads); bench/allocator.py compares
        from pipeline.devices import reuse_freed_memory

        reuse_freed_memory()
    label, teacher_mode, gsm = MODES[mode]
    if mode == "full-bk-fp32":
        from pipeline.privacy import bk_layers

        bk_layers.SPLIT_DEVICES = set()
    if mode == "full-bk-opacus-noise":  # bk's optimizer then takes Opacus' noise path
        noise.cpu_draw = lambda *args: False
    if mode == "full-bk-onesum":
        one_term_sums()
    if mode == "full-bk-split":
        from pipeline.privacy import bk_kernel

        bk_kernel.USE = False
    if mode == "full-bk-one-stream":  # every parameter's noise from the step's generator alone, on one thread
        noise.LANE_MIN = 2**63
    if mode == "full-ghost-nosamplers":  # the teacher stage registers the Conv1D samplers: not imported here
        assert Conv1D not in GradSampleModuleFastGradientClipping.NORM_SAMPLERS
    else:
        from pipeline.models.losses import per_sequence_loss
        from pipeline.stages.teacher.trainable import prepare_trainable  # registers the samplers

    from pipeline.devices import Runtime

    autocast = Runtime(torch.device(a.device), a.precision, a.threads).autocast
    torch.manual_seed(0)
    if a.arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=a.vocab, max_position_embeddings=max(a.seq, 2048), hidden_size=a.width,
            num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
            intermediate_size=a.mlp, tie_word_embeddings=True,  # as SmolLM2 ships; untied below
        ))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=a.vocab, n_positions=max(a.seq, 1024), n_embd=a.width, n_layer=a.layers,
            n_head=a.heads, n_inner=a.mlp, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # deterministic steps
        ))
    if not a.tied:
        untie_lm_head(model)
    if teacher_mode != "full":
        model = prepare_trainable(model, TeacherConfig(mode=teacher_mode, grad_sample_mode=gsm))
    model.to(a.device).train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    lengths = torch.full((a.batch,), a.seq)  # every row full length
    batch = {k: v.to(a.device) for k, v in lm_batch(ids, lengths).items()}
    labels = batch.pop("labels")
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], 1e-4)  # the pipeline's
    criterion = None
    if gsm is not None:
        private = dict(module=model, optimizer=optimizer, noise_multiplier=1.0, max_grad_norm=1.0,
                       data_loader=DataLoader(TensorDataset(ids, lengths), batch_size=a.batch),
                       poisson_sampling=False, grad_sample_mode=gsm,
                       noise_generator=noise.generator("noise", secure=False, device=a.device))
        engine = PrivacyEngine(accountant="prv", secure_mode=False)
        if gsm == "ghost":
            private["criterion"] = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
            model, optimizer, criterion, _ = engine.make_private(**private)
        else:
            model, optimizer, _ = engine.make_private(**private)

    def physical(last: bool) -> float:
        """One physical batch; the optimizer steps (and DP adds its noise) on the last of a logical batch."""
        if gsm is not None and not last:  # as BatchMemoryManager: DP optimizers accumulate until the last
            optimizer.signal_skip_step(do_skip=True)
        with autocast():  # bf16: as the teacher stage (Runtime.autocast): fp32 master weights
            logits = model(**batch).logits  # (B, T, V)
        if gsm == "bk":  # one backward of the per-sequence losses; .grad = clipped sum
            per_example = per_sequence_loss(logits, labels)
            model.backward_clipped(per_example)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return per_example.mean().item()
        if criterion is not None:  # as train_teacher: per-sequence mean CE, wrapped by Opacus
            shifted = logits[:, :-1]
            loss = criterion(shifted.reshape(-1, shifted.shape[-1]), labels.reshape(-1), shape=shifted.shape)
        else:
            loss = per_sequence_loss(logits, labels).mean() / a.accumulate
        loss.backward()
        if gsm is not None or last:  # non-private: gradients accumulate in .grad
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item()

    passes = []  # seconds of each physical batch but a logical step's last (no optimizer step in it)

    def step() -> float:
        """One logical step: `accumulate` physical batches, then the optimizer's step."""
        losses = []
        for k in range(a.accumulate):
            t0 = time.perf_counter()
            losses.append(physical(k == a.accumulate - 1))
            if k < a.accumulate - 1:
                passes.append(time.perf_counter() - t0)
        return losses[0]

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
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
    else:  # stdin closed without "done": the driver is gone and nobody would read a result
        return
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if a.profile:
        profile_step(step, mode, Path(a.profile), cuda)
    timed = times[a.warmup:]
    result = dict(mode=mode, label=label, trainable=trainable, time=statistics.median(timed), times=timed,
                  mem=(peak - before) / 2**20, first_loss=losses[0])
    if passes:  # forward + backward (+ clipping) of one physical batch, the logical step's update left out
        result["pass"] = statistics.median(passes[a.warmup * (a.accumulate - 1):])
    if not cuda:  # one more, untimed step: the peak of live tensor bytes it adds, from the profiler
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        live = top = 0
        for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
                live += e.nbytes()  # + allocation, - free
                top = max(top, live)
        result["tensor_mem"] = top / 2**20
    print("RESULT " + json.dumps(result), flush=True)


def profile_step(step, mode: str, out: Path, cuda: bool) -> None:
    """One more step under torch.profiler, written to out/<mode>.txt: the step's wall time, the host
    time of its operators and, on CUDA, the time the GPU spent in kernels, which says whether the
    step waits on the host (kernel time well below the wall) or on the GPU; then the top operators
    by self host time and, on CUDA, by self GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=cuda) as prof:  # shapes: for the CUDA table below
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    table = prof.key_averages()
    host = sum(e.self_cpu_time_total for e in table) / 1e6
    lines = [f"{mode}: one step under the profiler, wall {wall:.3f} s; operators' self host time {host:.3f} s"]
    sorts = ["self_cpu_time_total"]
    if cuda:
        # kernels only: an operator's self device time is its kernels' again (as the table's total)
        gpu = sum(e.self_device_time_total for e in table if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        lines[0] += f"; GPU kernel time {gpu:.3f} s ({gpu / wall:.0%} of the wall)"
        sorts.append("self_device_time_total")
    lines.append(f"operator calls: {sum(e.count for e in table)}")
    for key in sorts:
        lines += ["", f"by {key}:", table.table(sort_by=key, row_limit=30, max_name_column_width=60)]
    if cuda:  # where the GPU time goes, operator by operator and shape by shape
        lines += ["", "by self_device_time_total, grouped by input shapes:",
                  prof.key_averages(group_by_input_shape=True).table(
                      sort_by="self_device_time_total", row_limit=40, max_name_column_width=40,
                      max_shapes_column_width=80)]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{mode}.txt").write_text("\n".join(lines) + "\n")
    print(lines[0], file=sys.stderr, flush=True)


class Child:
    """One mode's process, driven line by line through its stdin/stdout."""

    def __init__(self, mode: str, a: argparse.Namespace):
        self.mode, self.err = mode, tempfile.TemporaryFile("w+")  # a file: stderr cannot block it
        args = [f"--{k}={getattr(a, k)}" for k in (*SHAPE, "arch", "device", "precision", "warmup", "threads",
                                                     "allocator", "accumulate")]
        args += [f"--profile={a.profile}"] if a.profile else []
        args += ["--tied"] if a.tied else []
        self.proc = subprocess.Popen([sys.executable, __file__, "--one", mode, *args], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)
        self.call(None, "READY")

    def call(self, command: str | None, expect: str) -> str:
        try:
            if command:
                self.proc.stdin.write(command + "\n")
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:  # the process is gone
            line = ""
        if not line.startswith(expect):
            self.proc.kill()
            code = self.proc.wait()
            self.err.seek(0)
            last = (self.err.read().strip().splitlines() or ["no output"])[-1]
            if code == -signal.SIGKILL:  # what the kernel's OOM killer sends
                last = f"the {self.mode} process was killed (SIGKILL: out of memory? `dmesg | tail`); {last}"
            raise RuntimeError(last)
        return line


def run_all(a: argparse.Namespace) -> list[dict]:
    rows, alive = {}, {}

    def attempt(mode: str, fn) -> None:
        try:
            fn()
        except RuntimeError as e:
            rows[mode] = dict(mode=mode, label=MODES[mode][0], error=str(e))
            alive.pop(mode, None)
            print(f"[{mode}] FAILED: {e}", file=sys.stderr)

    def start(mode: str) -> None:  # one setup at a time
        attempt(mode, lambda: alive.__setitem__(mode, Child(mode, a)))

    def run_steps(order: list[str]) -> None:
        for i in range(a.warmup + a.steps):
            for mode in order[i % len(order):] + order[: i % len(order)]:  # rotate who goes first
                if mode in alive:
                    attempt(mode, lambda m=mode: alive[m].call("step", "STEP"))

    def finish(mode: str) -> None:
        def done():
            r = rows[mode] = json.loads(alive.pop(mode).call("done", "RESULT")[len("RESULT "):])
            print(f"[{mode}] median {r['time']:.3f} s/step (min {min(r['times']):.3f}, max "
                  f"{max(r['times']):.3f}), {r['mem']:.0f} MiB", file=sys.stderr)
        if mode in alive:
            attempt(mode, done)

    groups = [a.modes] if a.interleave else [[m] for m in a.modes]
    for group in groups:
        for mode in group:
            start(mode)
        run_steps(group)
        for mode in group:
            finish(mode)
    return [rows[m] for m in a.modes]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    for name in SHAPE:
        p.add_argument(f"--{name}", type=int, help="overrides the preset")
    p.add_argument("--arch", choices=["gpt2", "llama"], help="overrides the preset (default gpt2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    p.add_argument("--accumulate", type=int, default=1,
                   help="physical batches per logical step (default 1): a DP step's noise is drawn once per "
                        "logical step, as in the teacher, where a Poisson batch spans several physical ones")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: forward passes under autocast, as the stages run precision=bf16")
    p.add_argument("--threads", type=int, default=1, help="torch threads in every mode's process (default 1)")
    p.add_argument("--allocator", choices=["reuse", "system"], default="reuse",
                   help="reuse: glibc keeps freed memory, as the stages set it (pipeline.devices.reuse_freed_memory); "
                   "system: glibc's defaults")
    p.add_argument("--modes", nargs="+", choices=MODES, default=[m for m in MODES if m not in TRIALS],
                   help="default: every mode but the bk trials (%s)" % ", ".join(TRIALS))
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction,
                   help="keep every mode's process alive and step them round-robin (default: on CPU)")
    p.add_argument("--profile", metavar="DIR", help="after the timed steps, profile one more step of each mode "
                   "into DIR/<mode>.txt: host time against GPU kernel time, and the top operators")
    p.add_argument("--tied", action="store_true",
                   help="keep lm_head tied to the input embedding in every row (teacher.untie_lm_head=false; bk "
                   "clips the shared weight over both uses; ghost and hooks rows then clip each use apart)")
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # internal: be one mode's process
    a = p.parse_args()
    for k, v in PRESETS[a.preset].items():
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    a.arch = a.arch or "gpt2"
    a.kv_heads = a.kv_heads or a.heads  # GPT-2: no grouped-query attention
    a.mlp = a.mlp or 4 * a.width
    a.warmup = max(1, a.warmup)
    import torch

    a.device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if a.one:
        return child(a.one, a)
    a.interleave = a.device == "cpu" if a.interleave is None else a.interleave
    import opacus

    t0, load0 = time.time(), os.getloadavg()[0]
    rows = run_all(a)
    base = next((r for r in rows if r["mode"] == "nonprivate" and "error" not in r), None)
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    kv = f" ({a.kv_heads} key/value)" if a.kv_heads != a.heads else ""
    print(f"{a.arch} shape: {a.layers} layers, width {a.width}, {a.heads} heads{kv}, MLP {a.mlp}, vocab {a.vocab}, seq {a.seq}, "
          f"batch {a.batch}" + (f" x {a.accumulate} physical batches a step" if a.accumulate > 1 else "") + f" | device {a.device}, {a.precision}, {a.threads} torch thread(s) per mode | torch "
          f"{torch.__version__}, opacus {opacus.__version__} | load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"Command: `{shlex.join([exe, os.path.relpath(__file__, ROOT), *sys.argv[1:]])}`\n")
    mem = "peak CUDA memory above setup" if a.device == "cuda" else "peak RSS growth"
    cpu = a.device == "cpu"
    print(f"| mode | trainable params | step time (s) | time ratio vs non-private | {mem} (MiB) "
          "| memory ratio vs non-private |" + (" tensor peak of one step (MiB) | ratio |" if cpu else ""))
    print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if cpu else ""))
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | – | failed: {r['error'][:100]} | – | – | – |" + (" – | – |" if cpu else ""))
            continue
        tr = f"{r['time'] / base['time']:.2f}" if base else "–"
        mr = f"{r['mem'] / base['mem']:.2f}" if base and base["mem"] > 0 else "–"
        extra = ""
        if cpu:
            ratio = f"{r['tensor_mem'] / base['tensor_mem']:.2f}" if base and base["tensor_mem"] > 0 else "–"
            extra = f" {r['tensor_mem']:.0f} | {ratio} |"
        print(f"| {r['label']} | {r['trainable']:,} | {r['time']:.3f} | {tr} | {r['mem']:.0f} | {mr} |{extra}")
    losses = sorted({f"{r['first_loss']:.4f}" for r in rows if "error" not in r})
    print(f"\nStep = {'forward + backward' if a.accumulate == 1 else f'{a.accumulate} x (forward + backward)'}"
          f" + optimizer.step + zero_grad; time = median of {a.steps} steps after "
          f"{a.warmup} warm-up step(s). DP rows: noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling="
          "False (one fixed batch, not Poisson-sampled). Same seeded weights and batch in every row "
          f"(first-step loss: {', '.join(losses)}); lm_head {'tied' if a.tied else 'untied'} in every row; dropout off.")
    if a.interleave:
        print("Timing: one process per mode, all alive at once and stepped round-robin (rotating who goes "
              "first), one computing at a time, so background load on the machine hits every mode alike.")
    if a.device == "cuda":
        print("Memory: torch.cuda.max_memory_allocated over the steps minus memory_allocated right before the "
              "first step (model and engine set up; optimizer state, activations, gradients, per-sample "
              "tensors counted).")
    else:
        print("Memory: each mode in its own fresh process; ru_maxrss (peak RSS) after the timed steps minus "
              "ru_maxrss right before the first step (after model + engine setup). Coarse: it counts optimizer "
              "state, activations and per-sample tensors, but also allocator caching and fragmentation, and "
              "misses whatever stays under the setup's own earlier peak. Tensor peak of one step: one more, "
              "untimed step under torch.profiler(profile_memory=True); the peak of live CPU tensor bytes "
              "above the step's start, summed from the allocation records: exact for tensors, blind to the "
              "allocator, and without the optimizer state (allocated at the first step).")
    print(f"Benchmark wall time: {time.time() - t0:.0f} s.")
    if a.accumulate > 1:
        print("Physical pass: the median of each logical step's physical batches but its last (forward, "
              "backward, clipping; no optimizer step, no noise): " + ", ".join(
                  f"{r['mode']} {r['pass']:.3f} s" for r in rows if "pass" in r) + ". A logical step of K "
              "physical batches costs about K passes plus one update (the DP noise is drawn once per step).")
    print("JSON " + json.dumps([{"mode": r["mode"], "step_s": r["time"], **({"pass_s": r["pass"]} if "pass" in r else {})}
                                for r in rows if "error" not in r]))
    bk = next((r for r in rows if r["mode"] == "full-bk" and "error" not in r), None)
    if bk and base:  # the last line: bk against non-private (memory: live tensor bytes on CPU)
        key = "tensor_mem" if cpu else "mem"
        passes = f" pass_ratio={bk['pass'] / base['pass']:.2f}" if "pass" in bk and "pass" in base else ""
        print(f"mode=bk time_ratio={bk['time'] / base['time']:.2f} memory_ratio={bk[key] / base[key]:.2f}{passes}")


if __name__ == "__main__":
    main()
