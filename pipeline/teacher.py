"""Stage 1: DP-SGD fine-tuning of the teacher on the private records, with Opacus 1.6.

Opacus is used as its API intends: `get_noise_multiplier` calibrates σ from the target
(ε, δ), the sampling rate and the exact number of steps; `PrivacyEngine.make_private`
wraps model, optimizer and the Poisson loader; BatchMemoryManager splits large logical
batches into physical ones. ε in the ledger is what the accountant says after the last
step, and training stops before a step that would exceed the target.

Modes: `full` (every weight), `bitfit` (bias terms only, DP-BiTFiT), `lora` (peft
adapters, merged into the saved checkpoint). Clipping: `ghost` (Li et al. 2021: per-example
norms without per-example gradients; GPT-2 needs an untied `lm_head` and explicit
contiguous (B, T) `position_ids`) or `hooks` (Opacus' per-sample gradients, the reference).

Secret randomness: the DP noise, the Poisson sample and the record picked for each sampled
user come from generators keyed with OS entropy (pipeline/noise.py), never from `seed`,
which is published with the config; `seed` drives the rest (dropout, data order). With
`secure_mode` they come from a ChaCha20 CSPRNG.

What is published per step is a function of public quantities only (step, ε spent, elapsed
time) plus, every `log_every` steps, the model's loss on the validation split (held out,
not protected). The loss and size of a private Poisson batch are never published.

Crash-safe budget: every `checkpoint_every` steps the model, optimizer, accountant and
RNG states are saved atomically to `out_dir/checkpoint/state.pt` (mode 0600: it holds the
secret generators' states; deleted when the stage finishes). Run again into the same
`out_dir`, training resumes at the saved step with the saved accountant and generators: it
neither restarts the accountant (under-counting) nor repeats steps already counted. The
checkpoint is read with `weights_only=True`: a planted file cannot run code.

Data-parallel (`processes` > 1): `train_teacher` starts itself under torchrun
(pipeline/teacher_ddp.py); inside the process group every rank runs this same function on
its share of each Poisson draw, Opacus' DPDDP optimizers add the noise once (rank 0) and
all-reduce, and the accountant sees the global batch, exactly as in one process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
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
from opacus.accountants.utils import get_noise_multiplier
from opacus.data_loader import DPDataLoader
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch.utils.data import DataLoader, Dataset

from pipeline import noise, privacy
from pipeline.batching import IGNORE, TokenizedRecords, lm_batch
from pipeline.config import TeacherConfig
from pipeline.data import encode_record, read_split, read_users
from pipeline.evaluate import perplexity
from pipeline.ledger import LedgerEntry
from pipeline.manifest import MANIFEST, atomic_write_json, manifest_problems, sha256_file, write_manifest
from pipeline.losses import per_sequence_distillation_loss
from pipeline.models import load_causal_lm, load_tokenizer, same_tokenizer, untie_lm_head

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint/state.pt"
VALIDATION_MONITOR_RECORDS = 64  # validation records scored every log_every steps


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
    """(step, loss on the first validation records) every log_every steps; never a training loss."""
    validation_loss: float = float("nan")
    resumed_from_step: int = 0


def per_sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of each sequence: logits (B, L, V), labels (B, L-1) -> (B,)."""
    logits = logits[:, :-1]  # (B, L-1, V)
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="none"
    ).view(labels.shape)  # (B, L-1)
    valid = (labels != IGNORE).sum(1).clamp(min=1)  # (B,)
    return nll.sum(1) / valid


class OneRecordPerUser(Dataset):
    """User-level DP: the dataset's units are users; each draw returns one of the user's
    records, chosen at random. Poisson sampling over users then gives every sampled user
    exactly one clipped contribution per step, and the accountant counts users
    (author-level sampling, as in dp-transformers)."""

    def __init__(self, records: TokenizedRecords, users: list[str], generator: noise.Generator):
        by_user: dict[str, list[int]] = {}
        for i, u in enumerate(users):
            by_user.setdefault(u, []).append(i)
        self.records = records
        self.groups = [torch.tensor(v) for _, v in sorted(by_user.items())]
        self.generator = generator

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, u):
        group = self.groups[u]
        pick = group[noise.randbelow(self.generator, len(group))].item()
        return self.records[pick]


class RankShareSampler(UniformWithReplacementSampler):
    """Poisson sampling for rank `rank` of `world_size` data-parallel processes.

    Each step draws every record with probability q, as one process would, and this rank
    keeps the drawn records it owns (index % world_size == rank): the union over ranks is
    one Poisson sample of the whole dataset. With the same generator seed on every rank it
    is exactly the single-process sample (the test hook of pipeline/noise.py); with
    independent secret generators each record is still drawn once, by its owner. Every rank
    yields every step, empty or not, so the ranks step and all-reduce together (Opacus'
    DistributedUniformWithReplacementSampler skips empty local batches, which would leave
    the ranks a step apart). The generator may be a torch.Generator or the ChaCha20 CSPRNG.
    One process is rank 0 of 1.
    """

    def __init__(self, *, num_samples: int, sample_rate: float, generator, rank: int = 0, world_size: int = 1):
        super().__init__(num_samples=num_samples, sample_rate=sample_rate, generator=generator)
        self.rank, self.world_size = rank, world_size

    def __iter__(self):
        for _ in range(self.steps):
            drawn = (noise.uniform(self.generator, self.num_samples) < self.sample_rate).nonzero().view(-1)
            yield [i for i in drawn.tolist() if i % self.world_size == self.rank]


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


def _noise_only_step(model: torch.nn.Module, optimizer, mode: str) -> None:
    """Poisson sampling drew an empty logical batch (for this rank): the step still happens
    (noise only; under DDP the rank still joins the all-reduce), so the accountant's step
    count matches what was released."""
    for p in model.parameters():
        if p.requires_grad:
            if mode == "ghost":
                p.grad = torch.zeros_like(p)
            else:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
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
def _validation_loss(model: torch.nn.Module, records: TokenizedRecords, batch_size: int, device) -> float:
    """Mean per-record loss on held-out validation records (forward only, eval mode): the
    training progress that is safe to publish, unlike the loss of a private batch."""
    if len(records) == 0:
        return float("nan")
    model.eval()
    total = 0.0
    for ids, lengths in DataLoader(records, batch_size=batch_size):
        batch = {k: v.to(device) for k, v in lm_batch(ids, lengths).items()}
        labels = batch.pop("labels")
        total += per_sequence_loss(model(**batch).logits, labels).sum().item()
    model.train()
    return total / len(records)


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
    world_size: int = 1,
) -> str:
    """What a checkpoint must match to be resumed: same config, data, base model, seed, σ, KD,
    number of data-parallel processes (a DPDDP checkpoint holds wrapped weights and
    per-rank RNG states) and checkpoint layout (2: per-rank secret generator states)."""
    spec = cfg.model_dump(mode="json", exclude={"log_every", "checkpoint_every", "processes", "ddp_backend"})
    if world_size > 1:
        spec["world_size"] = world_size
    spec |= {"checkpoint_format": 2, "base_model": base_model, "train_sha256": sha256_file(train_path),
             "seed": seed, "sigma": sigma,
             "kd": None if kd is None else [str(kd.teacher_dir), kd.alpha, kd.temperature]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


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
) -> TeacherResult:
    """DP fine-tune `base_model` on the private training split; save it to `out_dir/model`.

    `on_progress` receives each logical step's record after the step and its checkpoint:
    step and done/total steps, plus ε, the validation loss and elapsed seconds every
    `log_every` steps; never anything computed from a private batch. An exception raised
    there interrupts training like a crash.

    `cfg.processes` > 1 outside a process group: runs itself under torchrun and returns
    the finished stage. Inside an initialised process group of W > 1 ranks: trains
    data-parallel (DPDDP); rank 0 alone writes the checkpoints, model, ledger and
    manifest, and the other ranks return the same ledger entry without writing anything.
    """
    rank, world = _world()
    if cfg.processes > 1 and world == 1:
        from pipeline.teacher_ddp import launch

        return launch(cfg, train_path=train_path, validation_path=validation_path, base_model=base_model,
                      out_dir=out_dir, seed=seed, on_progress=on_progress, stage=stage, kd=kd)
    if world > 1 and world != cfg.processes:
        log.warning("%s: teacher.processes=%d but the process group has %d ranks; training on %d",
                    stage, cfg.processes, world, world)
    device = torch.device("cpu")
    if world > 1 and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(seed + rank)  # dropout; DP randomness comes from the secret generators below
    np.random.seed(seed)
    out_dir = Path(out_dir)
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

    codes, texts = read_split(train_path)
    users = read_users(train_path)
    records = TokenizedRecords(
        [encode_record(tok, c, t, cfg.max_length) for c, t in zip(codes, texts)], tok.pad_token_id, cfg.max_length
    )
    # Secret, per rank (pipeline/noise.py). The Poisson generator takes no rank: secret, it
    # is independent on every rank anyway; under the test hook it is the same on every rank,
    # so that data-parallel runs draw exactly the single-process sample.
    noise_rng = noise.generator("noise", secure=cfg.secure_mode, rank=rank, device=device)
    poisson_rng = noise.generator("poisson", secure=cfg.secure_mode)
    user_pick = noise.generator("user_pick", secure=cfg.secure_mode, rank=rank)
    train = records if users is None else OneRecordPerUser(records, users, user_pick)
    unit = "record" if users is None else "user"
    n = len(train)  # privacy units: records, or users
    if cfg.batch_size >= n:
        raise TeacherError(
            f"teacher.batch_size={cfg.batch_size} is not smaller than the {n} training {unit}s; "
            "Poisson sampling needs a sampling rate below 1: lower teacher.batch_size"
        )
    delta = privacy.resolve_delta(cfg.target_delta, n)
    if weak := privacy.weak_delta_warning(delta, n, unit, stage):
        log.warning("%s", weak)
    if not cfg.secure_mode:
        log.warning(
            "%s: secure_mode is off: DP noise and sampling come from torch's mt19937 seeded from OS "
            "entropy, unpredictable from anything published but not a cryptographic generator; set "
            "teacher.secure_mode=true (ChaCha20) for a production release", stage,
        )

    loader = DataLoader(train, batch_size=cfg.batch_size, shuffle=False)
    model.train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    )
    with warnings.catch_warnings():  # its "Secure RNG turned off": our generators are secret (warned above)
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        # Opacus' own secure_mode needs torchcsprng (no release for current torch): secure
        # noise comes from noise_rng instead, through pipeline/noise.py's dispatcher.
        engine = PrivacyEngine(accountant=cfg.accountant, secure_mode=False)
    # Poisson sampling set up as make_private would, but here, so that σ is calibrated for
    # exactly the steps that run and the rate the accountant records. Opacus' sampler runs
    # int(1 / q) steps per epoch and make_private accounts q' = 1 / steps >= q (for q = 1/99:
    # 98 steps accounted at 1/98). make_private_with_epsilon calibrates for
    # int(epochs / q) steps instead, which can differ by one and overspend the budget.
    dp_loader = DPDataLoader.from_data_loader(loader)  # its rate and empty-batch collate
    sampling_probability = dp_loader.sample_rate
    # Each rank trains on its share of the global Poisson draw (all of it in one process),
    # drawn from the secret `poisson_rng`. A DataLoader also draws a base seed for its
    # workers from its own `generator` at every new iterator: a public one of its own, so a
    # resumed run (one extra iterator) consumes neither the sampler's stream nor dropout's.
    share = RankShareSampler(
        num_samples=n, sample_rate=sampling_probability, generator=poisson_rng, rank=rank, world_size=world
    )
    poisson_loader = DataLoader(train, batch_sampler=share, collate_fn=dp_loader.collate_fn,
                                generator=torch.Generator().manual_seed(seed + 1))
    sample_rate = 1.0 / len(poisson_loader)  # the rate make_private hands the accountant
    total_steps = cfg.epochs * len(poisson_loader)
    try:
        sigma = get_noise_multiplier(
            target_epsilon=cfg.target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=total_steps,
            accountant=cfg.accountant,
        )
        steps_allowed = privacy.max_steps_within_budget(
            cfg.accountant, sigma, sample_rate, delta, cfg.target_epsilon, total_steps
        )
    except Exception as e:  # the accountants fail in several ways on extreme (q, steps)
        raise TeacherError(
            f"the {cfg.accountant} accountant could not calibrate the noise for "
            f"ε={cfg.target_epsilon}, δ={delta:.3g}, q={sample_rate:.4g}, {total_steps} steps "
            f"({type(e).__name__}: {e}). Raise teacher.target_epsilon, lower teacher.epochs, "
            "lower teacher.batch_size (a smaller sampling rate), or try teacher.accountant=rdp"
        ) from e
    if steps_allowed < total_steps:
        log.warning(
            "%s: σ=%.4f would exceed ε=%.2f after step %d of %d (calibration tolerance); "
            "training stops there", stage, sigma, cfg.target_epsilon, steps_allowed, total_steps,
        )

    private = dict(
        # DPDDP: make_private then picks Opacus' Distributed(FastGradientClipping)DPOptimizer,
        # whose step adds the noise on rank 0 only, all-reduces the sum of the ranks' clipped
        # gradients and divides by the global expected batch (per-rank expected batch × W).
        module=DPDDP(model) if world > 1 else model,
        optimizer=optimizer,
        data_loader=poisson_loader,
        noise_multiplier=sigma,
        max_grad_norm=cfg.max_grad_norm,
        poisson_sampling=False,  # the loader above already samples with Poisson
        noise_generator=noise_rng,
        grad_sample_mode=cfg.grad_sample_mode,
    )
    if cfg.grad_sample_mode == "ghost":
        private["criterion"] = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
        dp_model, optimizer, criterion, loader = engine.make_private(**private)
    else:
        dp_model, optimizer, loader = engine.make_private(**private)
        criterion = None
    dp_model.forbid_grad_accumulation()  # what make_private does for Poisson sampling

    # Resume from a checkpoint of an interrupted run with the same fingerprint.
    ckpt_path = out_dir / CHECKPOINT
    fingerprint = _fingerprint(cfg, base_model, Path(train_path), seed, sigma, kd, world)
    history: list[dict] = []
    resumed_from = 0
    if ckpt_path.is_file():
        state = _load_private(ckpt_path, fingerprint, module=dp_model, optimizer=optimizer, engine=engine)
        own = state["rank_rngs"][rank]  # the generators go on from where they were, not re-seeded
        noise.set_state(noise_rng, own["noise_rng"])
        noise.set_state(poisson_rng, own["poisson_rng"])
        noise.set_state(user_pick, own["user_pick_rng"])
        torch.set_rng_state(own["torch_rng"])
        history = state["history"]
        resumed_from = _steps_accounted(engine)
        log.info("%s: resuming at step %d/%d, ε so far %.3f", stage, resumed_from, total_steps,
                 engine.get_epsilon(delta) if resumed_from else 0.0)

    log.info(
        "%s: N=%d %ss, q=%.4f, %d steps, σ=%.4f, C=%.2f, target ε=%.2f, δ=%.3g, mode %s, %s clipping, "
        "%d trainable parameters%s",
        stage, n, unit, sample_rate, total_steps, sigma, cfg.max_grad_norm, cfg.target_epsilon, delta, cfg.mode,
        cfg.grad_sample_mode, sum(p.numel() for p in model.parameters() if p.requires_grad),
        f", data-parallel rank {rank} of {world}" if world > 1 else "",
    )

    def save_checkpoint() -> None:
        rngs = {"noise_rng": noise.get_state(noise_rng), "poisson_rng": noise.get_state(poisson_rng),
                "user_pick_rng": noise.get_state(user_pick), "torch_rng": torch.get_rng_state()}
        rank_rngs = [rngs]
        if world > 1:  # the ranks' generators differ (noise, user picks, dropout): rank 0 saves them all
            rank_rngs = [None] * world
            dist.all_gather_object(rank_rngs, rngs)
        if rank != 0:
            return
        _save_private(ckpt_path, lambda f: engine.save_checkpoint(
            path=f, module=dp_model, optimizer=optimizer,
            checkpoint_dict={"fingerprint": fingerprint, "rank_rngs": rank_rngs, "history": history},
        ))

    val_codes, val_texts = read_split(validation_path)
    monitor = TokenizedRecords(
        [encode_record(tok, c, t, cfg.max_length)
         for c, t in zip(val_codes[:VALIDATION_MONITOR_RECORDS], val_texts[:VALIDATION_MONITOR_RECORDS])],
        tok.pad_token_id, cfg.max_length,
    )

    t0 = time.time()
    done = resumed_from
    while done < steps_allowed:
        with BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=cfg.physical_batch_size, optimizer=optimizer
        ) as physical_loader:
            for ids, lengths in physical_loader:
                if ids.shape[0] == 0:
                    _noise_only_step(dp_model, optimizer, cfg.grad_sample_mode)
                else:
                    batch = {k: v.to(device) for k, v in lm_batch(ids, lengths).items()}
                    labels = batch.pop("labels")
                    logits = dp_model(**batch).logits  # (B, L, V)
                    if kd_teacher is not None:
                        with torch.no_grad():
                            t_logits = kd_teacher(**batch).logits  # (B, L, V)
                        vocab = min(logits.shape[-1], t_logits.shape[-1])
                        per_example = per_sequence_distillation_loss(
                            logits[:, :-1, :vocab], t_logits[:, :-1, :vocab], labels,
                            alpha=kd.alpha, temperature=kd.temperature,
                        )  # (B,)
                        loss = (
                            DPTensorFastGradientClipping(dp_model, optimizer, per_example, "mean")
                            if criterion is not None else per_example.mean()
                        )
                    elif criterion is not None:
                        shifted = logits[:, :-1]  # (B, L-1, V)
                        loss = criterion(
                            shifted.reshape(-1, shifted.shape[-1]), labels.reshape(-1), shape=shifted.shape
                        )
                    else:
                        loss = per_sequence_loss(logits, labels).mean()
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if optimizer._is_last_step_skipped:
                    continue  # logical batch not finished yet
                done = _steps_accounted(engine)
                # Published: public quantities and the validation loss, never the private batch's
                # loss or size (a function of the records drawn, released without noise).
                record = {"step": done}
                if rank == 0 and (done % cfg.log_every == 0 or done == steps_allowed):
                    # Plain floats: the history goes into the checkpoint, which is read back with
                    # weights_only=True, and that refuses a numpy scalar (the PRV accountant's ε).
                    record["epsilon"] = float(engine.get_epsilon(delta))
                    record["validation_loss"] = float(_validation_loss(model, monitor, cfg.physical_batch_size, device))
                    record["seconds"] = round(time.time() - t0, 1)
                    log.info(
                        "%s: step %d/%d ε=%.3f validation loss %.4f (%.0f s)",
                        stage, done, steps_allowed, record["epsilon"], record["validation_loss"], record["seconds"],
                    )
                history.append(record)
                if done % cfg.checkpoint_every == 0 and done < steps_allowed:
                    save_checkpoint()
                if on_progress and rank == 0:
                    on_progress({**record, "done": done, "total": steps_allowed})
                if done >= steps_allowed:
                    break

    steps = _steps_accounted(engine)
    epsilon = engine.get_epsilon(delta)
    assert steps == steps_allowed, (steps, steps_allowed)
    assert {q for _, q, _ in engine.accountant.history} == {sample_rate}
    if epsilon > cfg.target_epsilon:
        raise TeacherError(
            f"accountant reports ε={epsilon:.4f} above the target {cfg.target_epsilon}; "
            "refusing to release this teacher"
        )
    accounted = [(sigma, sample_rate, steps)]
    entry = LedgerEntry(
        stage=stage,
        private=True,
        epsilon=epsilon,
        delta=delta,
        accountant=cfg.accountant,
        mechanism="subsampled_gaussian",
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        steps=steps,
        max_grad_norm=cfg.max_grad_norm,
        privacy_unit=unit,
        epsilon_rdp=privacy.epsilon_of("rdp", accounted, delta),
        history=accounted,
        noise_source=noise.source(cfg.secure_mode),
        note=f"{unit}-level DP-SGD ({cfg.mode}, {cfg.grad_sample_mode} clipping) on the private "
        f"training split (N={n} {unit}s"
        + ("" if users is None else f", {len(records)} records; one random record per sampled user per step")
        + f"), Poisson sampling with probability {sampling_probability:.6g} (accounted as "
        f"q={sample_rate:.6g}), lm_head untied from the input embedding; σ calibrated by Opacus "
        f"for target ε={cfg.target_epsilon}"
        + ("; gdp is a CLT approximation, not a guaranteed bound" if cfg.accountant == "gdp" else "")
        + (f"; KD loss (α={kd.alpha}, T={kd.temperature}) from the DP teacher" if kd else "")
        + (f"; data-parallel over {world} processes (Opacus DPDDP: each samples its share of the "
           "global Poisson batch, noise added once, by rank 0)" if world > 1 else ""),
    )
    dp_model._close()  # remove Opacus hooks and per-sample state before saving
    ckpt = out_dir / "model"
    curve = _validation_curve(history)
    if rank != 0:  # rank 0 writes the stage's files
        return TeacherResult(checkpoint=ckpt, ledger=entry, validation_curve=curve, resumed_from_step=resumed_from)
    if cfg.mode == "lora":
        model = model.merge_and_unload()  # a plain checkpoint for generation and distillation
    for p in model.parameters():
        p.requires_grad_(True)
    model = model.cpu().eval()
    validation_loss = float("nan")
    if val_texts:
        ppl = perplexity(model, tok, val_codes, val_texts, cfg.max_length, cfg.physical_batch_size)
        validation_loss = math.log(ppl.windowed)
        log.info("%s: validation perplexity %.2f", stage, ppl.windowed)

    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    torch.save(
        {"accountant": engine.accountant.state_dict(), "mechanism": engine.accountant.mechanism()},
        out_dir / "accountant_state.pt",
    )
    atomic_write_json(
        out_dir / "training_log.json",
        {"history": history, "validation_loss": validation_loss, "resumed_from_step": resumed_from},
    )
    write_manifest(
        out_dir,
        stage=stage,
        inputs={"train": train_path, "validation": validation_path},
        outputs={"model": ckpt, "accountant_state": out_dir / "accountant_state.pt"},
        extra={"base_model": base_model, "ledger": entry.model_dump()},
    )
    shutil.rmtree(ckpt_path.parent, ignore_errors=True)  # finished: the manifest now says so
    return TeacherResult(
        checkpoint=ckpt,
        ledger=entry,
        validation_curve=curve,
        validation_loss=validation_loss,
        resumed_from_step=resumed_from,
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
        validation_loss=log_["validation_loss"],
        resumed_from_step=log_["resumed_from_step"],
    )
