"""Stage 1: DP-SGD fine-tuning of the teacher on the private records, with Opacus 1.6.

Opacus is used as its API intends: its accountant calibrates σ from the target (ε, δ), the
sampling rate and the exact number of steps (`get_noise_multiplier`'s search, with a deadline:
pipeline/privacy/accountant.py); `PrivacyEngine.make_private`
wraps model, optimizer and the Poisson loader; BatchMemoryManager splits large logical
batches into physical ones. ε in the ledger is what the accountant says after the last
step, and training stops before a step that would exceed the target.

Modes: `full` (every weight), `bitfit` (bias terms only, DP-BiTFiT), `lora` (peft
adapters, merged into the saved checkpoint). Clipping (`CLIPPING`, one line each): `bk`
(book-keeping, pipeline/privacy/bk.py: one backward pass), `ghost` (Opacus ghost clipping, Li et
al. 2021: a norm pass, then a reweighted one; GPT-2 needs an untied `lm_head` and explicit
contiguous (B, T) `position_ids`) or `hooks` (Opacus' per-sample gradients, the reference).

The stage reads as a recipe: `_setup` (models, private data behind secret Poisson
sampling, σ, Opacus' engine), `_resume`, `_step` (one physical batch), `_record_step`,
`_save_checkpoint`, `_ledger_entry` and `_save`, driven by `train_teacher`'s loop.

Secret randomness: the DP noise, the Poisson sample and the record picked for each sampled
user come from generators keyed with OS entropy (pipeline/privacy/noise.py), never from `seed`,
which is published with the config; `seed` drives the rest (dropout, data order). With
`secure_mode` they come from a ChaCha20 CSPRNG.

What is published per step is a function of public quantities only (step, ε spent) plus,
every `log_every` steps, a validation loss as `monitor` says: none (the default), a DP release
on the validation split (pipeline/privacy/monitor.py, its own ledger entry) or the exact loss
on records the user declared public. The validation records are private records: their exact
loss confirmed a candidate record (issue 21). The loss and size of a private Poisson batch are
never published. Time is published only
every TIMING_WINDOW_STEPS steps and at the end: a step's duration tracks its Poisson batch.

Crash-safe budget: every `checkpoint_every` steps the model, optimizer, accountant and
RNG states are saved atomically to `out_dir/checkpoint/state.pt` (mode 0600: it holds the
secret generators' states; deleted when the stage finishes). Run again into the same
`out_dir`, training resumes at the saved step with the saved accountant and generators: it
neither restarts the accountant (under-counting) nor repeats steps already counted. The
checkpoint is read with `weights_only=True`: a planted file cannot run code.

Data-parallel (`processes` > 1): `train_teacher` runs `ddp_worker` under torchrun
(pipeline/stages/teacher_ddp.py, which imports it by name); inside the process group every rank
runs `train_teacher` on its share of each Poisson draw, Opacus' DPDDP optimizers add the
noise once (rank 0) and all-reduce, and the accountant sees the global batch, exactly as
in one process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch.utils.data import DataLoader, Dataset

from pipeline.privacy import noise

from pipeline.privacy import accountant as privacy
from pipeline.privacy import monitor as dp_monitor

from pipeline.stages import teacher_ddp
from pipeline.privacy.bk import BookKeepingPrivacyEngine
from pipeline.batching import IGNORE, lm_batch
from pipeline.config import NODE_FIELDS, TeacherConfig
from pipeline.stages.data import read_users
from pipeline.devices import CPU_FP32, Runtime
from pipeline.privacy.ledger import LedgerEntry, with_pld_epsilons
from pipeline.manifest import MANIFEST, atomic_write_json, manifest_problems, sha256_file, write_manifest
from pipeline.models.losses import next_token_nll, per_sequence_distillation_loss
from pipeline.models.scoring import by_length
from pipeline.models.base import load_causal_lm, load_tokenizer, same_tokenizer, untie_lm_head
from pipeline.progress import DEFAULT_EVERY, ProgressLog
from pipeline.tokenized import TokenIds, token_column, tokenized_split

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint/state.pt"

# A DP-SGD step's duration tracks its Poisson batch size, a function of the private records
# drawn, and the DP guarantee says nothing about it. Progress lines came 1-2 steps apart on
# a loaded CPU, publishing single-step durations (issue 21): anything that carries a time
# (a log line, its timestamp, the progress artifact, training_log.json's seconds) comes only
# at multiples of this many steps and at the end, so only sums of ≥ 20 durations are public.
TIMING_WINDOW_STEPS = 20


def publishes_time(done: int, total: int) -> bool:
    """Whether the end of step `done` of `total` may be published with a time."""
    return done % TIMING_WINDOW_STEPS == 0 or done >= total


def is_monitor_point(done: int, total: int, log_every: int) -> bool:
    """Whether step `done` of `total` publishes ε and the validation loss (if monitored): every
    `log_every` steps, and wherever a time is published, so that the line has them."""
    return done % log_every == 0 or publishes_time(done, total)


def monitor_points(total: int, log_every: int) -> list[int]:
    """Every step that publishes a validation loss, the last one (the final loss) included:
    with monitor=dp, the releases the accountant is told about before training."""
    return [s for s in range(1, total + 1) if is_monitor_point(s, total, log_every)]


class TeacherError(ValueError):
    """The teacher stage cannot run as configured; the message says what to change."""


@dataclass(frozen=True)
class KnowledgeDistillation:
    """DP-SGD with a KD loss (the DPKD baseline): a frozen teacher's soft labels on the
    private batch. The teacher must itself be DP: its outputs are post-processing."""

    teacher_dir: Path
    alpha: float
    temperature: float


@dataclass
class TeacherResult:
    checkpoint: Path
    ledger: LedgerEntry
    validation_curve: list[tuple[int, float]] = field(default_factory=list)
    """(step, published validation loss) every log_every steps (teacher.monitor: noisy with dp, on
    public records with public); empty with monitor=none. Never a training loss."""
    validation_loss: float | None = None
    """The last published validation loss (the final model's); None with monitor=none."""
    resumed_from_step: int = 0
    monitor_ledger: LedgerEntry | None = None
    """monitor=dp: the ledger entry of the validation-loss releases, composed into the run's total."""


def per_sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of each sequence: logits (B, L, V), labels (B, L-1) -> (B,)."""
    nll = next_token_nll(logits, labels)  # (B, L-1); fp32 under bf16 autocast too
    valid = (labels != IGNORE).sum(1).clamp(min=1)  # (B,)
    return nll.sum(1) / valid


class OneRecordPerUser(Dataset):
    """User-level DP: the dataset's units are users; each draw returns one of the user's
    records, chosen at random. Poisson sampling over users then gives every sampled user
    exactly one clipped contribution per step, and the accountant counts users
    (author-level sampling, as in dp-transformers)."""

    def __init__(self, records: Dataset, users: list[str], generator: noise.Generator):
        by_user: dict[str, list[int]] = {}
        for i, u in enumerate(users):
            by_user.setdefault(u, []).append(i)
        self.records = records
        self.groups = [torch.tensor(v) for _, v in sorted(by_user.items())]
        self.generator = generator

    def __len__(self) -> int:
        return len(self.groups)

    def pick(self, u: int) -> Pick:
        """User u and the record drawn for it (secret: the user_pick generator)."""
        group = self.groups[u]
        return Pick(u, group[noise.randbelow(self.generator, len(group))].item())

    def __getitem__(self, u: int | Pick):
        """The record of a `Pick`, or of a user (drawn now)."""
        return self.records[(u if isinstance(u, Pick) else self.pick(u)).record]


@dataclass(frozen=True)
class Pick:
    """A sampled user and the one record it contributes this step (OneRecordPerUser). Not a
    tuple: Opacus' BatchSplittingSampler passes a step through numpy, which would make it a list."""

    user: int
    record: int


def shortest_first(lengths: np.ndarray, users: OneRecordPerUser | None = None) -> Callable[[list[int]], list]:
    """How RankShareSampler arranges a step's draw so that its physical batches hold records of
    like lengths: record indices sorted by length; with `users`, each drawn user's record picked
    now, and the picks sorted by their record's length."""
    if users is None:
        return lambda share: sorted(share, key=lengths.__getitem__)
    return lambda share: sorted(map(users.pick, share), key=lambda p: lengths[p.record])


class RankShareSampler(UniformWithReplacementSampler):
    """Poisson sampling for rank `rank` of `world_size` data-parallel processes.

    Each step draws every record with probability q, as one process would, and this rank
    keeps the drawn records it owns (index % world_size == rank): the union over ranks is
    one Poisson sample of the whole dataset. With the same generator seed on every rank it
    is exactly the single-process sample (the test hook of pipeline/privacy/noise.py); with
    independent secret generators each record is still drawn once, by its owner. Every rank
    yields every step, empty or not, so the ranks step and all-reduce together (Opacus'
    DistributedUniformWithReplacementSampler skips empty local batches, which would leave
    the ranks a step apart). The generator may be a torch.Generator or the ChaCha20 CSPRNG.
    One process is rank 0 of 1.

    With `arrange` (`shortest_first`), a step's share comes shortest record first, so that
    BatchMemoryManager's physical batches, cut from it in order, hold records of like lengths
    and each pads to its own longest: the same records, the same clipped sum (each example's
    gradient is its own, whatever it is batched with), less padding computed (issue 22).
    Nothing about a step's records is published either way.
    """

    def __init__(self, *, num_samples: int, sample_rate: float, generator, rank: int = 0, world_size: int = 1,
                 arrange: Callable[[list[int]], list] | None = None):
        super().__init__(num_samples=num_samples, sample_rate=sample_rate, generator=generator)
        self.rank, self.world_size, self.arrange = rank, world_size, arrange

    def __iter__(self):
        for _ in range(self.steps):
            drawn = (noise.uniform(self.generator, self.num_samples) < self.sample_rate).nonzero().view(-1)
            share = [i for i in drawn.tolist() if i % self.world_size == self.rank]
            yield share if self.arrange is None else self.arrange(share)


def poisson_schedule(n: int, batch_size: int, epochs: int, unit: str = "record") -> tuple[float, float, int]:
    """(Poisson sampling probability, rate the accountant records, steps) of DP-SGD over N units.

    Made with Opacus' own objects, as `train_teacher` samples: `DPDataLoader` takes the
    probability 1 / ceil(N / batch_size); its sampler runs int(1 / probability) steps per
    epoch, and make_private hands the accountant q = 1 / steps per epoch (for 1/99: 98 steps
    accounted at 1/98). make_private_with_epsilon calibrates for int(epochs / q) steps
    instead, which can differ by one and overspend the budget, so σ is calibrated here for
    exactly these steps. `dpdistill plan` calls this too, so it shows the run's own q and steps.
    """
    if batch_size >= n:
        raise TeacherError(
            f"teacher.batch_size={batch_size} is not smaller than the {n} training {unit}s; "
            "Poisson sampling needs a sampling rate below 1: lower teacher.batch_size"
        )
    units = torch.utils.data.TensorDataset(torch.empty(n, 0))  # N items of nothing: only the count matters
    probability = DPDataLoader.from_data_loader(DataLoader(units, batch_size=batch_size)).sample_rate
    steps_per_epoch = len(UniformWithReplacementSampler(num_samples=n, sample_rate=probability))
    return probability, 1.0 / steps_per_epoch, epochs * steps_per_epoch


def calibrate_noise(cfg: TeacherConfig, sample_rate: float, steps: int, delta: float) -> tuple[float, int]:
    """(σ for the target (ε, δ) after `steps`, the steps that stay within it), by the accountant.

    Bounded in time (privacy.CALIBRATION_DEADLINE_S): PRV never returns at a very large ε.
    """
    try:
        sigma = privacy.calibrate_sigma(cfg.accountant, cfg.target_epsilon, delta, sample_rate, steps)
        steps_allowed = privacy.max_steps_within_budget(
            cfg.accountant, sigma, sample_rate, delta, cfg.target_epsilon, steps
        )
    except privacy.CalibrationTimeout as e:
        raise TeacherError(
            f"{e} (q={sample_rate:.4g}, {steps} steps, δ={delta:.3g}; at very large ε the PRV accountant "
            "overflows). Use teacher.accountant=rdp, or a smaller teacher.target_epsilon"
        ) from e
    except Exception as e:  # the accountants fail in several ways on extreme (q, steps)
        raise TeacherError(
            f"the {cfg.accountant} accountant could not calibrate the noise for "
            f"ε={cfg.target_epsilon}, δ={delta:.3g}, q={sample_rate:.4g}, {steps} steps "
            f"({type(e).__name__}: {e}). Raise teacher.target_epsilon, lower teacher.epochs, "
            "lower teacher.batch_size (a smaller sampling rate), or try teacher.accountant=rdp"
        ) from e
    return sigma, steps_allowed


def prepare_trainable(model: torch.nn.Module, cfg: TeacherConfig) -> torch.nn.Module:
    """Freeze what the mode does not train; wrap with LoRA adapters for mode=lora."""
    if cfg.mode == "full":
        return model
    if cfg.mode == "bitfit":
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith(".bias"))
        if not any(p.requires_grad for p in model.parameters()):
            raise TeacherError("teacher.mode=bitfit: the model has no bias terms; use mode=full or lora")
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules=cfg.lora_target_modules,
        fan_in_fan_out=model.config.model_type == "gpt2",  # GPT-2's Conv1D stores W as (in, out)
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise TeacherError(f"teacher.mode=lora: {e}; set teacher.lora_target_modules") from e


# One backward for each clipping mode: after it, Opacus' optimizer finds what it expects
# (per-sample gradients for hooks, the clipped sum in .grad for ghost and bk).
CLIPPING: dict[str, Callable] = {
    "ghost": lambda model, optimizer, per_example: DPTensorFastGradientClipping(
        model, optimizer, per_example, "mean").backward(),  # Opacus: a norm pass, then a reweighted one
    "hooks": lambda model, optimizer, per_example: per_example.mean().backward(),  # per-sample gradients
    "bk": lambda model, optimizer, per_example: model.backward_clipped(per_example),  # pipeline/privacy/bk.py
}


def _noise_only_step(model: torch.nn.Module, optimizer, mode: str) -> None:
    """Poisson sampling drew an empty logical batch (for this rank): the step still happens
    (noise only; under DDP the rank still joins the all-reduce), so the accountant's step
    count matches what was released."""
    for p in model.parameters():
        if p.requires_grad:
            if mode == "hooks":
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            else:  # ghost, bk: the optimizer reads the clipped sum from .grad
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _steps_accounted(engine: PrivacyEngine) -> int:
    return int(sum(steps for _, _, steps in engine.accountant.history))


def _world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group; (0, 1) outside one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@torch.no_grad()
def _per_record_losses(model: torch.nn.Module, records: TokenIds, batch_size: int, runtime: Runtime) -> torch.Tensor:
    """Each monitor record's mean per-token loss, (R,) float64 on the host (forward only, eval
    mode). Published only through `_monitor_value`: exact for public records, noisy for private ones."""
    model.eval()
    losses = torch.zeros(len(records), dtype=torch.float64)
    for rows in by_length(records, batch_size):
        ids, lengths = records.collate([records[i] for i in rows])
        batch = {k: v.to(runtime.device) for k, v in lm_batch(ids, lengths).items()}
        labels = batch.pop("labels")
        with runtime.autocast():
            logits = model(**batch).logits  # (B, L, V)
        losses[rows] = torch.tensor(per_sequence_loss(logits, labels).tolist(), dtype=torch.float64)  # (B,)
    model.train()
    return losses


@dataclass
class _Monitor:
    """What the stage scores at each monitor point (teacher.monitor dp or public)."""

    mode: str
    records: TokenIds
    n: int  # units the published mean is over
    units: torch.Tensor | None = None  # dp at user level: each record's user index (R,)
    z: float = 0.0  # dp: the calibrated noise multiplier
    entry: LedgerEntry | None = None  # dp: the release's ledger entry


def _setup_monitor(cfg: TeacherConfig, tok, *, validation_path: Path, monitor_path: Path | None, stage: str,
                   steps_allowed: int, delta: float) -> _Monitor | None:
    """The records the validation loss is computed on, and with dp its calibrated mechanism."""
    if cfg.monitor == "none":
        return None  # the validation split is not even read
    if cfg.monitor == "public":
        if monitor_path is None:
            raise TeacherError("teacher.monitor=public: pass train_teacher(monitor_path=...), the public "
                               "records formatted as a split (the flow makes it from teacher.monitor_path)")
        records, _, n = dp_monitor.first_units(token_column(tokenized_split(monitor_path, tok)), None, cfg.monitor_records)
        if n == 0:
            raise TeacherError(f"teacher.monitor_path {str(cfg.monitor_path)!r} holds no records; "
                               "point it at a file of public records, or set teacher.monitor=none")
        return _Monitor("public", TokenIds(records, cfg.max_length, tok.pad_token_id), n)
    users = read_users(validation_path)
    records, units, n = dp_monitor.first_units(token_column(tokenized_split(validation_path, tok)), users,
                                     cfg.monitor_records)
    if n == 0:
        raise TeacherError("teacher.monitor=dp: the validation split is empty; raise data.validation_fraction "
                           "or set teacher.monitor=none")
    releases = len(monitor_points(steps_allowed, cfg.log_every))
    try:
        z, accountant = dp_monitor.calibrate(cfg.monitor_epsilon, delta, releases, cfg.accountant)
    except dp_monitor.MonitorError as e:
        raise TeacherError(str(e)) from e
    entry = dp_monitor.ledger_entry(stage, z=z, releases=releases, n=n, clip=cfg.monitor_clip,
                                    target_epsilon=cfg.monitor_epsilon, delta=delta, accountant=accountant,
                                    unit="record" if users is None else "user", secure=cfg.secure_mode)
    return _Monitor("dp", TokenIds(records, cfg.max_length, tok.pad_token_id), n, units, z, entry)


def _monitor_value(run: _Run) -> float:
    """The validation loss to publish at a monitor point: public records' exact mean, or the
    DP release (pipeline/privacy/monitor.py) with noise from the secret monitor generator."""
    m = run.monitor
    losses = _per_record_losses(run.model, m.records, run.cfg.physical_batch_size, run.runtime)  # (R,)
    if m.mode == "public":
        return float(losses.double().mean())
    return dp_monitor.noisy_mean(dp_monitor.unit_means(losses, m.units), run.cfg.monitor_clip, m.z,
                                 run.rngs["monitor"])


def _save_private(path: Path, save) -> None:
    """Atomically write the private checkpoint with `save(file)`, readable by its owner only
    (0600 whatever the umask): it holds the secret noise and sampling generators' states."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file left by an earlier crash
    with os.fdopen(fd, "wb") as f:
        save(f)
    os.replace(tmp, path)  # atomic: a crash never leaves half a checkpoint


def _load_private(path: Path, fingerprint: str, *, module, optimizer, engine: PrivacyEngine) -> dict:
    """Read a checkpoint without running code (weights_only; Opacus' load_checkpoint unpickles
    anything) and apply its module, optimizer and accountant states as Opacus would."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise TeacherError(
            f"{path} holds objects other than tensors and plain containers, so it was not written by "
            "this stage; refusing to load it (unpickling could run code). Delete it to start over"
        ) from e
    if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
        raise TeacherError(
            f"{path} was written by a teacher run with another config, data, base model, "
            "seed, number of processes or version of this stage; resume with the same ones, or "
            "delete it (and the run directory) to start over"
        )
    module.load_state_dict(state["module_state_dict"])
    engine.accountant.load_state_dict(state["privacy_accountant_state_dict"])
    optimizer.load_state_dict(state["optimizer_state_dict"])
    return state


def _fingerprint(
    cfg: TeacherConfig, base_model: str, train_path: Path, seed: int, sigma: float, kd: KnowledgeDistillation | None,
    world_size: int = 1, precision: str = "fp32",
) -> str:
    """What a checkpoint must match to be resumed: same config, data, base model, seed, σ, KD,
    number of data-parallel processes (a DPDDP checkpoint holds wrapped weights and
    per-rank RNG states) and checkpoint layout (2: per-rank secret generator states)."""
    spec = cfg.model_dump(mode="json", exclude={"log_every", "checkpoint_every", "processes", "ddp_backend", *NODE_FIELDS})
    if world_size > 1:
        spec["world_size"] = world_size
    if precision != "fp32":  # not the device: a run may resume on another one
        spec["precision"] = precision
    if cfg.monitor == "dp":  # the releases were counted from log_every; a resumed run must make the same
        spec["log_every"] = cfg.log_every
    spec |= {"checkpoint_format": 2, "base_model": base_model, "train_sha256": sha256_file(train_path),
             "seed": seed, "sigma": sigma,
             "kd": None if kd is None else [str(kd.teacher_dir), kd.alpha, kd.temperature]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


@dataclass
class _Run:
    """One teacher training in progress: what setup builds and the step, checkpoint and save
    functions read. Everything in it is this process's (one rank's) state."""

    cfg: TeacherConfig
    stage: str
    out_dir: Path
    rank: int
    world: int
    runtime: Runtime  # this rank's device, precision and threads
    device: torch.device
    tok: object
    model: torch.nn.Module  # the trainable model, unwrapped
    dp_model: torch.nn.Module  # Opacus' wrapper of it
    optimizer: object  # Opacus' DPOptimizer
    loader: DataLoader  # the Poisson loader, this rank's share
    engine: PrivacyEngine
    rngs: dict  # the secret generators (pipeline/privacy/noise.py): noise, poisson, user_pick
    n: int  # privacy units: records, or users
    n_records: int
    unit: str
    delta: float
    sigma: float
    sampling_probability: float
    sample_rate: float  # as accounted
    total_steps: int
    steps_allowed: int
    fingerprint: str
    monitor: _Monitor | None  # what the published validation loss is computed on (None: not monitored)
    kd: KnowledgeDistillation | None = None
    kd_teacher: torch.nn.Module | None = None
    history: list[dict] = field(default_factory=list)
    resumed_from: int = 0

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT


def _models(cfg: TeacherConfig, base_model: str, kd: KnowledgeDistillation | None, device):
    """Tokenizer, the trainable model (lm_head untied for ghost clipping) and the KD teacher."""
    tok = load_tokenizer(base_model)
    model = load_causal_lm(base_model)
    untie_lm_head(model)
    n_positions = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    if cfg.max_length > n_positions:
        raise TeacherError(
            f"teacher.max_length={cfg.max_length} exceeds the model's {n_positions} positions; "
            f"set teacher.max_length <= {n_positions}"
        )
    model = prepare_trainable(model, cfg).to(device)
    kd_teacher = load_causal_lm(str(kd.teacher_dir)).eval().to(device) if kd else None
    if kd_teacher is not None and not same_tokenizer(tok, load_tokenizer(str(kd.teacher_dir))):
        raise TeacherError(f"the KD teacher {kd.teacher_dir} uses another tokenizer than {base_model!r}")
    return tok, model, kd_teacher


def _setup(cfg: TeacherConfig, *, train_path: Path, validation_path: Path, monitor_path: Path | None,
           base_model: str, out_dir: Path, seed: int, stage: str, kd: KnowledgeDistillation | None,
           runtime: Runtime) -> _Run:
    """Models, the private data behind secret Poisson sampling, σ, and Opacus' engine."""
    rank, world = _world()
    device = runtime.device  # a data-parallel rank's own: cuda:local_rank on nccl (ddp_worker)
    torch.manual_seed(seed + rank)  # dropout; DP randomness comes from the secret generators below
    np.random.seed(seed)
    tok, model, kd_teacher = _models(cfg, base_model, kd, device)
    users = read_users(train_path)
    # Memory-mapped Arrow ids, tokenized once per run (pipeline/tokenized.py); each batch is
    # padded to its own longest record by the collate below.
    records = TokenIds(token_column(tokenized_split(train_path, tok)), cfg.max_length, tok.pad_token_id)
    # Secret, per rank (pipeline/privacy/noise.py). The Poisson generator takes no rank: secret, it
    # is independent on every rank anyway; under the test hook it is the same on every rank,
    # so that data-parallel runs draw exactly the single-process sample.
    rngs = {"noise": noise.generator("noise", secure=cfg.secure_mode, rank=rank, device=device),
            "poisson": noise.generator("poisson", secure=cfg.secure_mode),
            "user_pick": noise.generator("user_pick", secure=cfg.secure_mode, rank=rank)}
    if cfg.monitor == "dp":  # the validation-loss noise: rank 0 draws it, saved with the others
        rngs["monitor"] = noise.generator("monitor", secure=cfg.secure_mode)
    train = records if users is None else OneRecordPerUser(records, users, rngs["user_pick"])
    unit, n = ("record" if users is None else "user"), len(train)
    sampling_probability, sample_rate, total_steps = poisson_schedule(n, cfg.batch_size, cfg.epochs, unit)
    delta = privacy.resolve_delta(cfg.target_delta, n)
    if weak := privacy.weak_delta_warning(delta, n, unit, stage):
        log.warning("%s", weak)
    if not cfg.secure_mode:
        log.warning(
            "%s: secure_mode is off: DP noise and sampling come from torch's mt19937 seeded from OS "
            "entropy, unpredictable from anything published but not a cryptographic generator; set "
            "teacher.secure_mode=true (ChaCha20) for a production release", stage,
        )
    # Poisson sampling set up as make_private would, but here (poisson_schedule says why).
    dp_loader = DPDataLoader.from_data_loader(  # wraps the collate for empty batches
        DataLoader(train, batch_size=cfg.batch_size, collate_fn=records.collate))
    # Each rank trains on its share of the global Poisson draw (all of it in one process),
    # drawn from the secret generator. A DataLoader also draws a base seed for its workers
    # from its own `generator` at every new iterator: a public one of its own, so a resumed
    # run (one extra iterator) consumes neither the sampler's stream nor dropout's.
    share = RankShareSampler(num_samples=n, sample_rate=sampling_probability, generator=rngs["poisson"],
                             rank=rank, world_size=world,
                             arrange=shortest_first(records.lengths(), None if users is None else train))
    poisson_loader = DataLoader(train, batch_sampler=share, collate_fn=dp_loader.collate_fn,
                                generator=torch.Generator().manual_seed(seed + 1))
    assert cfg.epochs * len(poisson_loader) == total_steps and dp_loader.sample_rate == sampling_probability
    sigma, steps_allowed = calibrate_noise(cfg, sample_rate, total_steps, delta)
    if steps_allowed < total_steps:
        log.warning(
            "%s: σ=%.4f would exceed ε=%.2f after step %d of %d (calibration tolerance); "
            "training stops there", stage, sigma, cfg.target_epsilon, steps_allowed, total_steps,
        )

    model.train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    )
    with warnings.catch_warnings():  # its "Secure RNG turned off": our generators are secret (warned above)
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        # Opacus' own secure_mode needs torchcsprng (no release for current torch): secure
        # noise comes from the noise generator instead, through pipeline/privacy/noise.py's dispatcher.
        engine = BookKeepingPrivacyEngine(accountant=cfg.accountant, secure_mode=False)
    made = engine.make_private(
        # DPDDP: make_private then picks Opacus' Distributed(FastGradientClipping)DPOptimizer,
        # whose step adds the noise on rank 0 only, all-reduces the sum of the ranks' clipped
        # gradients and divides by the global expected batch (per-rank expected batch × W).
        module=DPDDP(model) if world > 1 else model, optimizer=optimizer, data_loader=poisson_loader,
        noise_multiplier=sigma, max_grad_norm=cfg.max_grad_norm,
        poisson_sampling=False,  # the loader above already samples with Poisson
        noise_generator=rngs["noise"], grad_sample_mode=cfg.grad_sample_mode,
        # ghost: Opacus wraps a criterion it needs; our steps call CLIPPING["ghost"] instead
        **({"criterion": torch.nn.CrossEntropyLoss(ignore_index=IGNORE)} if cfg.grad_sample_mode == "ghost" else {}),
    )
    dp_model, dp_optimizer, loader = made[0], made[1], made[-1]
    dp_model.forbid_grad_accumulation()  # what make_private does for Poisson sampling

    monitor = _setup_monitor(cfg, tok, validation_path=validation_path, monitor_path=monitor_path, stage=stage,
                             steps_allowed=steps_allowed, delta=delta)
    return _Run(
        cfg=cfg, stage=stage, out_dir=Path(out_dir), rank=rank, world=world, runtime=runtime, device=device, tok=tok,
        model=model,
        dp_model=dp_model, optimizer=dp_optimizer, loader=loader, engine=engine, rngs=rngs, n=n,
        n_records=len(records), unit=unit, delta=delta, sigma=sigma, sampling_probability=sampling_probability,
        sample_rate=sample_rate, total_steps=total_steps, steps_allowed=steps_allowed,
        fingerprint=_fingerprint(cfg, base_model, Path(train_path), seed, sigma, kd, world, runtime.precision),
        monitor=monitor, kd=kd, kd_teacher=kd_teacher,
    )


def _resume(run: _Run) -> None:
    """Continue from the checkpoint of an interrupted run with the same fingerprint, if any:
    model, optimizer, accountant and the generators go on from where they were."""
    if not run.checkpoint_path.is_file():
        return
    state = _load_private(run.checkpoint_path, run.fingerprint, module=run.dp_model, optimizer=run.optimizer,
                          engine=run.engine)
    own = state["rank_rngs"][run.rank]
    for name, rng in run.rngs.items():
        noise.set_state(rng, own[f"{name}_rng"])
    torch.set_rng_state(own["torch_rng"])
    run.history = state["history"]
    run.resumed_from = _steps_accounted(run.engine)
    log.info("%s: resuming at step %d/%d, ε so far %.3f", run.stage, run.resumed_from, run.total_steps,
             run.engine.get_epsilon(run.delta) if run.resumed_from else 0.0)


def _save_checkpoint(run: _Run) -> None:
    """Rank 0 writes model, optimizer, accountant and every rank's generator states (0600)."""
    rngs = {f"{name}_rng": noise.get_state(rng) for name, rng in run.rngs.items()}
    rngs["torch_rng"] = torch.get_rng_state()
    rank_rngs = [rngs]
    if run.world > 1:  # the ranks' generators differ (noise, user picks, dropout): rank 0 saves them all
        rank_rngs = [None] * run.world
        dist.all_gather_object(rank_rngs, rngs)
    if run.rank != 0:
        return
    _save_private(run.checkpoint_path, lambda f: run.engine.save_checkpoint(
        path=f, module=run.dp_model, optimizer=run.optimizer,
        checkpoint_dict={"fingerprint": run.fingerprint, "rank_rngs": rank_rngs, "history": run.history},
    ))


def _step(run: _Run, ids: torch.Tensor, lengths: torch.Tensor) -> None:
    """One physical batch: per-example losses, the clipping mode's backward, Opacus' step
    (which only accumulates until the logical batch is complete)."""
    if ids.shape[0] == 0:
        _noise_only_step(run.dp_model, run.optimizer, run.cfg.grad_sample_mode)
        return
    batch = {k: v.to(run.device) for k, v in lm_batch(ids, lengths).items()}
    labels = batch.pop("labels")
    with run.runtime.autocast():  # forward only; fp32 master weights, losses upcast to fp32
        logits = run.dp_model(**batch).logits  # (B, L, V)
        if run.kd_teacher is not None:
            with torch.no_grad():
                t_logits = run.kd_teacher(**batch).logits  # (B, L, V)
    if run.kd_teacher is None:
        per_example = per_sequence_loss(logits, labels)  # (B,)
    else:
        vocab = min(logits.shape[-1], t_logits.shape[-1])
        per_example = per_sequence_distillation_loss(
            logits[:, :-1, :vocab].float(), t_logits[:, :-1, :vocab].float(), labels, alpha=run.kd.alpha,
            temperature=run.kd.temperature,
        )  # (B,)
    CLIPPING[run.cfg.grad_sample_mode](run.dp_model, run.optimizer, per_example)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def _record_step(run: _Run, t0: float) -> dict:
    """What a finished logical step publishes: public quantities and, at monitor points, ε and
    the validation loss as teacher.monitor says (none: no loss at all; dp: only the noisy
    release); never the private batch's loss or size (a function of the records drawn,
    released without noise). A time (the log line, `seconds`) only where `publishes_time`,
    which is always a monitor point, so the line has them."""
    done = _steps_accounted(run.engine)
    record = {"step": done}
    timed = publishes_time(done, run.steps_allowed)
    if run.rank == 0 and is_monitor_point(done, run.steps_allowed, run.cfg.log_every):
        # Plain floats: the history goes into the checkpoint, which is read back with
        # weights_only=True, and that refuses a numpy scalar (the PRV accountant's ε).
        record["epsilon"] = float(run.engine.get_epsilon(run.delta))
        if run.monitor is not None:
            record["validation_loss"] = float(_monitor_value(run))
    if run.rank == 0 and timed:
        record["seconds"] = round(time.time() - t0, 1)
        loss = f" validation loss {record['validation_loss']:.4f}" if "validation_loss" in record else ""
        log.info("%s: step %d/%d ε=%.3f%s (%.0f s)", run.stage, done, run.steps_allowed, record["epsilon"], loss,
                 record["seconds"])
    run.history.append(record)
    return record


def _ledger_entry(run: _Run) -> LedgerEntry:
    """The release, as the accountant saw it; refused if ε ended above the target."""
    cfg, steps, epsilon = run.cfg, _steps_accounted(run.engine), run.engine.get_epsilon(run.delta)
    assert steps == run.steps_allowed, (steps, run.steps_allowed)
    assert {q for _, q, _ in run.engine.accountant.history} == {run.sample_rate}
    if epsilon > cfg.target_epsilon:
        raise TeacherError(
            f"accountant reports ε={epsilon:.4f} above the target {cfg.target_epsilon}; "
            "refusing to release this teacher"
        )
    accounted = [(run.sigma, run.sample_rate, steps)]
    kd, unit = run.kd, run.unit
    return with_pld_epsilons(LedgerEntry(
        stage=run.stage, private=True, epsilon=epsilon, delta=run.delta, accountant=cfg.accountant,
        mechanism="subsampled_gaussian", noise_multiplier=run.sigma, sample_rate=run.sample_rate, steps=steps,
        max_grad_norm=cfg.max_grad_norm, privacy_unit=unit,
        epsilon_rdp=privacy.epsilon_of("rdp", accounted, run.delta), history=accounted,
        noise_source=noise.source(cfg.secure_mode),
        note=f"{unit}-level DP-SGD ({cfg.mode}, {cfg.grad_sample_mode} clipping) on the private "
        f"training split (N={run.n} {unit}s"
        + ("" if unit == "record" else f", {run.n_records} records; one random record per sampled user per step")
        + f"), Poisson sampling with probability {run.sampling_probability:.6g} (accounted as "
        f"q={run.sample_rate:.6g}), lm_head untied from the input embedding; σ calibrated by Opacus "
        f"for target ε={cfg.target_epsilon}"
        + ("; gdp is a CLT approximation, not a guaranteed bound" if cfg.accountant == "gdp" else "")
        + (f"; KD loss (α={kd.alpha}, T={kd.temperature}) from the DP teacher" if kd else "")
        + (f"; data-parallel over {run.world} processes (Opacus DPDDP: each samples its share of the "
           "global Poisson batch, noise added once, by rank 0)" if run.world > 1 else "")
        + _monitor_note(run),
        validation_monitor=cfg.monitor,
    ))


def _monitor_note(run: _Run) -> str:
    """What the stage's published validation loss is computed from, for its ledger note."""
    if run.cfg.monitor == "none":
        return ("; no figure computed from the validation split is published (teacher.monitor=none: no "
                "validation loss)")
    if run.cfg.monitor == "dp":
        return f"; its validation loss is released with DP, see {run.monitor.entry.stage}"
    return (f"; its validation loss is computed on public data, {run.monitor.n} records the user declared "
            f"public (teacher.monitor_path={str(run.cfg.monitor_path)!r}), and published without noise; "
            "the private validation split is not read")


def _save(run: _Run, entry: LedgerEntry, *, train_path: Path, validation_path: Path, monitor_path: Path | None,
          base_model: str) -> TeacherResult:
    """Rank 0 writes the plain checkpoint (LoRA merged), accountant state, training log and,
    last, the manifest; then deletes the resume checkpoint. The final validation loss is the
    last monitor point's, the final model's: no further release (monitor=dp counted it)."""
    run.dp_model._close()  # remove Opacus hooks and per-sample state before saving
    out_dir, ckpt, curve = run.out_dir, run.out_dir / "model", _validation_curve(run.history)
    final_loss = curve[-1][1] if curve else None
    monitor_entry = run.monitor.entry if run.monitor is not None else None
    result = TeacherResult(checkpoint=ckpt, ledger=entry, validation_curve=curve, validation_loss=final_loss,
                           resumed_from_step=run.resumed_from, monitor_ledger=monitor_entry)
    if run.rank != 0:  # rank 0 writes the stage's files
        return result
    model = run.model.merge_and_unload() if run.cfg.mode == "lora" else run.model  # a plain checkpoint
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval().save_pretrained(ckpt)  # from the run's device: safetensors are device-free
    run.tok.save_pretrained(ckpt)
    torch.save({"accountant": run.engine.accountant.state_dict(), "mechanism": run.engine.accountant.mechanism()},
               out_dir / "accountant_state.pt")
    training_log = {"history": run.history, "monitor": run.cfg.monitor, "resumed_from_step": run.resumed_from}
    if final_loss is not None:
        training_log["validation_loss"] = final_loss
    atomic_write_json(out_dir / "training_log.json", training_log)
    read = {"dp": {"validation": validation_path}, "public": {"monitor": monitor_path}}.get(run.cfg.monitor, {})
    extra = {"base_model": base_model, "ledger": entry.model_dump()}
    if monitor_entry is not None:
        extra["monitor_ledger"] = monitor_entry.model_dump()
    write_manifest(out_dir, stage=run.stage, inputs={"train": train_path, **read},
                   outputs={"model": ckpt, "accountant_state": out_dir / "accountant_state.pt"}, extra=extra)
    shutil.rmtree(run.checkpoint_path.parent, ignore_errors=True)  # finished: the manifest now says so
    return result


def train_teacher(
    cfg: TeacherConfig,
    *,
    train_path: Path,
    validation_path: Path,
    base_model: str,
    out_dir: Path,
    seed: int,
    on_progress: Callable[[dict], None] | None = None,
    stage: str = "teacher",
    kd: KnowledgeDistillation | None = None,
    progress_every: float = DEFAULT_EVERY,
    runtime: Runtime = CPU_FP32,
    monitor_path: Path | None = None,
) -> TeacherResult:
    """DP fine-tune `base_model` on the private training split; save it to `out_dir/model`.

    `validation_path` is read only with `cfg.monitor` = dp; `monitor_path` (monitor=public) is
    the user's public records formatted as a split (pipeline/stages/data.py format_public_split).

    `on_progress` receives each logical step's record after the step and its checkpoint:
    step and done/total steps, plus ε (and the validation loss, per `cfg.monitor`) every `log_every` steps and
    elapsed seconds every TIMING_WINDOW_STEPS; never anything computed from a private batch.
    An exception raised there interrupts training like a crash. It is called every step (to
    stop promptly): publish its calls' times only where `publishes_time` (flows/progress.py).
    A progress line (steps, steps/s, ε spent, elapsed, ETA) is logged every
    TIMING_WINDOW_STEPS steps, at most every `progress_every` seconds, and at the end.

    `cfg.processes` > 1 outside a process group: runs `ddp_worker` under torchrun
    (pipeline/stages/teacher_ddp.py) and returns the finished stage. Inside an initialised process
    group of W > 1 ranks: trains data-parallel (DPDDP); rank 0 alone writes the checkpoints,
    model, ledger and manifest, and the other ranks return the same ledger entry.

    `runtime` (pipeline/devices.py): the device, precision (bf16: forward passes under
    autocast, fp32 master weights and losses) and CPU threads of this process.
    """
    paths = dict(train_path=Path(train_path), validation_path=Path(validation_path), base_model=base_model,
                 monitor_path=None if monitor_path is None else Path(monitor_path))
    if (cfg.processes > 1 or cfg.nnodes > 1) and _world()[1] == 1:
        return _train_data_parallel(cfg, out_dir=Path(out_dir), seed=seed, on_progress=on_progress, stage=stage,
                                    kd=kd, progress_every=progress_every, runtime=runtime, **paths)
    runtime.apply_threads()
    run = _setup(cfg, out_dir=out_dir, seed=seed, stage=stage, kd=kd, runtime=runtime, **paths)
    if run.world > 1 and cfg.nnodes == 1 and run.world != cfg.processes:
        log.warning("%s: teacher.processes=%d but the process group has %d ranks; training on %d",
                    stage, cfg.processes, run.world, run.world)
    _resume(run)
    log.info(
        "%s: N=%d %ss, q=%.4f, %d steps, σ=%.4f, C=%.2f, target ε=%.2f, δ=%.3g, mode %s, %s clipping, "
        "%d trainable parameters%s", stage, run.n, run.unit, run.sample_rate, run.total_steps, run.sigma,
        cfg.max_grad_norm, cfg.target_epsilon, run.delta, cfg.mode, cfg.grad_sample_mode,
        sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        f", data-parallel rank {run.rank} of {run.world}" if run.world > 1 else "",
    )
    t0, done = time.time(), run.resumed_from
    # Steps, ε and time only: the size or token count of a Poisson batch is private, and so is
    # one step's duration: lines only every TIMING_WINDOW_STEPS steps.
    steps_log = ProgressLog(log, stage, "steps", run.steps_allowed, every=progress_every, done=run.resumed_from,
                            window=TIMING_WINDOW_STEPS)
    while done < run.steps_allowed:
        with BatchMemoryManager(data_loader=run.loader, max_physical_batch_size=cfg.physical_batch_size,
                                optimizer=run.optimizer) as physical_loader:
            for ids, lengths in physical_loader:
                _step(run, ids, lengths)
                if run.optimizer._is_last_step_skipped:
                    continue  # logical batch not finished yet
                record = _record_step(run, t0)
                done = record["step"]
                if done % cfg.checkpoint_every == 0 and done < run.steps_allowed:
                    _save_checkpoint(run)
                if run.rank == 0 and steps_log.due(done):
                    spent = record["epsilon"] if "epsilon" in record else run.engine.get_epsilon(run.delta)
                    steps_log.update(done, values={"ε": f"{spent:.3f}"})
                if on_progress and run.rank == 0:
                    on_progress({**record, "done": done, "total": run.steps_allowed})
                if done >= run.steps_allowed:
                    break
    return _save(run, _ledger_entry(run), **paths)


def _train_data_parallel(cfg: TeacherConfig, *, out_dir: Path, on_progress, stage: str,
                         kd: KnowledgeDistillation | None, progress_every: float, runtime: Runtime,
                         **job) -> TeacherResult:
    """`cfg.processes` ranks under torchrun, each running `ddp_worker`; the result is read
    back from the finished stage, the same TeacherResult as one process returns. Ranks on
    nccl get one GPU each (cuda:local_rank), on gloo the CPU; each its share of the cores."""
    if cfg.node_rank != 0:
        raise TeacherError(f"{stage}: teacher.node_rank={cfg.node_rank}: the flow runs on node 0 only; on this "
                           "node run `dpdistill join-teacher` with the same config and node_rank")
    threads = runtime.threads_for(cfg.processes)
    rank_runtime = Runtime(runtime.for_ddp(cfg.ddp_backend).device, runtime.precision, threads)
    args = {"runtime": rank_runtime.to_json(),
            "config": cfg.model_dump(mode="json"), "out_dir": str(out_dir.resolve()), "stage": stage,
            "train_path": str(job["train_path"].resolve()), "validation_path": str(job["validation_path"].resolve()),
            "monitor_path": None if job["monitor_path"] is None else str(job["monitor_path"].resolve()),
            "base_model": job["base_model"], "seed": job["seed"], "progress_every": progress_every,
            "kd": None if kd is None else {"teacher_dir": str(Path(kd.teacher_dir).resolve()), "alpha": kd.alpha,
                                           "temperature": kd.temperature}}
    teacher_ddp.launch(args, target="pipeline.stages.teacher:ddp_worker", processes=cfg.processes,
                       backend=cfg.ddp_backend, threads=threads, work=out_dir / teacher_ddp.WORKDIR, stage=stage,
                       on_progress=on_progress, error=TeacherError, nodes=nodes(cfg))
    result = finished_teacher(out_dir)
    if result is None:
        raise TeacherError(f"{stage}: torchrun exited cleanly but {out_dir} holds no finished teacher; "
                           f"see {out_dir / teacher_ddp.WORKDIR}")
    return result


def nodes(cfg: TeacherConfig, job_id: str = "dpdistill") -> teacher_ddp.Nodes:
    """The machines of a data-parallel teacher (one unless `cfg.nnodes` > 1)."""
    return teacher_ddp.Nodes(cfg.nnodes, cfg.rdzv_endpoint, job_id, cfg.rdzv_timeout)


def ddp_worker(args: dict, on_progress: Callable[[dict], None] | None) -> None:
    """One torchrun rank (pipeline/stages/teacher_ddp.py calls it inside the process group)."""
    kd = args["kd"]
    runtime = Runtime.from_json(args["runtime"])  # on nccl "cuda": this rank's GPU, set by teacher_ddp.main
    runtime = runtime.for_rank(int(os.environ.get("LOCAL_RANK", 0)))
    train_teacher(
        TeacherConfig.model_validate(args["config"]), train_path=Path(args["train_path"]),
        validation_path=Path(args["validation_path"]), base_model=args["base_model"], out_dir=Path(args["out_dir"]),
        monitor_path=Path(args["monitor_path"]) if args.get("monitor_path") else None,
        seed=args["seed"], on_progress=on_progress, stage=args["stage"],
        progress_every=args.get("progress_every", DEFAULT_EVERY), runtime=runtime,
        kd=None if kd is None else KnowledgeDistillation(Path(kd["teacher_dir"]), kd["alpha"], kd["temperature"]),
    )


def _validation_curve(history: list[dict]) -> list[tuple[int, float]]:
    return [(h["step"], h["validation_loss"]) for h in history if "validation_loss" in h]


def finished_teacher(out_dir: Path) -> TeacherResult | None:
    """The result of a teacher already finished in `out_dir` (manifest present and every
    output matching its hash), else None. Training it again would spend the budget twice."""
    manifest_path = Path(out_dir) / MANIFEST
    if not manifest_path.is_file():
        return None
    if problems := manifest_problems(out_dir):
        raise TeacherError(
            f"{manifest_path} lists outputs that are missing or changed ({'; '.join(problems[:3])}); the "
            "finished teacher cannot be trusted: use a new run directory"
        )
    manifest = json.loads(manifest_path.read_text())
    log_ = json.loads((Path(out_dir) / "training_log.json").read_text())
    return TeacherResult(
        checkpoint=Path(out_dir) / "model",
        ledger=LedgerEntry.model_validate(manifest["ledger"]),
        validation_curve=_validation_curve(log_["history"]),
        validation_loss=log_.get("validation_loss"),
        resumed_from_step=log_["resumed_from_step"],
        monitor_ledger=LedgerEntry.model_validate(manifest["monitor_ledger"]) if "monitor_ledger" in manifest else None,
    )
