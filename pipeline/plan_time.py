"""The plan's time: seconds per stage, estimated before a run (`dpdistill plan` prints them).

    plan = make_plan(cfg)                                   # pipeline/plan.py: the privacy numbers
    plan.seconds = estimate_seconds(cfg, plan, split)

Each stage's own step (the teacher's Opacus DP step, a distillation step, a sampled `generate`
call, an evaluation batch) is timed on each configured model shape, randomly initialised in the
run's precision, on random token ids (public; never a private record), and scaled by the step
counts of the plan (pipeline/timing.py times the steps). The test records' token counts stand in
for every length the run will see: the teacher's padded batches, the synthetic samples' expected
lengths (generation, distillation) and evaluation's batches; a timing and a test-split
statistic, both published anyway (README, "Not protected"). Nothing is trained or written; no
Prefect here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from pipeline.config import PipelineConfig
from pipeline.devices import Runtime
from pipeline.methods import method_spec
from pipeline.models.base import BUILTIN_PREFIX, ModelError, base_models_built, load_tokenizer, shipped_path
from pipeline.plan import Plan, private_selection_used, selection_units
from pipeline.prompts import PromptFormat
from pipeline.records import CODE_JOINER
from pipeline.stages.adherence import declared_values
from pipeline.stages.data import PlannedSplit
from pipeline.stages.distill import lockstep_key
from pipeline.stages.downstream import MAUVE_TEXTS
from pipeline.stages.teacher.monitor import monitor_points
from pipeline.timing import StepTimer, spread

PROMPT_TOKENS = 16  # a control-code prompt, about ("Business Category: Bars\tReview Stars: 4.0\n\n")
CHARS_PER_TOKEN = 4  # GPT-2-style BPE on English prose, for a tokenizer the run has yet to build


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
