"""What a teacher training holds while it runs (`Run`: what setup builds and the step,
checkpoint, monitor and save functions read) and what it returns (`TeacherResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from opacus import PrivacyEngine
from torch.utils.data import DataLoader

from pipeline.config import TeacherConfig
from pipeline.devices import Runtime
from pipeline.privacy.ledger import LedgerEntry
from pipeline.tokenized import TokenIds

CHECKPOINT = "checkpoint/state.pt"


@dataclass
class Monitor:
    """What the stage scores at each monitor point (teacher.monitor dp or public)."""

    mode: str
    records: TokenIds
    n: int  # units the published mean is over
    units: torch.Tensor | None = None  # dp at user level: each record's user index (R,)
    z: float = 0.0  # dp: the calibrated noise multiplier
    entry: LedgerEntry | None = None  # dp: the release's ledger entry


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

    def releases(self) -> dict[str, LedgerEntry]:
        """The stage's ledger entries by the part of its release they are (flows/stage_runner.py
        charges them to the records' budget): the training, and its validation loss with monitor=dp."""
        return {"": self.ledger} | ({":validation": self.monitor_ledger} if self.monitor_ledger else {})


@dataclass
class Run:
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
    target_epsilon: float  # this stage's share of the budget (DPKD: one of two equal shares), σ's target
    fingerprint: str
    monitor: Monitor | None  # what the published validation loss is computed on (None: not monitored)
    noise_source: str  # what the generators' streams came from (a resumed run: as its checkpoint says)
    kd: KnowledgeDistillation | None = None
    kd_teacher: torch.nn.Module | None = None
    untied_parameters: int = 0  # what untying lm_head from the input embedding added
    history: list[dict] = field(default_factory=list)
    resumed_from: int = 0

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT
