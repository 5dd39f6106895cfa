"""The teacher's crash-safe budget: its private resume checkpoint.

Every `checkpoint_every` steps the model, optimizer, accountant and RNG states are saved
atomically to `out_dir/checkpoint/state.pt` (mode 0600: it holds the secret generators'
states; deleted when the stage finishes). Run again into the same `out_dir`, training resumes
at the saved step with the saved accountant and generators: it neither restarts the
accountant (under-counting) nor repeats steps already counted. The checkpoint is read with
`weights_only=True`: a planted file cannot run code, and only by a run whose `fingerprint`
(config, data, base model, seed, σ, processes) matches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from opacus import PrivacyEngine

from pipeline.config import NODE_FIELDS, TeacherConfig, at_later_defaults
from pipeline.manifest import sha256_file
from pipeline.privacy import noise
from pipeline.privacy.dpsgd import TeacherError, epsilon_spent, steps_accounted
from pipeline.stages.teacher.state import KnowledgeDistillation, Run

log = logging.getLogger(__name__)


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


def checkpoint_fingerprint(
    cfg: TeacherConfig, base_model: str, train_path: Path, seed: int, sigma: float, kd: KnowledgeDistillation | None,
    world_size: int = 1, precision: str = "fp32", target_epsilon: float | None = None,
) -> str:
    """What a checkpoint must match to be resumed: same config, data, base model, seed, σ, KD,
    number of data-parallel processes (a DPDDP checkpoint holds wrapped weights and
    per-rank RNG states) and checkpoint layout (2: per-rank secret generator states).
    `target_epsilon`: the stage's share of the budget, in place of the config's (DPKD: one of two
    equal shares), as when the flow handed the stage a config rewritten with it: checkpoints made
    then still resume."""
    spec = cfg.model_dump(mode="json", exclude={"log_every", "checkpoint_every", "processes", "ddp_backend", *NODE_FIELDS,
                                                *at_later_defaults(cfg)})
    if target_epsilon is not None:
        spec["target_epsilon"] = target_epsilon
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


def resume(run: Run) -> None:
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
    # A checkpoint made before the generators were keyed whole (pipeline/privacy/noise.py) says nothing
    run.noise_source = state.get("noise_source") or noise.legacy_source(run.cfg.secure_mode)
    if run.noise_source != noise.source(run.cfg.secure_mode):
        log.warning("%s: the checkpoint's generators came from %s; the ledger says so", run.stage, run.noise_source)
    run.resumed_from = steps_accounted(run.engine)
    log.info("%s: resuming at step %d/%d, ε so far %.3f (replace-one %.3f)", run.stage, run.resumed_from,
             run.total_steps, *epsilon_spent(run.engine, run.delta))


def save_checkpoint(run: Run) -> None:
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
        checkpoint_dict={"fingerprint": run.fingerprint, "rank_rngs": rank_rngs, "history": run.history,
                         "noise_source": run.noise_source},
    ))
