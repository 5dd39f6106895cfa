"""DP-SGD's mechanics, apart from any stage: Poisson sampling over records or users, σ for the
target (ε, δ), the clipping modes' backward, and the noise-only step of an empty draw.

The teacher stage (pipeline/stages/teacher/) runs them with Opacus as its API intends: its
accountant calibrates σ from the target (ε, δ), the sampling rate and the exact number of steps
(`calibrate_noise`, with a deadline: pipeline/privacy/accountant.py); `PrivacyEngine.make_private`
wraps model, optimizer and the loader; the samplers below draw the Poisson sample from the
secret generators of pipeline/privacy/noise.py, never from the published seed. `dpdistill plan`
and the flow make one `DpSgdPlan` per DP-SGD stage with `plan_dp_sgd` (schedule, δ and σ, one
calibration), which the flow hands the stage; a stage called without one makes it the same way.

Clipping (`CLIPPING`, one line each): `bk` (book-keeping, pipeline/privacy/bk.py: one backward
pass), `ghost` (Opacus ghost clipping, Li et al. 2021: a norm pass, then a reweighted one) or
`hooks` (Opacus' per-sample gradients, the reference).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch.utils.data import DataLoader, Dataset

from pipeline.batching import IGNORE
from pipeline.config import TeacherConfig
from pipeline.privacy import accountant as privacy
from pipeline.privacy import noise, pld
from pipeline.privacy.bk import BookKeepingPrivacyEngine


class TeacherError(ValueError):
    """The teacher stage cannot run as configured; the message says what to change."""


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


def calibrate_noise(cfg: TeacherConfig, sample_rate: float, steps: int, delta: float,
                    target_epsilon: float | None = None) -> tuple[float, int]:
    """(σ for the target (ε, δ) after `steps`, the steps that stay within it), by the accountant.
    `target_epsilon`: the stage's share of the budget (DPKD's teacher: one of two equal shares),
    else `cfg.target_epsilon`.

    Bounded in time (privacy.CALIBRATION_DEADLINE_S): PRV never returns at a very large ε.
    """
    epsilon = cfg.target_epsilon if target_epsilon is None else target_epsilon
    try:
        sigma = privacy.calibrate_sigma(cfg.accountant, epsilon, delta, sample_rate, steps)
        steps_allowed = privacy.max_steps_within_budget(cfg.accountant, sigma, sample_rate, delta, epsilon, steps)
    except privacy.CalibrationTimeout as e:
        raise TeacherError(
            f"{e} (q={sample_rate:.4g}, {steps} steps, δ={delta:.3g}; at very large ε the PRV accountant "
            "overflows). Use teacher.accountant=rdp, or a smaller teacher.target_epsilon"
        ) from e
    except Exception as e:  # the accountants fail in several ways on extreme (q, steps)
        raise TeacherError(
            f"the {cfg.accountant} accountant could not calibrate the noise for "
            f"ε={epsilon}, δ={delta:.3g}, q={sample_rate:.4g}, {steps} steps "
            f"({type(e).__name__}: {e}). Raise teacher.target_epsilon, lower teacher.epochs, "
            "lower teacher.batch_size (a smaller sampling rate), or try teacher.accountant=rdp"
        ) from e
    return sigma, steps_allowed


@dataclass(frozen=True)
class DpSgdPlan:
    """One DP-SGD training's schedule and noise for its N units: what the flow's plan (made once
    per run, pipeline/plan.py) hands each DP-SGD stage, and what the stage makes itself with
    `plan_dp_sgd` when called without one. Either way `plan_dp_sgd` made it, so σ is the same."""

    target_epsilon: float
    """The stage's share of the budget (DPKD: equal shares to the teacher and the student, composing to ε)."""
    n: int
    """Privacy units sampled from: records, or users."""
    unit: str
    sampling_probability: float
    """The Poisson loader's probability (1 / ceil(N / batch_size))."""
    sample_rate: float
    """q as the accountant records it (1 / steps per epoch: `poisson_schedule`)."""
    steps: int
    """Steps the schedule runs: epochs × steps per epoch."""
    steps_allowed: int
    """Steps within the target at σ (training stops there if fewer)."""
    sigma: float
    delta: float


def plan_dp_sgd(cfg: TeacherConfig, n: int, unit: str = "record", target_epsilon: float | None = None) -> DpSgdPlan:
    """q and steps (`poisson_schedule`), δ (`teacher.target_delta`'s rule) and σ (`calibrate_noise`) of
    DP-SGD over N units at `target_epsilon` (default `cfg.target_epsilon`): the one calibration of a
    DP-SGD stage, whether the flow's plan makes it or the stage itself."""
    epsilon = cfg.target_epsilon if target_epsilon is None else target_epsilon
    probability, sample_rate, steps = poisson_schedule(n, cfg.batch_size, cfg.epochs, unit)
    delta = privacy.resolve_delta(cfg.target_delta, n)
    sigma, steps_allowed = calibrate_noise(cfg, sample_rate, steps, delta, epsilon)
    return DpSgdPlan(target_epsilon=epsilon, n=n, unit=unit, sampling_probability=probability,
                     sample_rate=sample_rate, steps=steps, steps_allowed=steps_allowed, sigma=sigma, delta=delta)


def make_private(cfg: TeacherConfig, model: torch.nn.Module, optimizer, loader: DataLoader, *, sigma: float,
                 noise_generator, world: int = 1):
    """The one wiring of the clipping engine (the teacher stage and the plan's timed step):
    (engine, its model, its optimizer, its loader) for `cfg.grad_sample_mode`, noise σ drawn
    from `noise_generator`. `loader` already samples with Poisson (dpsgd.RankShareSampler). With
    `world` > 1 ranks the model is wrapped in DPDDP, and make_private then picks Opacus'
    Distributed(FastGradientClipping)DPOptimizer, whose step adds the noise on rank 0 only,
    all-reduces the sum of the ranks' clipped gradients and divides by the global expected batch."""
    with warnings.catch_warnings():  # its "Secure RNG turned off": our generators are secret
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        # Opacus' own secure_mode needs torchcsprng (no release for current torch): secure
        # noise comes from the noise generator instead, through pipeline/privacy/noise.py's dispatcher.
        engine = BookKeepingPrivacyEngine(accountant=cfg.accountant, secure_mode=False)
        made = engine.make_private(
            module=DPDDP(model) if world > 1 else model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=sigma, max_grad_norm=cfg.max_grad_norm, poisson_sampling=False,
            noise_generator=noise_generator, grad_sample_mode=cfg.grad_sample_mode,
            # ghost: Opacus wraps a criterion it needs; the stages call CLIPPING["ghost"] instead
            **({"criterion": torch.nn.CrossEntropyLoss(ignore_index=IGNORE)} if cfg.grad_sample_mode == "ghost" else {}),
        )
    return engine, made[0], made[1], made[-1]


# One backward for each clipping mode: after it, Opacus' optimizer finds what it expects
# (per-sample gradients for hooks, the clipped sum in .grad for ghost and bk).
CLIPPING: dict[str, Callable] = {
    "ghost": lambda model, optimizer, per_example: DPTensorFastGradientClipping(
        model, optimizer, per_example, "mean").backward(),  # Opacus: a norm pass, then a reweighted one
    "hooks": lambda model, optimizer, per_example: per_example.mean().backward(),  # per-sample gradients
    "bk": lambda model, optimizer, per_example: model.backward_clipped(per_example),  # pipeline/privacy/bk.py
}


def noise_only_step(model: torch.nn.Module, optimizer, mode: str) -> None:
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


def steps_accounted(engine: PrivacyEngine) -> int:
    return int(sum(steps for _, _, steps in engine.accountant.history))


def epsilon_spent(engine: PrivacyEngine, delta: float) -> tuple[float, float]:
    """ε spent so far at `delta`, as plain floats: add/remove from the engine's accountant (what
    teacher.target_epsilon sets) and replace-one from dp-accounting's PLD on the same history (pld.py),
    shown side by side wherever training shows its ε (issue 38 item 6). The PLD's Gaussian is built
    once per process: each later call composes only (~20 ms)."""
    history = [tuple(h) for h in engine.accountant.history]  # (σ, q, steps)
    if not history:
        return 0.0, 0.0
    dp_sgd = ("subsampled_gaussian", history, pld.DP_SGD_REPLACE_SENSITIVITY)
    replace_one = pld.epsilon([dp_sgd], delta, pld.REPLACE_ONE)
    return float(engine.get_epsilon(delta)), float(replace_one)
