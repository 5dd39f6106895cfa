"""The teacher stage as a recipe: `_setup` (models, private data behind secret Poisson sampling,
σ, Opacus' engine), `resume` (checkpoint.py), `_step` (one physical batch), `_record_step`,
`save_checkpoint`, `_ledger_entry` and `_save`, driven by `train_teacher`'s loop.

Opacus is used as its API intends (pipeline/privacy/dpsgd.py has the mechanics): ε in the
ledger is what the accountant says after the last step, and training stops before a step
that would exceed the target.

Secret randomness: the DP noise, the Poisson sample and the record picked for each sampled
user come from generators keyed with OS entropy (pipeline/privacy/noise.py), never from `seed`,
which is published with the config; `seed` drives the rest (dropout, data order). With
`secure_mode` they come from a ChaCha20 CSPRNG. The loss and size of a private Poisson batch
are never published (monitor.py says what is).

Data-parallel (`processes` > 1): `train_teacher` runs `ddp_worker` under torchrun (ddp.py,
which imports it by name); inside the process group every rank runs `train_teacher` on its
share of each Poisson draw, Opacus' DPDDP optimizers add the noise once (rank 0) and
all-reduce, and the accountant sees the global batch, exactly as in one process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from opacus.data_loader import DPDataLoader
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch.utils.data import DataLoader

from pipeline.batching import lm_batch
from pipeline.config import TeacherConfig
from pipeline.devices import CPU_FP32, Runtime, adamw, ieee_fp32_products
from pipeline.manifest import MANIFEST, atomic_write_json, manifest_problems, write_manifest
from pipeline.models.base import (head_is_tied, load_causal_lm, load_tokenizer, model_positions, same_tokenizer,
                                  untie_lm_head)
from pipeline.models.losses import per_sequence_distillation_loss, per_sequence_loss
from pipeline.privacy import accountant as privacy
from pipeline.privacy import noise
from pipeline.privacy.dpsgd import (CLIPPING, DpSgdPlan, OneRecordPerUser, RankShareSampler, TeacherError,
                                    epsilon_spent, make_private, noise_only_step, plan_dp_sgd, shortest_first,
                                    steps_accounted)
from pipeline.privacy.ledger import LedgerEntry, with_pld_epsilons
from pipeline.privacy.pld import DP_SGD_REPLACE_SENSITIVITY
from pipeline.progress import DEFAULT_EVERY, ProgressLog
from pipeline.records import read_users
from pipeline.stages.teacher import ddp as teacher_ddp
from pipeline.stages.teacher.checkpoint import checkpoint_fingerprint, resume, save_checkpoint
from pipeline.stages.teacher.monitor import (TIMING_WINDOW_STEPS, is_monitor_point, monitor_note, monitor_value,
                                             publishes_time, setup_monitor)
from pipeline.stages.teacher.state import KnowledgeDistillation, Run, TeacherResult
from pipeline.stages.teacher.trainable import prepare_trainable
from pipeline.prompts import HEADER, PromptFormat
from pipeline.tokenized import PROMPT_COLUMN, TokenIds, token_column, tokenized_split

log = logging.getLogger(__name__)


def _world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group; (0, 1) outside one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _models(cfg: TeacherConfig, base_model: str, kd: KnowledgeDistillation | None, device, stage: str):
    """Tokenizer, the trainable model (lm_head untied where DP-SGD trains it, `TeacherConfig.unties_head`:
    pipeline/models/base.py says why), the KD teacher, and the parameters the untied head added."""
    tok = load_tokenizer(base_model)
    model = load_causal_lm(base_model)
    if not cfg.unties_head:
        if head_is_tied(model):
            log.info("%s: lm_head kept tied to the input embedding (%s)", stage,
                     f"teacher.mode={cfg.mode} trains neither" if cfg.mode != "full" else
                     "teacher.untie_lm_head=false: bk clips the shared weight by the norm of both uses' summed gradient")
        untied = 0
    elif untied := untie_lm_head(model):
        log.info("%s: lm_head untied from the input embedding for DP-SGD (one weight, two uses, would get "
                 "one norm per use): +%d parameters, and the saved model keeps its own head", stage, untied)
    n_positions = model_positions(model.config)
    if cfg.max_length > n_positions:
        raise TeacherError(
            f"teacher.max_length={cfg.max_length} exceeds the model's {n_positions} positions; "
            f"set teacher.max_length <= {n_positions}"
        )
    model = prepare_trainable(model, cfg).to(device)
    kd_teacher = load_causal_lm(str(kd.teacher_dir)).eval().to(device) if kd else None
    if kd_teacher is not None and not same_tokenizer(tok, load_tokenizer(str(kd.teacher_dir))):
        raise TeacherError(f"the KD teacher {kd.teacher_dir} uses another tokenizer than {base_model!r}")
    return tok, model, kd_teacher, untied


def _schedule(cfg: TeacherConfig, n: int, unit: str, planned: DpSgdPlan | None, stage: str) -> DpSgdPlan:
    """(σ, q, steps, δ) of this training: the run's plan as handed down (the flow's, calibrated once
    for the run), else made here the same way (`plan_dp_sgd`). A plan made for other units than
    the training split has (its file changed after the plan read it) is not used."""
    if planned is not None and (planned.n, planned.unit) == (n, unit):
        return planned
    if planned is not None:
        log.warning("%s: the run's plan was made for %d %ss, but the training split has %d %ss; calibrating "
                    "σ for the split", stage, planned.n, planned.unit, n, unit)
    return plan_dp_sgd(cfg, n, unit, None if planned is None else planned.target_epsilon)


def _setup(cfg: TeacherConfig, *, train_path: Path, validation_path: Path, monitor_path: Path | None,
           base_model: str, out_dir: Path, seed: int, stage: str, kd: KnowledgeDistillation | None,
           runtime: Runtime, planned: DpSgdPlan | None, prompt: PromptFormat = HEADER) -> Run:
    """Models, the private data behind secret Poisson sampling, σ, and Opacus' engine."""
    rank, world = _world()
    device = runtime.device  # a data-parallel rank's own: cuda:local_rank on nccl (ddp_worker)
    torch.manual_seed(seed + rank)  # dropout; DP randomness comes from the secret generators below
    np.random.seed(seed)
    tok, model, kd_teacher, untied = _models(cfg, base_model, kd, device, stage)
    users = read_users(train_path)
    # Memory-mapped Arrow ids, tokenized once per run (pipeline/tokenized.py); each batch is
    # padded to its own longest record by the collate below.
    # Under a prompt template, each record's prompt length too: its tokens are no target (lm_batch).
    ids = tokenized_split(train_path, tok, prompt)
    records = TokenIds(token_column(ids), cfg.max_length, tok.pad_token_id,
                       prompts=token_column(ids, PROMPT_COLUMN) if prompt.masks_prompt else None)
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
    dp = _schedule(cfg, n, unit, planned, stage)
    sampling_probability, delta, sigma, steps_allowed = dp.sampling_probability, dp.delta, dp.sigma, dp.steps_allowed
    if weak := privacy.weak_delta_warning(delta, n, unit, stage):
        log.warning("%s", weak)
    if not cfg.secure_mode:
        log.warning(
            "%s: secure_mode is off: DP noise and sampling come from torch's mt19937 keyed from OS "
            "entropy, unpredictable from anything published but not a cryptographic generator; set "
            "teacher.secure_mode=true (ChaCha20) for a production release", stage,
        )
    # Poisson sampling set up as make_private would, but here (dpsgd.poisson_schedule says why).
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
    assert cfg.epochs * len(poisson_loader) == dp.steps and dp_loader.sample_rate == sampling_probability
    if steps_allowed < dp.steps:
        log.warning(
            "%s: σ=%.4f would exceed ε=%.2f after step %d of %d (calibration tolerance); "
            "training stops there", stage, sigma, dp.target_epsilon, steps_allowed, dp.steps,
        )

    model.train()
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], cfg.learning_rate, cfg.weight_decay)
    engine, dp_model, dp_optimizer, loader = make_private(cfg, model, optimizer, poisson_loader, sigma=sigma,
                                                          noise_generator=rngs["noise"], world=world)
    dp_model.forbid_grad_accumulation()  # what make_private does for Poisson sampling

    monitor = setup_monitor(cfg, tok, validation_path=validation_path, monitor_path=monitor_path, stage=stage,
                             steps_allowed=steps_allowed, delta=delta, prompt=prompt)
    return Run(
        cfg=cfg, stage=stage, out_dir=Path(out_dir), rank=rank, world=world, runtime=runtime, device=device, tok=tok,
        model=model,
        dp_model=dp_model, optimizer=dp_optimizer, loader=loader, engine=engine, rngs=rngs, n=n,
        n_records=len(records), unit=unit, delta=delta, sigma=sigma, sampling_probability=sampling_probability,
        sample_rate=dp.sample_rate, total_steps=dp.steps, steps_allowed=steps_allowed, target_epsilon=dp.target_epsilon,
        fingerprint=checkpoint_fingerprint(cfg, base_model, Path(train_path), seed, sigma, kd, world, runtime.precision,
                                           target_epsilon=dp.target_epsilon),
        monitor=monitor, noise_source=noise.source(cfg.secure_mode), kd=kd, kd_teacher=kd_teacher,
        untied_parameters=untied,
    )


def _step(run: Run, ids: torch.Tensor, lengths: torch.Tensor, prompts: torch.Tensor | None = None) -> None:
    """One physical batch: per-example losses, the clipping mode's backward, Opacus' step
    (which only accumulates until the logical batch is complete). `prompts`: each record's
    prompt length, under a prompt template (no target)."""
    if ids.shape[0] == 0:
        noise_only_step(run.dp_model, run.optimizer, run.cfg.grad_sample_mode)
        return
    batch = {k: v.to(run.device) for k, v in lm_batch(ids, lengths, prompts).items()}
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
    with ieee_fp32_products():  # every mode's per-example norms and clipped sums in IEEE fp32
        CLIPPING[run.cfg.grad_sample_mode](run.dp_model, run.optimizer, per_example)
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def _record_step(run: Run, t0: float) -> dict:
    """What a finished logical step publishes: public quantities and, at monitor points, ε and
    the validation loss as teacher.monitor says (none: no loss at all; dp: only the noisy
    release); never the private batch's loss or size (a function of the records drawn,
    released without noise). A time (the log line, `seconds`) only where `publishes_time`,
    which is always a monitor point, so the line has them."""
    done = steps_accounted(run.engine)
    record = {"step": done}
    timed = publishes_time(done, run.steps_allowed)
    if run.rank == 0 and is_monitor_point(done, run.steps_allowed, run.cfg.log_every):
        # Plain floats: the history goes into the checkpoint, which is read back with
        # weights_only=True, and that refuses a numpy scalar (the PRV accountant's ε).
        record["epsilon"], record["epsilon_replace_one"] = epsilon_spent(run.engine, run.delta)
        if run.monitor is not None:
            record["validation_loss"] = float(monitor_value(run))
    if run.rank == 0 and timed:
        record["seconds"] = round(time.time() - t0, 1)
        loss = f" validation loss {record['validation_loss']:.4f}" if "validation_loss" in record else ""
        log.info("%s: step %d/%d ε=%.3f, replace-one ε=%.3f%s (%.0f s)", run.stage, done, run.steps_allowed,
                 record["epsilon"], record["epsilon_replace_one"], loss, record["seconds"])
    run.history.append(record)
    return record


def _ledger_entry(run: Run) -> LedgerEntry:
    """The release, as the accountant saw it; refused if ε ended above the target."""
    cfg, steps, epsilon = run.cfg, steps_accounted(run.engine), run.engine.get_epsilon(run.delta)
    assert steps == run.steps_allowed, (steps, run.steps_allowed)
    assert {q for _, q, _ in run.engine.accountant.history} == {run.sample_rate}
    if epsilon > run.target_epsilon:
        raise TeacherError(
            f"accountant reports ε={epsilon:.4f} above the target {run.target_epsilon}; "
            "refusing to release this teacher"
        )
    accounted = [(run.sigma, run.sample_rate, steps)]
    kd, unit = run.kd, run.unit
    return with_pld_epsilons(LedgerEntry(
        stage=run.stage, private=True, epsilon=epsilon, delta=run.delta, accountant=cfg.accountant,
        mechanism="subsampled_gaussian", noise_multiplier=run.sigma, sample_rate=run.sample_rate, steps=steps,
        max_grad_norm=cfg.max_grad_norm, privacy_unit=unit,
        epsilon_rdp=privacy.epsilon_of("rdp", accounted, run.delta), history=accounted,
        replace_one_sensitivity=DP_SGD_REPLACE_SENSITIVITY, noise_source=run.noise_source,
        note=f"{unit}-level DP-SGD ({cfg.mode}, {cfg.grad_sample_mode} clipping) on the private "
        f"training split (N={run.n} {unit}s"
        + ("" if unit == "record" else f", {run.n_records} records; one random record per sampled user per step")
        + f"), Poisson sampling with probability {run.sampling_probability:.6g} (accounted as "
        f"q={run.sample_rate:.6g})"
        + (f", lm_head untied from the input embedding (+{run.untied_parameters} parameters)"
           if run.untied_parameters else "")
        + f"; σ calibrated by Opacus "
        f"for target ε={run.target_epsilon}"
        + ("; gdp is a CLT approximation, not a guaranteed bound" if cfg.accountant == "gdp" else "")
        + (f"; KD loss (α={kd.alpha}, T={kd.temperature}) from the DP teacher" if kd else "")
        + (f"; data-parallel over {run.world} processes (Opacus DPDDP: each samples its share of the "
           "global Poisson batch, noise added once, by rank 0)" if run.world > 1 else "")
        + monitor_note(run),
        validation_monitor=cfg.monitor, untied_parameters=run.untied_parameters,
    ))


def _save(run: Run, entry: LedgerEntry, *, train_path: Path, validation_path: Path, monitor_path: Path | None,
          base_model: str) -> TeacherResult:
    """Rank 0 writes the plain checkpoint (LoRA merged), accountant state, training log and,
    last, the manifest; then deletes the resume checkpoint. The final validation loss is the
    last monitor point's, the final model's: no further release (monitor=dp counted it)."""
    run.dp_model._close()  # remove Opacus hooks and per-sample state before saving
    out_dir, ckpt, curve = run.out_dir, run.out_dir / "model", _validation_curve(run.history)
    final_loss = curve[-1][1] if curve else None
    monitor_entry = run.monitor.entry if run.monitor is not None else None
    if monitor_entry is not None:  # its generator resumed with the others
        monitor_entry = monitor_entry.model_copy(update={"noise_source": run.noise_source})
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
    dp_sgd: DpSgdPlan | None = None,
    prompt: PromptFormat = HEADER,
) -> TeacherResult:
    """DP fine-tune `base_model` on the private training split; save it to `out_dir/model`.
    `prompt`: how each record's codes are written before its text (pipeline/prompts.py).

    `validation_path` is read only with `cfg.monitor` = dp; `monitor_path` (monitor=public) is
    the user's public records formatted as a split (pipeline/stages/data.py format_public_split).

    `on_progress` receives each logical step's record after the step and its checkpoint:
    step and done/total steps, plus ε, add/remove and replace-one (and the validation loss, per `cfg.monitor`)
    every `log_every` steps and
    elapsed seconds every TIMING_WINDOW_STEPS; never anything computed from a private batch.
    An exception raised there interrupts training like a crash. It is called every step (to
    stop promptly): publish its calls' times only where `publishes_time` (flows/progress.py).
    A progress line (steps, steps/s, ε spent under both adjacencies, elapsed, ETA) is logged every
    TIMING_WINDOW_STEPS steps, at most every `progress_every` seconds, and at the end.

    `cfg.processes` > 1 outside a process group: runs `ddp_worker` under torchrun
    (ddp.py) and returns the finished stage. Inside an initialised process
    group of W > 1 ranks: trains data-parallel (DPDDP); rank 0 alone writes the checkpoints,
    model, ledger and manifest, and the other ranks return the same ledger entry.

    `runtime` (pipeline/devices.py): the device, precision (bf16: forward passes under
    autocast, fp32 master weights and losses) and CPU threads of this process.

    `dp_sgd`: σ, q, steps and δ as the run's plan calibrated them once for this stage's share of
    the budget (the flow hands them down; DPKD's two DP-SGD stages compose to the run's ε). Without
    it, they are made from `cfg` (`cfg.target_epsilon`) by the same function, `dpsgd.plan_dp_sgd`.
    """
    paths = dict(train_path=Path(train_path), validation_path=Path(validation_path), base_model=base_model,
                 monitor_path=None if monitor_path is None else Path(monitor_path))
    if (cfg.processes > 1 or cfg.nnodes > 1) and _world()[1] == 1:
        return _train_data_parallel(cfg, out_dir=Path(out_dir), seed=seed, on_progress=on_progress, stage=stage,
                                    kd=kd, progress_every=progress_every, runtime=runtime, dp_sgd=dp_sgd,
                                    prompt=prompt, **paths)
    runtime.apply_threads()
    run = _setup(cfg, out_dir=out_dir, seed=seed, stage=stage, kd=kd, runtime=runtime, planned=dp_sgd, prompt=prompt,
                 **paths)
    if run.world > 1 and cfg.nnodes == 1 and run.world != cfg.processes:
        log.warning("%s: teacher.processes=%d but the process group has %d ranks; training on %d",
                    stage, cfg.processes, run.world, run.world)
    resume(run)
    log.info(
        "%s: N=%d %ss, q=%.4f, %d steps, σ=%.4f, C=%.2f, target ε=%.2f, δ=%.3g, mode %s, %s clipping, "
        "%d trainable parameters%s", stage, run.n, run.unit, run.sample_rate, run.total_steps, run.sigma,
        cfg.max_grad_norm, run.target_epsilon, run.delta, cfg.mode, cfg.grad_sample_mode,
        sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        f", data-parallel rank {run.rank} of {run.world}" if run.world > 1 else "",
    )
    _train_steps(run, cfg, on_progress, progress_every)
    return _save(run, _ledger_entry(run), **paths)


def _train_steps(run: Run, cfg: TeacherConfig, on_progress: Callable[[dict], None] | None,
                 progress_every: float) -> None:
    """The logical steps left after `run.resumed_from`, each followed by its record, a checkpoint
    every `cfg.checkpoint_every` steps and a progress line when one is due."""
    t0, done = time.time(), run.resumed_from
    # Steps, ε and time only: the size or token count of a Poisson batch is private, and so is
    # one step's duration: lines only every TIMING_WINDOW_STEPS steps.
    steps_log = ProgressLog(log, run.stage, "steps", run.steps_allowed, every=progress_every, done=run.resumed_from,
                            window=TIMING_WINDOW_STEPS)
    set_learning_rate(run, done)
    while done < run.steps_allowed:
        with BatchMemoryManager(data_loader=run.loader, max_physical_batch_size=cfg.physical_batch_size,
                                optimizer=run.optimizer) as physical_loader:
            for batch in physical_loader:  # (ids, lengths) or, under a prompt template, (ids, lengths, prompts)
                _step(run, *batch)
                if run.optimizer._is_last_step_skipped:
                    continue  # logical batch not finished yet
                record = _record_step(run, t0)
                done = record["step"]
                set_learning_rate(run, done)  # the next step's
                if done % cfg.checkpoint_every == 0 and done < run.steps_allowed:
                    save_checkpoint(run)
                if run.rank == 0 and steps_log.due(done):
                    spent = ((record["epsilon"], record["epsilon_replace_one"]) if "epsilon" in record
                             else epsilon_spent(run.engine, run.delta))
                    steps_log.update(done, values={"ε": f"{spent[0]:.3f}", "replace-one ε": f"{spent[1]:.3f}"})
                if on_progress and run.rank == 0:
                    on_progress({**record, "done": done, "total": run.steps_allowed})
                if done >= run.steps_allowed:
                    break


def lr_factor(cfg: TeacherConfig, step: int, total: int) -> float:
    """The share of `cfg.learning_rate` at logical step `step` (0-based) of `total`: 1 throughout
    ('constant'), else a linear warm-up over `lr_warmup_fraction` of the steps, then a linear or
    cosine decay towards 0. A function of the step alone, so a resumed run needs no scheduler state."""
    if cfg.lr_schedule == "constant":
        return 1.0
    warmup = max(1, round(cfg.lr_warmup_fraction * total))
    if step < warmup:
        return (step + 1) / warmup
    left = (step - warmup) / max(1, total - warmup)  # 0 after the warm-up, 1 at the end
    return 1 - left if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * left))


def set_learning_rate(run: Run, step: int) -> None:
    """The learning rate of logical step `step` (`lr_factor`), on every parameter group."""
    for group in run.optimizer.param_groups:
        group["lr"] = run.cfg.learning_rate * lr_factor(run.cfg, step, run.steps_allowed)


def _train_data_parallel(cfg: TeacherConfig, *, out_dir: Path, on_progress, stage: str,
                         kd: KnowledgeDistillation | None, progress_every: float, runtime: Runtime,
                         dp_sgd: DpSgdPlan | None, prompt: PromptFormat, **job) -> TeacherResult:
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
                                           "temperature": kd.temperature},
            "dp_sgd_plan": None if dp_sgd is None else dataclasses.asdict(dp_sgd),  # every rank the same σ
            "prompt": dataclasses.asdict(prompt)}
    teacher_ddp.launch(args, target="pipeline.stages.teacher.recipe:ddp_worker", processes=cfg.processes,
                       backend=cfg.ddp_backend, threads=threads, work=out_dir / teacher_ddp.WORKDIR, stage=stage,
                       on_progress=on_progress, error=TeacherError, nodes=teacher_ddp.Nodes.of(cfg))
    result = finished_teacher(out_dir)
    if result is None:
        raise TeacherError(f"{stage}: torchrun exited cleanly but {out_dir} holds no finished teacher; "
                           f"see {out_dir / teacher_ddp.WORKDIR}")
    return result


def ddp_worker(args: dict, on_progress: Callable[[dict], None] | None) -> None:
    """One torchrun rank (ddp.py calls it inside the process group)."""
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
        dp_sgd=DpSgdPlan(**args["dp_sgd_plan"]) if args.get("dp_sgd_plan") else None,
        prompt=PromptFormat(**{**args["prompt"], "columns": tuple(args["prompt"]["columns"])}),
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
