"""`dpdistill plan`: what a run will do before it does it: N, q, σ, steps and ε (the time: plan_time.py).

    plan = make_plan(cfg)
    print(format_plan(plan))

Nothing is trained and nothing is written. Every number is the run's own: N from the data
stage's split (`data.planned_split`), q, steps, δ and σ of each DP-SGD stage from
`dpsgd.plan_dp_sgd` (the stage's own calibration: the flow hands the plan's `dp_sgd` to the stages),
each ε from the accountant and the total from the ledger's `compose`. The same text, without the
timing, is the first log line of a run, whose plan this is: made once per run by `dpdistill run`
(else by the flow), from the split that the data stage then moves into the run or has cached
(pipeline/split_ahead.py), and handed down to the stages.

The time is an estimate, made in seconds by pipeline/plan_time.py (`estimate_seconds`), which
fills `Plan.seconds`; `format_times` prints it. No Prefect here.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.config import PipelineConfig, TeacherConfig
from pipeline.devices import resolve_device, slow_bf16_warning
from pipeline.methods import method_spec
from pipeline.models.base import BUILTIN_PREFIX, shipped_path, tied_head_parameters
from pipeline.privacy.accountant import epsilon_of, resolve_delta
from pipeline.privacy.control_codes import gaussian_sigma
from pipeline.privacy.dp_vocabulary import planned_entry as planned_vocabulary_entry
from pipeline.privacy import monitor as dp_monitor
from pipeline.privacy import private_selection
from pipeline.privacy.control_codes import STAGE as CODES_STAGE
from pipeline.privacy.ledger import (
    LedgerEntry, LedgerTotal, composed, composing_accountant, run_delta, with_pld_epsilons)
from pipeline.privacy.pld import DP_SGD_REPLACE_SENSITIVITY, HISTOGRAM_REPLACE_SENSITIVITY
from pipeline.stages.data import PlannedSplit, planned_split
from pipeline.privacy.dpsgd import DpSgdPlan, plan_dp_sgd
from pipeline.stages.teacher.monitor import monitor_points

BUSY_SHARE = 0.7  # below this share of the CPU, the plan says the machine is busy


@dataclass
class Plan:
    name: str
    n: int
    """Privacy units (records, or users) the DP-SGD stages sample from."""
    unit: str
    n_test: int
    entries: list[LedgerEntry]
    """The DP releases as the ledger will record them (control codes, DP-SGD stages)."""
    total: LedgerTotal
    sampling_probability: dict[str, float]
    batch_size: int
    n_validation: int = 0
    seconds: dict[str, tuple[float | None, str]] = field(default_factory=dict)
    """Per stage: (estimated seconds or None, how it was estimated)."""
    dp_sgd: dict[str, DpSgdPlan] = field(default_factory=dict)
    """Per DP-SGD stage: its σ, q, steps and δ, which the flow hands the stage (no second calibration)."""
    accounting_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per DP-SGD stage: seconds of σ's calibration and of one ε, which the stage spends too."""
    cpu_share: float | None = None
    """CPU seconds the timed steps got per wall second and thread (pipeline/timing.py): below ~0.7,
    other processes were taking the cores, and the times hold only while they do."""
    warnings: list[str] = field(default_factory=list)
    """Allowed but risky choices, said once by `dpdistill plan` and at the start of a run."""
    selection_noise_sd: float | None = None
    """select_by=private_validation: the sd (nats) of the noise on each candidate's score."""


BUDGET_TOLERANCE = 0.01
"""How far below teacher.target_epsilon the DP-SGD stages' composition may stay (Opacus' tolerance
for one stage's σ)."""


def dp_sgd_budgets(cfg: PipelineConfig, n: int, unit: str = "record") -> dict[str, float]:
    """ε of each DP-SGD training the method runs over N units, such that together, as the ledger
    composes them, they spend teacher.target_epsilon: one stage takes all of it; several take their
    spec's shares of it (pipeline/methods.py; DPKD: half each to the teacher and the student trained
    with KD), scaled up until the accountant's composition of their histories reaches the target.
    Two subsampled Gaussians compose to less than the sum of their ε: DPKD at ε/2 + ε/2 ran at a
    total of 1.34-1.38 where the other methods spent 1.98 (docs/baselines.md)."""
    t = cfg.teacher
    shares = method_spec(cfg.distill.method).budget(t.target_epsilon)
    if len(shares) < 2:
        return shares

    def total(scale: float) -> float:
        plans = [plan_dp_sgd(t, n, unit, eps * scale) for eps in shares.values()]
        history = [(p.sigma, p.sample_rate, p.steps_allowed) for p in plans]
        return epsilon_of(composing_accountant(t.accountant, history), history, plans[0].delta)

    low, high = 1.0, t.target_epsilon / max(shares.values())  # at `high` one stage alone spends the target
    while high - low > 1e-4 and t.target_epsilon - total(low) > BUDGET_TOLERANCE:
        mid = (low + high) / 2
        low, high = (mid, high) if total(mid) <= t.target_epsilon else (low, mid)
    return {stage: math.floor(eps * low * 1e4) / 1e4 for stage, eps in shares.items()}


def _dp_sgd_entry(stage: str, cfg: TeacherConfig, n: int, unit: str,
                  epsilon: float) -> tuple[LedgerEntry, DpSgdPlan, tuple[float, float]]:
    """The stage's planned ledger entry, its σ, q, steps and δ at its share `epsilon` of the budget,
    and the seconds its σ calibration and one ε took here (the run spends them too: the plan's
    time counts them)."""
    t0 = time.perf_counter()
    dp = plan_dp_sgd(cfg, n, unit, epsilon)
    t1 = time.perf_counter()
    history = [(dp.sigma, dp.sample_rate, dp.steps_allowed)]
    epsilon = epsilon_of(cfg.accountant, history, dp.delta)
    return LedgerEntry(
        stage=stage, private=True, epsilon=epsilon, delta=dp.delta,
        accountant=cfg.accountant, mechanism="subsampled_gaussian", noise_multiplier=dp.sigma,
        sample_rate=dp.sample_rate, steps=dp.steps_allowed, max_grad_norm=cfg.max_grad_norm, privacy_unit=unit,
        history=history, replace_one_sensitivity=DP_SGD_REPLACE_SENSITIVITY, validation_monitor=cfg.monitor,
        note=f"planned: target ε={dp.target_epsilon}",
    ), dp, (t1 - t0, time.perf_counter() - t1)


def _monitor_entry(trained: LedgerEntry, cfg: TeacherConfig, n_validation: int) -> LedgerEntry | None:
    """teacher.monitor=dp: the planned entry of the stage's validation-loss releases, as the stage makes it."""
    if cfg.monitor != "dp":
        return None
    releases = len(monitor_points(trained.steps, cfg.log_every))
    z, accountant = dp_monitor.calibrate(cfg.monitor_epsilon, trained.delta, releases, cfg.accountant)
    n = min(cfg.monitor_records or n_validation, n_validation)
    return dp_monitor.ledger_entry(trained.stage, z=z, releases=releases, n=n, clip=cfg.monitor_clip,
                                   target_epsilon=cfg.monitor_epsilon, delta=trained.delta, accountant=accountant,
                                   unit=trained.privacy_unit, secure=cfg.secure_mode)


def private_selection_used(cfg: PipelineConfig) -> bool:
    """Whether the distillation chooses its student on private records (a DP release)."""
    d = cfg.distill
    return method_spec(d.method).distils and d.select_by == "private_validation" and len(d.candidates) > 1


def selection_units(cfg: PipelineConfig, n_validation: int, n_train: int) -> int:
    """The units the private selection scores: the validation split's, then the training split's
    with distill.selection_split=train+validation, the first `selection_records` of them."""
    d = cfg.distill
    n = n_validation + (n_train if d.selection_split == "train+validation" else 0)
    return min(d.selection_records or n, n)


def _selection_entry(cfg: PipelineConfig, delta: float, n_validation: int, n_train: int,
                     unit: str) -> tuple[LedgerEntry, float] | None:
    """select_by=private_validation: the planned entry of the candidates' noisy scores, as the stage
    makes it, and the sd (nats) of the noise on each score."""
    if not private_selection_used(cfg):
        return None
    d = cfg.distill
    n = selection_units(cfg, n_validation, n_train)
    z, accountant = private_selection.calibrate(d.selection_epsilon, delta, len(d.candidates), cfg.teacher.accountant)
    entry = private_selection.ledger_entry(
        z=z, candidates=len(d.candidates), n=n, clip=d.selection_clip, target_epsilon=d.selection_epsilon,
        delta=delta, accountant=accountant, unit=unit, secure=cfg.teacher.secure_mode,
        train=d.selection_split == "train+validation")
    return entry, z * d.selection_clip / max(n, 1)


def dp_tokenizer_used(cfg: PipelineConfig) -> bool:
    """Whether the run builds a pair with a DP vocabulary (base_models.tokenizer=dp, a builtin model named)."""
    return cfg.base_models.tokenizer == "dp" and any(
        m.startswith("builtin:") for m in (cfg.teacher.model, cfg.distill.student_model))


def _tokenizer_entry(cfg: PipelineConfig, n: int, unit: str) -> LedgerEntry | None:
    if not dp_tokenizer_used(cfg):
        return None
    b = cfg.base_models
    return planned_vocabulary_entry(b.tokenizer_epsilon, b.tokenizer_max_words,
                                    resolve_delta(cfg.teacher.target_delta, n), cfg.teacher.accountant, unit)


def _codes_entry(cfg: PipelineConfig, n: int, unit: str) -> LedgerEntry | None:
    codes = cfg.control_codes
    if not method_spec(cfg.distill.method).releases_codes:
        return None  # the DP-SGD students prompt nothing
    if codes.mechanism == "exact":
        return LedgerEntry(stage=CODES_STAGE, private=False, epsilon=None, mechanism="exact",
                           note="NOT differentially private: the exact control-code counts")
    delta = resolve_delta(cfg.teacher.target_delta, n)
    if codes.mechanism == "geometric":
        return LedgerEntry(stage=CODES_STAGE, private=True, epsilon=codes.epsilon, delta=0.0,
                           mechanism="geometric", privacy_unit=unit, note="planned")
    sigma, accountant = gaussian_sigma(codes.epsilon, delta, cfg.teacher.accountant)
    history = [(sigma, 1.0, 1)]
    return LedgerEntry(stage=CODES_STAGE, private=True, epsilon=epsilon_of(accountant, history, delta),
                       delta=delta, accountant=accountant, mechanism="gaussian", noise_multiplier=sigma,
                       sample_rate=1.0, steps=1, privacy_unit=unit, history=history,
                       replace_one_sensitivity=HISTOGRAM_REPLACE_SENSITIVITY, note="planned")


# The distill fields that only the distillation reads: a DP-SGD student (dp_sgd, dpkd) trains with
# the teacher section's recipe (flows/tasks.py dp_student_task), so a value set here is unused.
DISTILL_ONLY = ("epochs", "batch_size", "learning_rate", "warmup_fraction", "weight_decay", "patience")


def ignored_distill_settings(cfg: PipelineConfig) -> str | None:
    """The warning for distill training settings a DP-SGD student does not read, when any is set."""
    ignored = [f for f in DISTILL_ONLY if f in cfg.distill.model_fields_set]
    if not method_spec(cfg.distill.method).dp_student or not ignored:
        return None
    t = cfg.teacher
    return (f"distill.method={cfg.distill.method} trains the student with DP-SGD on the teacher section's "
            f"settings (teacher.epochs={t.epochs}, teacher.batch_size={t.batch_size}, "
            f"teacher.learning_rate={t.learning_rate:g}, teacher.max_grad_norm={t.max_grad_norm:g}, ...), not the "
            f"distill section's: {', '.join(f'distill.{f}={getattr(cfg.distill, f)}' for f in ignored)} "
            f"{'is' if len(ignored) == 1 else 'are'} not used. To tune the DP-SGD student, set teacher.* "
            "(e.g. teacher.epochs, teacher.learning_rate).")


def _warnings(cfg: PipelineConfig) -> list[str]:
    out = [w] if (w := ignored_distill_settings(cfg)) else []
    if cfg.precision != "bf16" or cfg.device.startswith("cuda"):  # pre-flight checks a GPU's bf16
        return out
    warning = slow_bf16_warning(resolve_device(cfg.device, cfg.precision), cfg.precision)
    return out + ([warning] if warning else [])


def _untied_parameters(cfg: PipelineConfig, stage: str) -> int | None:
    """What untying lm_head adds to the stage's model, from its config (None: not readable yet,
    e.g. builtin models still to be built from base_models.corpus; 0 where the head stays tied:
    teacher.untie_lm_head=false, or a mode that freezes it)."""
    from transformers import AutoConfig

    if not cfg.teacher.unties_head:
        return 0

    name = cfg.teacher.model if stage == "teacher" else cfg.distill.student_model
    if name.startswith(BUILTIN_PREFIX) and cfg.base_models.corpus is not None:
        return None
    try:
        return tied_head_parameters(AutoConfig.from_pretrained(shipped_path(name)))
    except (OSError, ValueError):
        return None


def make_plan(cfg: PipelineConfig, say: Callable[[str], None] | None = None,
              split: PlannedSplit | None = None) -> Plan:
    """The run's privacy numbers; writes nothing (pipeline/plan_time.py `estimate_seconds` adds
    the time). `say` receives a line as each part starts (the CLI prints them: the plan takes
    seconds). `split`: the config's `planned_split`, where the caller has read it already."""
    say = say or (lambda line: None)
    say("plan: reading the data and calibrating σ" if split is None else "plan: calibrating σ")
    if split is None:
        split = planned_split(cfg.data, Path(cfg.run_root), cfg.control_codes.domain)
    n, unit = split.n, split.unit
    entries, dp_sgd, accounting = [], {}, {}
    if vocabulary := _tokenizer_entry(cfg, n, unit):
        entries.append(with_pld_epsilons(vocabulary))
    if codes := _codes_entry(cfg, n, unit):
        entries.append(with_pld_epsilons(codes))
    for stage, eps in dp_sgd_budgets(cfg, n, unit).items():
        entry, dp_sgd[stage], accounting[stage] = _dp_sgd_entry(stage, cfg.teacher, n, unit, eps)
        entry.untied_parameters = _untied_parameters(cfg, stage)
        entries.append(with_pld_epsilons(entry))
        if monitored := _monitor_entry(entry, cfg.teacher, split.n_validation_units):
            entries.append(with_pld_epsilons(monitored))
    delta = run_delta(entries)
    selected, selection_sd = _selection_entry(cfg, delta, split.n_validation_units, n, unit) or (None, None)
    if selected:
        entries.append(with_pld_epsilons(selected))
    plan = Plan(name=cfg.name, n=n, unit=unit, n_test=len(split.test_texts), entries=entries,
                total=composed(entries, cfg.teacher.accountant).total,
                sampling_probability={stage: dp.sampling_probability for stage, dp in dp_sgd.items()},
                batch_size=cfg.teacher.batch_size, n_validation=split.n_validation, dp_sgd=dp_sgd,
                accounting_seconds=accounting,
                warnings=_warnings(cfg), selection_noise_sd=selection_sd)
    return plan


# --- text -------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 600:
        return f"{seconds / 60:.1f} min"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _selection_odds(sd: float, unit: str) -> str:
    """How well noisy scores of sd `sd` tell two candidates 10 % apart in perplexity: the better
    one is kept with probability Φ(ln 1.1 / (√2·sd)) (both scores carry independent noise)."""
    gap = math.log(1.1)
    kept = 0.5 * (1 + math.erf(gap / (math.sqrt(2) * sd) / math.sqrt(2)))
    return (f"of two candidates 10 % apart in validation perplexity ({gap:.3f} nats of mean loss), the private "
            f"choice keeps the better with probability {kept:.2f} (0.50 is a coin toss): more scored {unit}s "
            "(the training split too: distill.selection_split=train+validation, the default; "
            "data.validation_fraction), a larger "
            "distill.selection_epsilon or fewer candidates narrow its noise; select_by=teacher_kl reads no private "
            "record")


def format_plan(plan: Plan) -> str:
    lines = [f"plan of run {plan.name!r}: nothing trained or written yet",
             f"  N = {plan.n} training {plan.unit}s (after the data config's filtering and split), "
             f"{plan.n_test} test records"]
    for e in plan.entries:
        if e.mechanism == "subsampled_gaussian":
            lines.append(
                f"  {e.stage}: DP-SGD, batch size {plan.batch_size} (expected), q = {e.sample_rate:.6g} "
                f"(Poisson probability {plan.sampling_probability[e.stage]:.6g}), σ = {e.noise_multiplier:.4f}, "
                f"{e.steps} steps, ε = {e.epsilon:.4f} at δ = {e.delta:.3g} ({e.accountant} accountant), "
                f"replace-one ε = {e.epsilon_replace_one:.4f}")
            if added := e.untied_parameters:
                lines.append(f"    lm_head untied from the input embedding for DP-SGD: +{added:,} parameters "
                             "(a tied weight would get one clipping norm per use); the saved model keeps its own head")
        elif e.delta_threshold:
            lines.append(f"  tokenizer (base_models.tokenizer=dp): Gaussian word histogram, σ = {e.noise_multiplier:.4f}·√k, "
                         f"ε = {e.epsilon:.4f} at δ = {e.delta:.3g} ({e.accountant} accountant) plus the threshold's "
                         f"δ = {e.delta_threshold:.3g}, replace-one ε = {e.epsilon_replace_one:.4f}")
        elif e.mechanism == "gaussian" and e.stage != CODES_STAGE:  # the DP monitor's, the private selection's
            lines.append(f"  {e.stage}: Gaussian release: {e.note}; ε = {e.epsilon:.4f} at δ = {e.delta:.3g} "
                         f"({e.accountant} accountant), replace-one ε = {e.epsilon_replace_one:.4f}")
            if e.stage == private_selection.STAGE and plan.selection_noise_sd:
                lines.append("    " + _selection_odds(plan.selection_noise_sd, plan.unit))
        elif e.mechanism == "gaussian":
            lines.append(f"  control codes: Gaussian histogram, σ = {e.noise_multiplier:.4f}, ε = {e.epsilon:.4f} "
                         f"at δ = {e.delta:.3g} ({e.accountant} accountant), replace-one ε = {e.epsilon_replace_one:.4f}")
        elif e.mechanism == "geometric":
            lines.append(f"  control codes: geometric histogram, pure ε = {e.epsilon:.4f}, "
                         f"replace-one ε = {e.epsilon_replace_one:.4f}")
        else:
            lines.append("  control codes: exact counts, NOT differentially private")
    t = plan.total
    lines.append(f"  total: ε = {t.epsilon:.4f}, δ = {t.delta:.3g} ({t.composition})"
                 + ("" if t.complete else f"; incomplete: {t.note}"))
    lines.append(f"  replace-one: ε = {t.epsilon_replace_one:.4f} at the same δ (dp-accounting PLD). ε above is "
                 "add/remove-one; N is published, so replace-one is the guarantee against an attacker "
                 "who knows it (docs/privacy.md)")
    if plan.seconds:
        lines.append(format_times(plan))
    return "\n".join(lines)


def format_times(plan: Plan) -> str:
    """The time lines of `format_plan`: `dpdistill plan` prints them apart, once timed, after
    the privacy numbers it prints as soon as it has them."""
    known = sum(s for s, _ in plan.seconds.values() if s)
    lines = [f"  time, estimated (each stage's step timed on its model shapes with random weights "
             f"and token ids, scaled; this machine): ~{_duration(known)} in all"]
    for stage, (seconds, how) in plan.seconds.items():
        lines.append(f"    {stage}: " + (how if not seconds else f"~{_duration(seconds)} ({how})"))
    if plan.cpu_share is not None and plan.cpu_share < BUSY_SHARE:
        # An upper bound, as measured: the SmolLM2 configs' runs on idle cores took 0.63x of it (docs/benchmarks.md).
        # Most likely threads spinning while a partner is descheduled count CPU seconds the idle run does not pay.
        lines.append(f"  this machine is busy: the timed steps got {plan.cpu_share:.0%} of the CPU time their "
                     f"threads could use; with the cores to itself the run would take at most "
                     f"~{_duration(known * plan.cpu_share)} (CPU time counted under contention includes threads' "
                     "waits: run `dpdistill plan` on the idle machine for the figure)")
    return "\n".join(lines)
