"""`dpdistill plan`: what a run will do before it does it: N, q, σ, steps, ε and the time.

    plan = make_plan(cfg, timing=True)
    print(format_plan(plan))

Nothing is trained and nothing is written. Every number is the run's own: N from the data
stage's split (`data.training_units`), q and steps from the teacher's Poisson schedule, σ from
the teacher's calibration (`teacher.calibrate_noise`), each ε from the accountant and the total
from the ledger's `compose`. The same text, without the timing, is the first log line of a run.

The time is an estimate: one forward+backward of each configured model shape, randomly
initialised, on random token ids (public; never a private record), scaled by the step
counts; generation times one short `generate` call and scales it per token. No Prefect here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from pipeline.privacy.control_codes import gaussian_sigma
from pipeline.config import PipelineConfig, TeacherConfig
from pipeline.stages.data import training_units
from pipeline.privacy.ledger import LedgerEntry, LedgerTotal, compose
from pipeline.models.base import BUILTIN_PREFIX, SHIPPED, base_models_built, tiny_gpt2
from pipeline.privacy.accountant import epsilon_of, resolve_delta
from pipeline.stages.teacher import calibrate_noise, poisson_schedule

PROMPT_TOKENS = 16  # a control-code prompt, about ("Business Category: Bars\tReview Stars: 4.0\n\n")


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
    seconds: dict[str, tuple[float | None, str]] = field(default_factory=dict)
    """Per stage: (estimated seconds or None, how it was estimated)."""


def dp_sgd_budgets(cfg: PipelineConfig) -> dict[str, float]:
    """ε of each DP-SGD training the method runs, as the flow splits the budget: DPKD gives
    ε/2 to the teacher and ε/2 to the student trained with KD; dp_sgd all of it to the student."""
    eps = cfg.teacher.target_epsilon
    return {
        "distil": {"teacher": eps}, "dp_syn": {"teacher": eps},
        "dpkd": {"teacher": eps / 2, "student": eps - eps / 2}, "dp_sgd": {"student": eps},
    }[cfg.distill.method]


def _dp_sgd_entry(stage: str, cfg: TeacherConfig, n: int, unit: str) -> tuple[LedgerEntry, float]:
    probability, q, steps = poisson_schedule(n, cfg.batch_size, cfg.epochs, unit)
    delta = resolve_delta(cfg.target_delta, n)
    sigma, steps_allowed = calibrate_noise(cfg, q, steps, delta)
    history = [(sigma, q, steps_allowed)]
    return LedgerEntry(
        stage=stage, private=True, epsilon=epsilon_of(cfg.accountant, history, delta), delta=delta,
        accountant=cfg.accountant, mechanism="subsampled_gaussian", noise_multiplier=sigma, sample_rate=q,
        steps=steps_allowed, max_grad_norm=cfg.max_grad_norm, privacy_unit=unit, history=history,
        note=f"planned: target ε={cfg.target_epsilon}",
    ), probability


def _codes_entry(cfg: PipelineConfig, n: int, unit: str) -> LedgerEntry | None:
    codes = cfg.control_codes
    if cfg.distill.method not in ("distil", "dp_syn"):
        return None  # the baselines prompt nothing
    if codes.mechanism == "exact":
        return LedgerEntry(stage="control_codes", private=False, epsilon=None, mechanism="exact",
                           note="NOT differentially private: the exact control-code counts")
    delta = resolve_delta(cfg.teacher.target_delta, n)
    if codes.mechanism == "geometric":
        return LedgerEntry(stage="control_codes", private=True, epsilon=codes.epsilon, delta=0.0,
                           mechanism="geometric", privacy_unit=unit, note="planned")
    sigma, accountant = gaussian_sigma(codes.epsilon, delta, cfg.teacher.accountant)
    history = [(sigma, 1.0, 1)]
    return LedgerEntry(stage="control_codes", private=True, epsilon=epsilon_of(accountant, history, delta),
                       delta=delta, accountant=accountant, mechanism="gaussian", noise_multiplier=sigma,
                       sample_rate=1.0, steps=1, privacy_unit=unit, history=history, note="planned")


def make_plan(cfg: PipelineConfig, timing: bool = True) -> Plan:
    """The run's privacy numbers (and with `timing`, a time estimate per stage); writes nothing."""
    n, unit, n_test = training_units(cfg.data, cfg.seed, cfg.control_codes.domain)
    entries, probability = [], {}
    if codes := _codes_entry(cfg, n, unit):
        entries.append(codes)
    for stage, eps in dp_sgd_budgets(cfg).items():
        entry, probability[stage] = _dp_sgd_entry(stage, cfg.teacher.model_copy(update={"target_epsilon": eps}), n, unit)
        entries.append(entry)
    delta = next(e.delta for e in entries if e.mechanism == "subsampled_gaussian")
    plan = Plan(name=cfg.name, n=n, unit=unit, n_test=n_test, entries=entries,
                total=compose(entries, cfg.teacher.accountant, delta), sampling_probability=probability,
                batch_size=cfg.teacher.batch_size)
    if timing:
        plan.seconds = estimate_seconds(cfg, plan)
    return plan


# --- time -------------------------------------------------------------------------------

def _shape_model(name: str, cfg: PipelineConfig) -> torch.nn.Module:
    """A randomly initialised model of the configured shape: its step costs what the real one's
    does, without loading weights (nor building the builtin ones, which pretrains them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name.startswith(BUILTIN_PREFIX) and cfg.base_models.corpus is None:  # the shipped pair
        name = str(SHIPPED / name[len(BUILTIN_PREFIX):])
    elif name.startswith(BUILTIN_PREFIX):
        spec = getattr(cfg.base_models, name[len(BUILTIN_PREFIX):])
        return tiny_gpt2(spec, cfg.base_models.vocab_size, cfg.base_models.context_length, eos_id=0)

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name))


def _timed(fn) -> float:
    fn()  # the first call pays one-off costs (allocation, kernels)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _random_ids(model, batch: int, length: int) -> torch.Tensor:
    """Random public token ids of the batch's shape: timing never touches a private record."""
    length = min(length, model.config.n_positions if hasattr(model.config, "n_positions")
                 else model.config.max_position_embeddings)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))


def _train_step(model, batch: int, length: int) -> float:
    ids = _random_ids(model, batch, length)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    model.train()
    return _timed(step)


def _forward(model, batch: int, length: int) -> float:
    ids = _random_ids(model, batch, length)
    model.eval()
    with torch.no_grad():
        return _timed(lambda: model(input_ids=ids))


def _generate_per_token(model, batch: int, new_tokens: int = 8) -> float:
    ids = _random_ids(model, batch, PROMPT_TOKENS)
    model.eval()
    with torch.no_grad():
        seconds = _timed(lambda: model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
        ))
    return seconds / new_tokens


def estimate_seconds(cfg: PipelineConfig, plan: Plan) -> dict[str, tuple[float | None, str]]:
    """Seconds per stage: one timed step of each model shape, scaled by the step counts."""
    models: dict[str, torch.nn.Module] = {}

    def model(name: str) -> torch.nn.Module:
        if name not in models:
            models[name] = _shape_model(name, cfg)
        return models[name]

    out: dict[str, tuple[float | None, str]] = {}
    method, b = cfg.distill.method, cfg.base_models
    builtin = [m for m in (cfg.teacher.model, cfg.distill.student_model) if m.startswith(BUILTIN_PREFIX)]
    if builtin and b.corpus is None:
        out["base-models"] = (0.0, "shipped with the package")
    elif builtin and base_models_built(b):
        out["base-models"] = (0.0, "cached")
    elif builtin:
        total = sum(spec.steps * _train_step(tiny_gpt2(spec, b.vocab_size, b.context_length, 0), spec.batch_size,
                                             b.context_length) for spec in (b.teacher, b.student))
        out["base-models"] = (total, "pretraining steps of both builtin models (plus their tokenizer)")

    t = cfg.teacher
    passes = math.ceil(t.batch_size / t.physical_batch_size)  # physical batches per expected logical batch
    for entry in plan.entries:
        if entry.mechanism != "subsampled_gaussian":
            continue
        name = t.model if entry.stage == "teacher" else cfg.distill.student_model
        step = _train_step(model(name), t.physical_batch_size, t.max_length)
        out[entry.stage] = (entry.steps * passes * step,
                            f"{entry.steps} steps × {passes} passes of {t.physical_batch_size}×{t.max_length} "
                            f"tokens at {step:.3g} s, without DP clipping's extra cost (docs/teacher_modes.md)")

    g, d = cfg.generate, cfg.distill
    if method in ("distil", "dp_syn"):
        teacher, student = model(t.model), model(d.student_model)
        new_tokens = g.max_length - PROMPT_TOKENS
        if g.max_new_tokens:
            new_tokens = min(new_tokens, g.max_new_tokens)
        batches = math.ceil(g.num_samples / g.batch_size)
        per_token = _generate_per_token(teacher, g.batch_size)
        out["generation"] = (batches * new_tokens * per_token,
                             f"{batches} batches of {g.batch_size} × {new_tokens} new tokens at {per_token:.3g} s "
                             "per token (no sample stopping early), one worker")
        n_synthetic = g.num_samples - round(g.num_samples * g.validation_fraction)
        if d.num_synthetic is not None:
            n_synthetic = min(n_synthetic, d.num_synthetic)
        steps = d.epochs * math.ceil(n_synthetic / d.batch_size)
        step = _train_step(student, d.batch_size, g.max_length)
        uses_teacher = method == "distil" and (d.alpha > 0 or d.beta > 0)
        if uses_teacher:
            step += _forward(teacher, d.batch_size, g.max_length)
        out["distillation"] = (steps * step, f"{steps} steps of {d.batch_size}×{g.max_length} tokens at {step:.3g} s"
                               + (" (student forward+backward, teacher forward)" if uses_teacher else ""))

    e = cfg.evaluate
    batches = math.ceil(plan.n_test / e.batch_size)
    names = [d.student_model, d.student_model] + ([t.model, t.model] if "teacher" in dp_sgd_budgets(cfg) else [])
    out["evaluation"] = (sum(batches * _forward(model(m), e.batch_size, e.window) for m in names),
                         f"{len(names)} models × {batches} batches of {e.batch_size}×{e.window} tokens "
                         "(an upper bound: records shorter than the window cost less)")
    return out


# --- text -------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_plan(plan: Plan) -> str:
    lines = [f"plan of run {plan.name!r}: nothing trained or written yet",
             f"  N = {plan.n} training {plan.unit}s (after the data config's filtering and split), "
             f"{plan.n_test} test records"]
    for e in plan.entries:
        if e.mechanism == "subsampled_gaussian":
            lines.append(
                f"  {e.stage}: DP-SGD, batch size {plan.batch_size} (expected), q = {e.sample_rate:.6g} "
                f"(Poisson probability {plan.sampling_probability[e.stage]:.6g}), σ = {e.noise_multiplier:.4f}, "
                f"{e.steps} steps, ε = {e.epsilon:.4f} at δ = {e.delta:.3g} ({e.accountant} accountant)")
        elif e.mechanism == "gaussian":
            lines.append(f"  control codes: Gaussian histogram, σ = {e.noise_multiplier:.4f}, ε = {e.epsilon:.4f} "
                         f"at δ = {e.delta:.3g} ({e.accountant} accountant)")
        elif e.mechanism == "geometric":
            lines.append(f"  control codes: geometric histogram, pure ε = {e.epsilon:.4f}")
        else:
            lines.append("  control codes: exact counts, NOT differentially private")
    t = plan.total
    lines.append(f"  total: ε = {t.epsilon:.4f}, δ = {t.delta:.3g} ({t.composition})"
                 + ("" if t.complete else f"; incomplete: {t.note}"))
    if plan.seconds:
        known = sum(s for s, _ in plan.seconds.values() if s)
        lines.append(f"  time, estimated (one timed step of each model shape on random token ids, scaled; "
                     f"this machine): ~{_duration(known)} in all")
        for stage, (seconds, how) in plan.seconds.items():
            lines.append(f"    {stage}: " + (how if not seconds else f"~{_duration(seconds)} ({how})"))
    return "\n".join(lines)
