"""Where and in what precision the stages compute, how many CPU threads each process uses, and
how its C allocator serves large tensors (`reuse_freed_memory`).

    rt = Runtime.from_config(cfg)            # cfg.device / cfg.precision / cfg.threads, resolved
    rt.apply_threads()                       # at the start of every stage and worker process
    model = load_causal_lm(path, dtype=rt.dtype).to(rt.device)      # inference stages
    with rt.autocast():                      # training stages: fp32 master weights
        loss = ...

Training stages (the DP-SGD teacher or student, distillation) keep fp32 weights and run
their forward passes under `torch.autocast(device_type, dtype)`, the standard mixed-precision
recipe; inference stages (generation, the top-k logit cache, evaluation) load the weights in
the chosen dtype. Losses, perplexities and ε are computed in fp32: logits are upcast before
any log-softmax, and the accountant never sees a tensor.

fp16 is refused (PipelineConfig): every method trains with DP-SGD, and fp16 training needs
loss scaling, which multiplies the per-example gradients that clipping bounds by C; the
clipping norm, and so the noise's calibration, would no longer mean what the ledger says.
bf16 has fp32's exponent range and needs no scaling.

The device is not part of any cache key (flows/tasks.py): it changes the rounding
of a result, not what was computed, like `threads`. The precision is part of the keys of
every stage that runs a model: a bf16 teacher is another teacher than an fp32 one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_DEFAULT_THREADS = 4  # beyond this, the tiny-to-small models here gain little per extra thread


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs that compute bf16 natively


@contextlib.contextmanager
def ieee_fp32_products():
    """fp32 matrix products in IEEE fp32 on CUDA and on the CPU (oneDNN) inside, whatever
    `torch.set_float32_matmul_precision`, `allow_tf32` or the per-backend settings say, and the
    caller's settings back after. DP clipping runs in it: with TF32's 10-bit significand (or
    oneDNN's bf16 mode on a CPU) a per-example norm rounded down clips by less than C. Only
    the per-backend API is written, so a caller who used either API reads its own back."""
    backends = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = [b.fp32_precision for b in backends]
    try:
        for b in backends:
            b.fp32_precision = "ieee"
        yield
    finally:
        for b, value in zip(backends, saved):
            b.fp32_precision = value


class DeviceError(ValueError):
    """The configured device or precision is not available on this machine; says what to set."""


def device_problem(spec: str, precision: str = "fp32") -> str | None:
    """Why `device=spec` with `precision` cannot run here (None: it can). `dpdistill` pre-flight
    reports it before anything starts (pipeline/preflight.py)."""
    if spec in ("auto", "cpu"):
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(spec.split(":", 1)[1]) if ":" in spec else 0
    if count == 0:
        return (f"device={spec} but this machine has no usable CUDA device (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda or 'none'}); set device=auto or device=cpu")
    if index >= count:
        return f"device={spec} but only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1}); pick one of them"
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        return (f"precision=bf16 but {torch.cuda.get_device_name(index)} has no bf16 support (GPUs from "
                "NVIDIA Ampere on have it); set precision=fp32")
    return None


def resolve_device(spec: str, precision: str = "fp32") -> torch.device:
    """`auto` → cuda when present, else cpu; `cuda` → cuda:0; refused when it cannot run here."""
    if problem := device_problem(spec, precision):
        raise DeviceError(problem)
    if spec == "auto":
        on_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
        return torch.device("cuda", 0) if on_cuda else torch.device("cpu")
    if spec == "cuda":
        return torch.device("cuda", 0)
    return torch.device(spec)


@cache
def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX); None where /proc/cpuinfo
    cannot tell (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return any(f in flags for f in CPU_BF16_FLAGS)


def slow_bf16_warning(device: torch.device, precision: str, native: bool | None = None) -> str | None:
    """The warning for precision=bf16 on a CPU that only emulates it (None: nothing to say).
    Without AVX-512 BF16 or AMX, torch converts every bf16 product to fp32 and back: on such a
    machine the demo's steps took 8-17x the CPU time of fp32's, timed side by side (teacher DP
    step 13x, generation batch 8x, distillation step 17x; issue 22)."""
    if precision != "bf16" or device.type != "cpu":
        return None
    if (cpu_has_native_bf16() if native is None else native) is not False:
        return None
    return ("precision=bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 flag in /proc/cpuinfo): "
            "torch emulates it, about 10x slower than fp32 per step (8-17x on the demo's); set precision=fp32 on this machine "
            "(bf16 pays off on CPUs with AMX or AVX-512 BF16, and on CUDA GPUs from Ampere on)")


def default_threads(processes: int = 1) -> int:
    """CPU threads of one of `processes` processes sharing this machine: $OMP_NUM_THREADS when
    set (what a scheduler or a test run asks for), else min(4, cores / processes). torch's own
    default (every core, in every process) oversubscribes shared machines: steps measured 6-7x
    slower on a busy 2-core machine than with 1 thread."""
    if (env := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(MAX_DEFAULT_THREADS, (os.cpu_count() or 1) // max(1, processes)))


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@cache  # once per process: apply_threads runs before every timing of the plan
def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead of giving it back
    to the system (no mmap'd blocks, no trimming); True where it could (Linux with glibc).

    PyTorch's CPU tensors come from malloc, and glibc serves every block over 32 MB (the most
    its mmap threshold adapts to) by a fresh mmap, freed with munmap: each such tensor, e.g. a
    distillation step's (tokens, vocabulary) logits, page-faulted all of its memory in anew,
    every step. On the 2-core machine that made a copy of a 1,700 × 8,192 fp32 tensor 54 ms
    against 5.7 ms from reused memory, and the distillation loss 2.3x slower (issue 22,
    docs/operations.md). The cost: the process keeps its peak memory until it exits, as
    PyTorch's CUDA allocator does on the GPU. Set once per process; other C libraries'
    allocations are served the same way."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def adamw(params, lr: float, weight_decay: float = 0.01, fused: bool = True) -> torch.optim.AdamW:
    """torch's AdamW for every training stage, fused where every parameter is a floating-point
    tensor on a CPU or a CUDA GPU: the update's dozen elementwise passes over each parameter
    (moments, square root, division, weight decay) in one, the same update to float rounding.
    On a CPU it is the difference between ~1 s and ~0.1 s a step at SmolLM2's 163 M parameters
    (`bench/adamw.py`), for the private and the non-private step alike. `fused=False`: torch's
    loop, for a build whose weights must stay bit-identical to earlier builds (the model cache's
    public students, pipeline/models/pretrain.py train_on_blocks)."""
    params = list(params)
    fused = fused and bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                                           for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


@dataclass(frozen=True)
class Runtime:
    """The resolved device, precision and thread count a stage runs with (small, picklable:
    it travels to Dask generation workers and, as JSON, to torchrun ranks)."""

    device: torch.device = torch.device("cpu")
    precision: str = "fp32"
    threads: int | None = None  # per process; None: default_threads()

    @classmethod
    def from_config(cls, cfg) -> "Runtime":
        """From a PipelineConfig's top-level `device`, `precision` and `threads`."""
        return cls(resolve_device(cfg.device, cfg.precision), cfg.precision, cfg.threads)

    @property
    def dtype(self) -> torch.dtype:
        """Weights' dtype for the inference stages (training keeps fp32 master weights)."""
        return DTYPES[self.precision]

    def autocast(self):
        """Mixed-precision context of the training forward passes (a no-op in fp32)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def threads_for(self, processes: int = 1) -> int:
        return self.threads or default_threads(processes)

    def apply_threads(self, processes: int = 1) -> int:
        """torch.set_num_threads in this process (once per stage or worker), and the C allocator
        set to reuse freed memory (`reuse_freed_memory`); returns the threads."""
        reuse_freed_memory()
        n = self.threads_for(processes)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def for_ddp(self, backend: str) -> "Runtime":
        """The runtime the ranks of a data-parallel teacher start from: nccl ranks on CUDA
        (each then takes cuda:local_rank, `for_rank`), gloo ranks on the CPU (PipelineConfig
        refuses gloo with a CUDA device, and nccl with device=cpu)."""
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        return Runtime(device, self.precision, self.threads)

    def for_rank(self, local_rank: int) -> "Runtime":
        """A data-parallel rank's runtime: on CUDA, one GPU per rank (cuda:local_rank)."""
        if self.device.type != "cuda":
            return self
        return Runtime(torch.device("cuda", local_rank), self.precision, self.threads)

    def to_json(self) -> dict:
        return {"device": str(self.device), "precision": self.precision, "threads": self.threads}

    @classmethod
    def from_json(cls, d: dict) -> "Runtime":
        return cls(torch.device(d["device"]), d["precision"], d["threads"])


CPU_FP32 = Runtime()  # what every stage ran with before issue 11, and the default of the stage functions
