"""`dpdistill plan`: what a run will do before it does it: N, q, σ, steps, ε and the time.

    plan = make_plan(cfg, timing=True)
    print(format_plan(plan))

Nothing is trained and nothing is written. Every number is the run's own: N from the data
stage's split (`data.planned_split`), q, steps, δ and σ of each DP-SGD stage from
`dpsgd.plan_dp_sgd` (the stage's own calibration: the flow hands the plan's `dp_sgd` to the stages),
each ε from the accountant and the total from the ledger's `compose`. The same text, without the
timing, is the first log line of a run, whose plan this is: made once per run by `dpdistill run`
(else by the flow), from the split that the data stage then moves into the run or has cached
(pipeline/split_ahead.py), and handed down to the stages.

The time is an estimate, made in seconds: each stage's own step (the teacher's Opacus DP step,
a distillation step, a sampled `generate` call, an evaluation batch) timed on each configured
model shape, randomly initialised in the run's precision, on random token ids (public; never a
private record), scaled by the step counts (pipeline/timing.py). The test records' token counts
stand in for every length the run will see: the teacher's padded batches, the synthetic samples'
expected lengths (generation, distillation) and evaluation's batches; a timing and a test-split
statistic, both published anyway (README, "Not protected"). No Prefect here.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.config import PipelineConfig, TeacherConfig
from pipeline.devices import Runtime, resolve_device, slow_bf16_warning
from pipeline.methods import method_spec
from pipeline.models.base import (BUILTIN_PREFIX, ModelError, base_models_built, load_tokenizer, shipped_path,
                                  tied_head_parameters)
from pipeline.privacy.accountant import epsilon_of, resolve_delta
from pipeline.privacy.control_codes import gaussian_sigma
from pipeline.privacy.dp_vocabulary import planned_entry as planned_vocabulary_entry
from pipeline.privacy import monitor as dp_monitor
from pipeline.privacy import private_selection
from pipeline.privacy.control_codes import STAGE as CODES_STAGE
from pipeline.privacy.ledger import LedgerEntry, LedgerTotal, composed, run_delta, with_pld_epsilons
from pipeline.privacy.pld import DP_SGD_REPLACE_SENSITIVITY, HISTOGRAM_REPLACE_SENSITIVITY
from pipeline.stages.adherence import declared_values
from pipeline.prompts import PromptFormat
from pipeline.records import CODE_JOINER
from pipeline.stages.data import PlannedSplit, planned_split
from pipeline.stages.distill import lockstep_key
from pipeline.stages.downstream import MAUVE_TEXTS
from pipeline.privacy.dpsgd import DpSgdPlan, plan_dp_sgd
from pipeline.stages.teacher.monitor import monitor_points
from pipeline.timing import StepTimer, spread

PROMPT_TOKENS = 16  # a control-code prompt, about ("Business Category: Bars\tReview Stars: 4.0\n\n")
BUSY_SHARE = 0.7  # below this share of the CPU, the plan says the machine is busy
CHARS_PER_TOKEN = 4  # GPT-2-style BPE on English prose, for a tokenizer the run has yet to build


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


def dp_sgd_budgets(cfg: PipelineConfig) -> dict[str, float]:
    """ε of each DP-SGD training the method runs: its spec's shares of teacher.target_epsilon
    (pipeline/methods.py; DPKD gives ε/2 to the teacher and ε/2 to the student trained with KD)."""
    return method_spec(cfg.distill.method).budget(cfg.teacher.target_epsilon)


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
    e.g. builtin models still to be built from base_models.corpus; 0 with teacher.untie_lm_head=false)."""
    from transformers import AutoConfig

    if not cfg.teacher.untie_lm_head:
        return 0

    name = cfg.teacher.model if stage == "teacher" else cfg.distill.student_model
    if name.startswith(BUILTIN_PREFIX) and cfg.base_models.corpus is not None:
        return None
    try:
        return tied_head_parameters(AutoConfig.from_pretrained(shipped_path(name)))
    except (OSError, ValueError):
        return None


def make_plan(cfg: PipelineConfig, timing: bool = True, say: Callable[[str], None] | None = None,
              split: PlannedSplit | None = None) -> Plan:
    """The run's privacy numbers (and with `timing`, a time estimate per stage); writes nothing.
    `say` receives a line as each part starts (the CLI prints them: the plan takes seconds).
    `split`: the config's `planned_split`, where the caller has read it already."""
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
    for stage, eps in dp_sgd_budgets(cfg).items():
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
    if timing:
        plan.seconds = estimate_seconds(cfg, plan, split, say)
    return plan


# --- time -------------------------------------------------------------------------------

def _tokenizer(cfg: PipelineConfig):
    """The run's tokenizer when it exists before the run (the shipped pair's, a local or cached
    checkpoint's); None for builtin models the run will build from a corpus."""
    name = cfg.distill.student_model
    if name.startswith(BUILTIN_PREFIX) and cfg.base_models.corpus is not None:
        return None
    try:
        return load_tokenizer(shipped_path(name))
    except ModelError:
        return None


def _token_counts(tok, codes: list[str], texts: list[str], prompt: PromptFormat) -> list[int]:
    """Tokens of each record as the stages encode them; ~4 characters a token (GPT-2 BPE on
    English prose) when the tokenizer does not exist yet."""
    if tok is None:
        return [max(1, (len(prompt.text(c)) + len(t)) // CHARS_PER_TOKEN + 1) for c, t in zip(codes, texts)]
    # encode_record's count (prompt and text tokenized apart, plus eos): the few prompts once, the texts batched.
    prompts = {c: len(prompt.ids(tok, c)) for c in set(codes)}
    bodies = tok(list(texts), add_special_tokens=False)["input_ids"]
    return [prompts[c] + len(b) + 1 for c, b in zip(codes, bodies)]


def _prompt_lengths(cfg: PipelineConfig, tok) -> list[int]:
    """Token lengths of the possible generation prompts (declared domain × tokenizer), else
    one typical length. Generation batches prompts of one length together."""
    domain = cfg.control_codes.domain
    if tok is None or domain is None:
        return [PROMPT_TOKENS]
    parts = [list(v.values()) for v in declared_values(cfg.data, domain, None).values()]
    prompt = PromptFormat.of(cfg.data)
    return sorted({len(prompt.ids(tok, CODE_JOINER.join(p))) for p in itertools.product(*parts)})


def padded_tokens(lengths: list[int], batch: int) -> int:
    """Token slots of `lengths` batched shortest first (as pipeline/models/scoring.py
    `by_length` and the teacher's physical batches are), each batch padded to its longest."""
    ordered = sorted(lengths)
    return sum(len(ordered[i:i + batch]) * max(ordered[i:i + batch]) for i in range(0, len(ordered), batch))


def _window_batches(lengths: list[int], window: int, batch: int) -> tuple[int, int]:
    """Batches evaluation scores for one model and their padded token slots: the joined stream's
    windows, then each record's (pipeline/stages/evaluate.py `perplexity`)."""
    joined = sum(lengths)
    stream = [window] * (joined // window) + ([joined % window] if joined % window > 1 else [])
    per_record = [min(window, n - i) for n in lengths for i in range(0, n, window) if n - i > 1]
    parts = [part for part in (stream, per_record) if part]
    return (sum(math.ceil(len(part) / batch) for part in parts),
            sum(padded_tokens(part, batch) for part in parts))


def _typical_lengths(lengths: list[int], batch: int, cap: int) -> list[int]:
    """`batch` token lengths spread evenly over the quantiles of `lengths`, each capped at `cap`:
    a batch as the run's will typically be, its longest the padding (the (2b-1)/2b quantile, near
    the expected longest of b draws). Without lengths (an empty test split), all `cap`."""
    if not lengths:
        return [cap] * batch
    return [max(2, n) for n in spread([min(n, cap) for n in lengths], batch)]


def _dp_sgd_seconds(cfg: PipelineConfig, plan: Plan, timer: StepTimer,
                    lengths: list[int]) -> dict[str, tuple[float, str]]:
    """Each DP-SGD stage: its logical steps (the stages' Opacus step on random ids), the validation
    loss at each monitor point (teacher.monitor dp or public; none scores nothing) and σ's calibration.
    A step's records are q·N in expectation, with lengths spread over the quantiles of `lengths` (the
    records' token counts, the test split's standing in for the training split's), cut shortest first
    into physical batches each padded to its longest (teacher.RankShareSampler): the step is timed at
    its longest record and scaled by the padded tokens' share."""
    t, out = cfg.teacher, {}
    for entry in plan.entries:
        if entry.mechanism != "subsampled_gaussian":
            continue
        name = t.model if entry.stage == "teacher" else cfg.distill.student_model
        timer.say(f"plan: timing the {entry.stage}'s DP-SGD step ({name}, {t.grad_sample_mode} clipping)")
        records = plan.sampling_probability[entry.stage] * plan.n
        drawn = _typical_lengths(lengths, max(1, round(records)), t.max_length)  # one step's records
        padded = max(drawn)
        share = padded_tokens(drawn, t.physical_batch_size) / (len(drawn) * padded)  # of the step at `padded`
        step = timer.teacher_step(name, records, padded)
        if entry.stage == "dp-student" and method_spec(cfg.distill.method).teacher_logits:  # DPKD: the teacher's forward
            step += records / t.physical_batch_size * timer.forward(t.model, t.physical_batch_size, padded)
        step *= share
        checks = len(monitor_points(entry.steps, t.log_every))
        scored = min(t.monitor_records or plan.n_validation, plan.n_validation)  # monitor=public: timed at the validation split's size
        monitor = 0.0 if t.monitor == "none" else checks * timer.score(name, scored, t.max_length)
        calibration, one_epsilon = plan.accounting_seconds[entry.stage]
        accounting = calibration + checks * one_epsilon  # the run's plan calibrates σ; the stage reports ε
        out[entry.stage] = (entry.steps * step + monitor + accounting,
                            f"{entry.steps} steps of {records:.0f} (expected) × ≤ {padded} tokens at {step:.3g} s "
                            f"with {t.grad_sample_mode} clipping, validation and σ calibration "
                            f"{monitor + accounting:.0f} s")
    return out


def _new_tokens(cfg: PipelineConfig, prompt: int, lengths: list[int]) -> tuple[int, list[int]]:
    """A sample's token budget after a `prompt`, and the new tokens of the samples to expect: as
    many as each record of `lengths` has after its prompt (the teacher writes records like the
    training split's; the test split's stand in for them), within the budget."""
    g = cfg.generate
    budget = max(1, min(g.max_length - prompt, g.max_new_tokens or g.max_length))
    return budget, [min(budget, max(1, n - prompt)) for n in lengths] or [budget]


def _generation_seconds(cfg: PipelineConfig, timer: StepTimer, prompts: list[int],
                        lengths: list[int]) -> tuple[float, str]:
    """The fast engine decodes `batch_size` rows at a time and refills a row with the next prompt,
    of any length, as its sample ends: the samples' expected new tokens, `batch_size` at a time.
    Transformers' `generate` (engine hf) runs batches of equal-length prompts, each to its budget:
    full batches of the middle prompt length, and one part-filled batch per other length."""
    g = cfg.generate
    timer.say(f"plan: timing generation ({cfg.teacher.model}, batches of {g.batch_size})")
    hf = g.engine == "hf"
    batches = math.ceil(g.num_samples / g.batch_size) + (len(prompts) - 1 if hf else 0)
    mid = prompts[len(prompts) // 2]
    budget, samples = _new_tokens(cfg, mid, lengths)
    new = budget if hf else max(1, round(sum(samples) / len(samples)))
    longest = max(_typical_lengths(samples, g.batch_size, budget))  # the deepest of a batch's rows
    seconds = timer.generate_batch(cfg.teacher.model, g.batch_size, mid, new, longest)
    return (batches * seconds, f"{batches} batches of up to {g.batch_size} × {new} new tokens at {seconds:.3g} s "
            f"({'each sample to its budget' if hf else f'the budget {budget}, {new} expected'}; "
            f"prompts of {len(prompts)} token lengths), one worker")


def _distillation_seconds(cfg: PipelineConfig, timer: StepTimer, prompt: int, lengths: list[int],
                          private_records: int = 0) -> tuple[float, str]:
    """Every candidate's training (distill.candidates), then the selection: the DP teacher
    samples `selection_samples` untruncated texts and scores them with each candidate, and with
    select_by=private_validation each candidate scores `private_records` private records (as
    long as the median test record). The synthetic samples are `prompt` and their expected new
    tokens (`_new_tokens`) long."""
    d, distils = cfg.distill, method_spec(cfg.distill.method).distils
    built = d.candidate_configs() if distils else []  # the config's, built when it was validated
    candidates = [c for _, c in built] if len(built) > 1 else [built[0][1] if built else d]
    samples = [prompt + n for n in _new_tokens(cfg, prompt, lengths)[1]]
    stepped_with = set()  # candidates stepped together share each batch's teacher forward (distill.lockstep_key)
    parts = []
    for c in candidates:
        parts.append(_candidate_seconds(cfg, c, timer, prompt, samples, teacher_paid=lockstep_key(c) in stepped_with))
        stepped_with.add(lockstep_key(c))
    total = sum(seconds for seconds, _ in parts)
    what = parts[0][1] if len(parts) == 1 else f"{len(parts)} candidates: " + "; ".join(w for _, w in parts)
    if len(candidates) > 1:
        g = cfg.generate
        batches = math.ceil(d.selection_samples / 64)
        sample = batches * timer.generate_batch(cfg.teacher.model, 64, prompt, g.max_length - prompt)
        score = (timer.score(cfg.teacher.model, d.selection_samples, g.max_length)
                 + len(candidates) * timer.score(d.student_model, d.selection_samples, g.max_length))
        total += sample + score
        what += f"; selection {sample + score:.0f} s ({d.selection_samples} untruncated teacher samples, scored)"
    if d.keep_samples == "code_adherent" and cfg.control_codes.domain:  # the teacher scores each sample under each value
        g = cfg.generate
        sequences = (g.num_samples - round(g.num_samples * g.validation_fraction)) * sum(
            len(v) for v in cfg.control_codes.domain.values() if len(v) >= 2)
        kept = math.ceil(sequences / d.batch_size) * timer.score(cfg.teacher.model, d.batch_size, g.max_length)
        total += kept
        what += f"; keeping the code-adherent samples {kept:.0f} s ({sequences} teacher-scored sequences)"
    if private_records and len(candidates) > 1:
        length = min(cfg.teacher.max_length, sorted(lengths)[len(lengths) // 2])
        private = len(candidates) * math.ceil(private_records / d.batch_size) * timer.score(
            d.student_model, d.batch_size, length)
        total += private
        what += f"; the private scores of {private_records} records {private:.0f} s"
    return total, what


def _candidate_seconds(cfg: PipelineConfig, d, timer: StepTimer, prompt: int, samples: list[int],
                       teacher_paid: bool = False) -> tuple[float, str]:
    """One candidate's training; `teacher_paid`: a candidate stepped beside it already pays for
    the teacher's forward pass on every batch."""
    g, distils = cfg.generate, method_spec(cfg.distill.method).distils
    n_validation = round(g.num_samples * g.validation_fraction)
    n_synthetic = g.num_samples - n_validation
    if d.num_synthetic is not None:
        n_synthetic = min(n_synthetic, d.num_synthetic)
    steps = d.epochs * math.ceil(n_synthetic / d.batch_size)
    on_the_fly = distils and (d.alpha > 0 or d.beta > 0) and d.teacher_top_k is None and not teacher_paid
    timer.say(f"plan: timing a distillation step ({d.student_model}" + (f" and {cfg.teacher.model})" if on_the_fly else ")"))
    batch = _typical_lengths(samples, d.batch_size, g.max_length)
    step = timer.distill_step(d.student_model, cfg.teacher.model if on_the_fly else None, batch, prompt)
    evals = math.ceil(steps / d.eval_every) * timer.score(d.student_model, n_validation, g.max_length)
    cache = 0.0
    if distils and d.teacher_top_k is not None:
        cache = timer.forward(cfg.teacher.model, n_synthetic, g.max_length)  # once per synthetic set
    return (steps * step + evals + cache,
            f"{steps} steps of {d.batch_size} samples of ~{sum(batch) / len(batch):.0f} tokens at {step:.3g} s"
            + (" (student forward+backward, teacher forward)" if on_the_fly else
               " (the teacher's forward shared)" if teacher_paid else "")
            + f", validation {evals:.0f} s" + (f", teacher top-k cache {cache:.0f} s" if cache else ""))


def _evaluation_seconds(cfg: PipelineConfig, plan: Plan, timer: StepTimer, tok,
                        test_tokens: list[int]) -> tuple[float, str]:
    """Perplexity of every model on the test windows, and the DP teacher's code adherence."""
    e, t, d = cfg.evaluate, cfg.teacher, cfg.distill
    spec = method_spec(d.method)
    # the base and distilled students; the base and DP teachers (the ε = 0 control: the base one)
    names = [d.student_model, d.student_model] + ([t.model, t.model] if spec.dp_teacher else
                                                  [t.model] if spec.generates else [])
    timer.say(f"plan: timing evaluation ({len(names)} models on {plan.n_test} test records)")
    batches, slots = _window_batches(test_tokens, e.window, e.batch_size)
    # A batch costs about its padded tokens' share of a full one (attention's T² term is small here).
    share = slots / (e.batch_size * e.window)
    seconds = sum(share * timer.score(m, e.batch_size, e.window) for m in names)
    how = f"{len(names)} models × {batches} batches of ≤ {e.batch_size}×{e.window} test tokens"
    domain = cfg.control_codes.domain
    if spec.generates and e.adherence_samples and domain is not None:
        candidates = sum(len(v) for v in domain.values() if len(v) >= 2)
        sequences = min(e.adherence_samples, cfg.generate.num_samples) * candidates
        adherence = math.ceil(sequences / e.batch_size) * timer.score(t.model, e.batch_size, cfg.generate.max_length)
        seconds += adherence
        how += f", code adherence {sequences} sequences {adherence:.0f} s"
    texts = min(e.mauve_texts, MAUVE_TEXTS, plan.n_test, cfg.generate.num_samples)
    if spec.generates and texts >= 50:  # downstream.mauve_score: the DP teacher's features
        mauve = 2 * math.ceil(texts / e.batch_size) * timer.forward(t.model, e.batch_size, e.window)
        seconds += mauve
        how += f", MAUVE's features of {texts} texts a side {mauve:.0f} s"
    return seconds, how


def estimate_seconds(cfg: PipelineConfig, plan: Plan, split: PlannedSplit,
                     say: Callable[[str], None] | None = None) -> dict[str, tuple[float | None, str]]:
    """Seconds per stage: each stage's own step timed on the configured shapes (pipeline/timing.py),
    scaled by the step counts."""
    timer = StepTimer(cfg, Runtime.from_config(cfg), say)
    out: dict[str, tuple[float | None, str]] = {}
    b = cfg.base_models
    builtin = [m for m in (cfg.teacher.model, cfg.distill.student_model) if m.startswith(BUILTIN_PREFIX)]
    if builtin and b.corpus is None:
        out["base-models"] = (0.0, "shipped with the package")
    elif builtin and base_models_built(b):
        out["base-models"] = (0.0, "cached")
    elif builtin:
        timer.say("plan: timing the builtin models' pretraining steps")
        out["base-models"] = (sum(spec.steps * timer.distill_step(f"{BUILTIN_PREFIX}{which}", None,
                                                                  [b.context_length] * spec.batch_size, 0)
                                  for which, spec in (("teacher", b.teacher), ("student", b.student))),
                              "pretraining steps of both builtin models (plus their tokenizer)")
    tok = _tokenizer(cfg)
    test_tokens = _token_counts(tok, split.test_codes, split.test_texts, PromptFormat.of(cfg.data))
    out.update(_dp_sgd_seconds(cfg, plan, timer, test_tokens))
    if method_spec(cfg.distill.method).generates:
        prompts = _prompt_lengths(cfg, tok)
        out["generation"] = _generation_seconds(cfg, timer, prompts, test_tokens)
        private = 0
        if private_selection_used(cfg):  # the records of the scored units, at the validation split's records per unit
            units = selection_units(cfg, split.n_validation_units, split.n)
            private = round(units * split.n_validation / max(split.n_validation_units, 1))
        out["distillation"] = _distillation_seconds(cfg, timer, prompts[len(prompts) // 2], test_tokens, private)
    out["evaluation"] = _evaluation_seconds(cfg, plan, timer, tok, test_tokens)
    plan.cpu_share = timer.cpu_share()
    return out


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
