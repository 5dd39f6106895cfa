"""The teacher's published validation loss (teacher.monitor) and when a step may publish a time.

What is published per step is a function of public quantities only (step, ε spent) plus,
every `log_every` steps, a validation loss as `monitor` says: none (the default), a DP release
on the validation split (pipeline/privacy/monitor.py, its own ledger entry) or the exact loss
on records the user declared public. The validation records are private records: their exact
loss confirmed a candidate record (issue 21). Time is published only every
TIMING_WINDOW_STEPS steps and at the end: a step's duration tracks its Poisson batch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.batching import lm_batch
from pipeline.config import TeacherConfig
from pipeline.devices import Runtime
from pipeline.models.losses import per_sequence_loss
from pipeline.models.scoring import by_length
from pipeline.privacy import monitor as dp_monitor
from pipeline.privacy.dpsgd import TeacherError
from pipeline.records import read_users
from pipeline.stages.teacher.state import Monitor, Run
from pipeline.prompts import HEADER, PromptFormat
from pipeline.tokenized import TokenIds, token_column, tokenized_split

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


@torch.no_grad()
def per_record_losses(model: torch.nn.Module, records: TokenIds, batch_size: int, runtime: Runtime) -> torch.Tensor:
    """Each monitor record's mean per-token loss, (R,) float64 on the host (forward only, eval
    mode). Published only through `monitor_value`: exact for public records, noisy for private ones."""
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


def setup_monitor(cfg: TeacherConfig, tok, *, validation_path: Path, monitor_path: Path | None, stage: str,
                   steps_allowed: int, delta: float, prompt: PromptFormat = HEADER) -> Monitor | None:
    """The records the validation loss is computed on (each after its prompt, as training sees
    it), and with dp its calibrated mechanism."""
    if cfg.monitor == "none":
        return None  # the validation split is not even read
    if cfg.monitor == "public":
        if monitor_path is None:
            raise TeacherError("teacher.monitor=public: pass train_teacher(monitor_path=...), the public "
                               "records formatted as a split (the flow makes it from teacher.monitor_path)")
        records, _, n = dp_monitor.first_units(token_column(tokenized_split(monitor_path, tok, prompt)), None,
                                               cfg.monitor_records)
        if n == 0:
            raise TeacherError(f"teacher.monitor_path {str(cfg.monitor_path)!r} holds no records; "
                               "point it at a file of public records, or set teacher.monitor=none")
        return Monitor("public", TokenIds(records, cfg.max_length, tok.pad_token_id), n)
    users = read_users(validation_path)
    records, units, n = dp_monitor.first_units(token_column(tokenized_split(validation_path, tok, prompt)), users,
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
    return Monitor("dp", TokenIds(records, cfg.max_length, tok.pad_token_id), n, units, z, entry)


def monitor_value(run: Run) -> float:
    """The validation loss to publish at a monitor point: public records' exact mean, or the
    DP release (pipeline/privacy/monitor.py) with noise from the secret monitor generator."""
    m = run.monitor
    losses = per_record_losses(run.model, m.records, run.cfg.physical_batch_size, run.runtime)  # (R,)
    if m.mode == "public":
        return float(losses.double().mean())
    return dp_monitor.noisy_mean(dp_monitor.unit_means(losses, m.units), run.cfg.monitor_clip, m.z,
                                 run.rngs["monitor"])


def monitor_note(run: Run) -> str:
    """What the stage's published validation loss is computed from, for its ledger note."""
    if run.cfg.monitor == "none":
        return ("; no figure computed from the validation split is published (teacher.monitor=none: no "
                "validation loss)")
    if run.cfg.monitor == "dp":
        return f"; its validation loss is released with DP, see {run.monitor.entry.stage}"
    return (f"; its validation loss is computed on public data, {run.monitor.n} records the user declared "
            f"public (teacher.monitor_path={str(run.cfg.monitor_path)!r}), and published without noise; "
            "the private validation split is not read")
