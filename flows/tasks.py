"""The pipeline's stage tasks: each wraps one stage function of pipeline/ as a Prefect task,
cached under a key of the config it reads and its inputs (flows/caching.py), its result persisted
as JSON of our result types only (flows/results.py). flows/pipeline_flow.py chains them through
flows/stage_runner.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import get_run_logger, task
from prefect.results import ResultStore

from flows.caching import PERPLEXITY_DIR, RESULTS_DIR, STAGE_DIRS, StageCache, stale_reason
from flows.generation import generate_with_workers
from flows.progress import StageProgress
from flows.results import StageResultSerializer, stage_result_storage
from flows.run_dirs import prepare_run_root
from pipeline.config import NODE_FIELDS, PipelineConfig, at_later_defaults
from pipeline.devices import Runtime
from pipeline.manifest import sha256_file
from pipeline.methods import method_spec
from pipeline.models.base import BaseModels, PrivateVocabulary, build_base_models, resolve_model
from pipeline.plan import Plan, dp_tokenizer_used
from pipeline.privacy import private_selection
from pipeline.privacy.budget import budget_of, check_max_epsilon
from pipeline.privacy.control_codes import STAGE as CODES_STAGE
from pipeline.privacy.control_codes import CodesResult, public_control_codes, release_control_codes
from pipeline.privacy.dp_vocabulary import STAGE as VOCABULARY_STAGE
from pipeline.privacy.ledger import LedgerEntry
from pipeline.privacy.private_selection import PrivateValidation
from pipeline.prompts import PromptFormat
from pipeline.records import split_key
from pipeline.stages.adherence import declared_values
from pipeline.split_ahead import adopt, input_hashes, split_ahead
from pipeline.stages.data import DataResult, PlannedSplit, format_public_split, prepare_data, read_planned
from pipeline.stages.distill import DistillResult, distill
from pipeline.stages.evaluate import CANDIDATE_PREFIX, evaluate_models
from pipeline.stages.generate import PLACEMENT_FIELDS, GenerateResult
from pipeline.stages.teacher.monitor import TIMING_WINDOW_STEPS
from pipeline.stages.teacher.recipe import finished_teacher, train_teacher
from pipeline.stages.teacher.state import KnowledgeDistillation, TeacherResult


def _uses_builtin(cfg: PipelineConfig) -> bool:
    return any(m.startswith("builtin:") for m in (cfg.teacher.model, cfg.distill.student_model))


def stage_task(stage: str, config_of: Callable[[PipelineConfig], dict], optional: tuple[str, ...] = (),
               planned: Callable[[Plan], dict] | None = None):
    """A stage's Prefect task, cached under a key of the config it reads and its inputs
    (`optional` inputs only when given; of the run's plan, what `planned` names: flows/caching.py)."""
    return task(name=stage, cache_policy=StageCache(stage=stage, config_of=config_of, optional=optional,
                                                    planned=planned),
                persist_result=True, result_serializer=StageResultSerializer())


def _base_models_key(cfg: PipelineConfig) -> dict:
    key = {"base_models": cfg.base_models.cache_fields() | {"cache_dir": str(cfg.base_models.cache_dir)},
           "builtin": _uses_builtin(cfg)}
    if dp_tokenizer_used(cfg):  # a DP release: its δ, accountant and noise source
        key |= {"delta": cfg.teacher.target_delta, "accountant": cfg.teacher.accountant,
                "secure_mode": cfg.teacher.secure_mode}
    return key


@stage_task("base-models", _base_models_key, optional=("data",))
def base_models_task(cfg: PipelineConfig, data: DataResult | None = None, plan: Plan | None = None,
                     run_dir: Path | None = None) -> BaseModels | None:
    """Build the offline tiny models from public text if a stage names `builtin:...`; with
    base_models.tokenizer=dp (then `data` is given), their vocabulary from the private split's
    words, a DP release (pipeline/privacy/dp_vocabulary.py)."""
    if not _uses_builtin(cfg):
        return None
    if data is None:
        return build_base_models(cfg.base_models, seed=cfg.seed)
    _within_max_epsilon(cfg, data, VOCABULARY_STAGE, plan)
    delta = next(e.delta for e in plan.entries if e.stage == VOCABULARY_STAGE)
    private = PrivateVocabulary(train=data.train, delta=delta, accountant=cfg.teacher.accountant,
                                secure_mode=cfg.teacher.secure_mode, out=run_dir / STAGE_DIRS["base-models"])
    return build_base_models(cfg.base_models, seed=cfg.seed, private=private)


def source_hashes(cfg: PipelineConfig) -> dict[str, str]:
    """sha256 of the private input files: a changed file reruns the data stage and all after."""
    return input_hashes(cfg.data)


def _data_key(cfg: PipelineConfig) -> dict:
    # Whether the splits are deleted after evaluation changes nothing a stage computes. Nor does
    # data.test_split with a data.test_path, and 'keyed' is the split made before the field existed
    # (issue 60): left out then, so run roots from before keep their cached stages.
    # How codes are prompted (data.prompt_template, data.chat_template) changes token ids, not the split.
    unchanged = cfg.data.test_path is not None or cfg.data.test_split == "keyed"
    return cfg.data.model_dump(mode="json", exclude={"keep_private_copies", "prompt_template", "chat_template"}
                               | ({"test_split"} if unchanged else set()))


@stage_task("data", lambda cfg: {"data": _data_key(cfg), "domain": cfg.control_codes.domain})
def data_task(cfg: PipelineConfig, sources: dict[str, str], run_dir: Path, ahead: str | None = None) -> DataResult:
    """The private splits in run_dir/data: the split made for the run's plan in `ahead`
    (`split_for_plan`) moved there when it is this config's, inputs' and key's, else split here.
    `ahead` is in no cache key: where a split was made changes nothing in it."""
    key = split_key(Path(cfg.run_root).resolve())
    out, domain = run_dir / "data", cfg.control_codes.domain
    adopted = adopt(Path(ahead), out, cfg.data, domain, sources, key) if ahead is not None else None
    return adopted if adopted is not None else prepare_data(cfg.data, out, domain, key)


@contextmanager
def split_for_plan(cfg: PipelineConfig, rerun: list[str]) -> Iterator[tuple[PlannedSplit, str | None]]:
    """The run's split as its plan reads it, made once per run (issue 61), and where it was made:
    nowhere when the data stage's cached split serves (no split at all: the stage will reuse it,
    or write the same split again where it is another run's), else a private directory under the
    run root (pipeline/split_ahead.py) for `data_task` to move into the run, deleted on the way
    out. Makes the run root (0700) first, and its split key where it splits, as the run would."""
    root = prepare_run_root(cfg)
    sources = source_hashes(cfg)
    cached = None if "data" in rerun else _cached_split(cfg, sources)
    if cached is not None:
        yield cached, None
        return
    with split_ahead(cfg.data, root, cfg.control_codes.domain, sources) as ahead:
        yield ahead.planned, str(ahead.path)


def _cached_split(cfg: PipelineConfig, sources: dict[str, str]) -> PlannedSplit | None:
    """The plan's split read from the data stage's cached result for this config and inputs,
    when its files are as its manifest says; None when there is none (or it is gone meanwhile)."""
    key = data_task.cache_policy.compute_key(None, {"cfg": cfg, "sources": sources}, {})
    store = ResultStore(result_storage=stage_result_storage((Path(cfg.run_root) / RESULTS_DIR).resolve()),
                        serializer=StageResultSerializer())
    try:
        result = store.read(key).result
        if not isinstance(result, DataResult) or stale_reason(result) is not None:
            return None
        return read_planned(result)
    except (OSError, ValueError):  # none stored, refused (flows/results.py), or deleted by its run meanwhile
        return None


@stage_task("control-codes", lambda cfg: {
    "control_codes": cfg.control_codes, "data": _data_key(cfg), "delta": cfg.teacher.target_delta,
    "accountant": cfg.teacher.accountant, "secure_mode": cfg.teacher.secure_mode,
})
def codes_task(cfg: PipelineConfig, data: DataResult, plan: Plan, run_dir: Path) -> CodesResult:
    """Release the code distribution that prompts generation (exact, or a DP histogram)."""
    _within_max_epsilon(cfg, data, CODES_STAGE, plan)
    return release_control_codes(
        cfg.control_codes,
        cfg.data,
        train_path=data.train,
        out_dir=run_dir / "control_codes",
        delta=cfg.teacher.target_delta,
        accountant=cfg.teacher.accountant,
        secure_mode=cfg.teacher.secure_mode,  # one switch for every DP noise source of the run
    )


@stage_task("control-codes", lambda cfg: {"domain": cfg.control_codes.domain, "code_columns": cfg.data.code_columns,
                                         "code_template": cfg.data.code_template})
def public_codes_task(cfg: PipelineConfig, run_dir: Path) -> CodesResult:
    """The ε = 0 control's prompts: uniform over the declared public domain (no record read)."""
    return public_control_codes(cfg.data, cfg.control_codes.domain, run_dir / "control_codes")


def _dp_train(
    cfg: PipelineConfig, data: DataResult, run_dir: Path, *, stage: str, model: str, plan: Plan,
    kd: KnowledgeDistillation | None = None,
) -> TeacherResult:
    """The DP-SGD stage `stage` with its σ, q, steps and δ from the run's plan (its share of the
    budget: DPKD's teacher and student compose to the run's ε), calibrated once, at the run's start."""
    out_dir = run_dir / STAGE_DIRS[stage]  # teacher/, or student/ for the dp-student stage
    done = finished_teacher(out_dir)
    if done is not None:
        get_run_logger().info("%s: already finished in this run directory, reusing it (no new budget spent)", stage)
        return done
    _within_max_epsilon(cfg, data, stage, plan)
    monitor_path = None
    if cfg.teacher.monitor == "public":  # formatted as the private splits are, so the loss is comparable
        monitor_path = format_public_split(cfg.data, cfg.teacher.monitor_path,
                                           run_dir / PUBLIC_MONITOR_DIR / f"{stage}.parquet")
    with StageProgress(stage, "steps", window=TIMING_WINDOW_STEPS) as progress:
        return train_teacher(
            cfg.teacher,
            train_path=data.train,
            validation_path=data.validation,
            base_model=model,
            out_dir=out_dir,
            seed=cfg.seed,
            stage=stage,
            kd=kd,
            on_progress=progress,
            progress_every=cfg.progress_seconds,
            runtime=Runtime.from_config(cfg),
            monitor_path=monitor_path,
            dp_sgd=plan.dp_sgd[stage],
            prompt=PromptFormat.of(cfg.data),
        )


PUBLIC_MONITOR_DIR = "public_monitor"
"""Where teacher.monitor=public's records are written as a split, in the run directory."""


def _monitor_key(cfg: PipelineConfig) -> dict:
    """monitor=public: the public file's bytes are an input of the DP-SGD stages (their cache key)."""
    path = cfg.teacher.monitor_path
    return {"monitor_sha256": sha256_file(Path(path))} if cfg.teacher.monitor == "public" else {}


def _within_max_epsilon(cfg: PipelineConfig, data: DataResult, stage: str, plan: Plan) -> None:
    """Refuse (BudgetExceeded) a DP stage about to compute when it and the run's later DP releases
    (the run's `plan`: σ, q, steps, δ as they will be) would take its records' budget past
    privacy.max_epsilon. Called in the task's body: a cached stage spends nothing and never gets
    here. Before the teacher: the control codes come first."""
    if cfg.privacy.max_epsilon is None:
        return
    stages = [e.stage for e in plan.entries]
    planned = plan.entries[stages.index(stage):]
    total = check_max_epsilon(budget_of(Path(cfg.run_root).resolve(), data.train), planned,
                              cfg.privacy.max_epsilon, cfg.teacher.accountant, plan.total.accountant_delta())
    if total is not None:
        get_run_logger().info("%s: with this run, the training records' budget comes to ε = %.4f of "
                              "privacy.max_epsilon=%g", stage, total.epsilon, cfg.privacy.max_epsilon)


def _planned_epsilon(stage: str) -> Callable[[Plan], dict]:
    """What a DP-SGD stage's key holds of the plan: its share of the budget (DPKD: one of two equal
    shares), as "epsilon"."""
    return lambda plan: {"epsilon": plan.dp_sgd[stage].target_epsilon}


def _teacher_key(cfg: PipelineConfig) -> dict:
    return cfg.teacher.model_dump(mode="json", exclude={*NODE_FIELDS, *at_later_defaults(cfg.teacher)})


def _precision(cfg: PipelineConfig) -> dict:
    """The precision is in the keys of every stage that runs a model (bf16 gives other weights,
    samples and perplexities); the device and threads are not: they change rounding, not results.
    fp32 adds nothing, so results cached before the setting existed stay hits (a teacher found
    again spends no new budget)."""
    return {} if cfg.precision == "fp32" else {"precision": cfg.precision}


def _prompt(cfg: PipelineConfig) -> dict:
    """A prompt template is in the keys of every stage that encodes records or prompts (their
    token ids change, not the split: the data stage leaves it out); the header form adds
    nothing, so results cached before templates existed stay hits."""
    return {"prompt": key} if (key := PromptFormat.of(cfg.data).key()) else {}


@stage_task("teacher", lambda cfg: {"teacher": _teacher_key(cfg), "model": cfg.teacher.model, **_precision(cfg),
                                    **_prompt(cfg),
                                    **_monitor_key(cfg)}, planned=_planned_epsilon("teacher"))
def teacher_task(
    cfg: PipelineConfig, data: DataResult, base: BaseModels | None, plan: Plan, run_dir: Path
) -> TeacherResult:
    return _dp_train(cfg, data, run_dir, stage="teacher", model=resolve_model(cfg.teacher.model, base), plan=plan)


PRIVATE_SELECTION_FIELDS = {"selection_epsilon", "selection_clip", "selection_records", "selection_split"}


def _distill_key(cfg: PipelineConfig, *, reads_synthetic: bool = True) -> dict:
    """The distill section as a key. `num_synthetic` counts only where synthetic data is read,
    and only when set: results cached before the setting existed stay hits, and one generation
    serves every size (its key never holds the distill section). The private selection's
    settings count only when it is used (select_by=private_validation), for the same reason."""
    exclude = set() if cfg.distill.select_by == "private_validation" else set(PRIVATE_SELECTION_FIELDS)
    if cfg.distill.keep_samples == "all":  # results cached before the setting existed stay hits
        exclude.add("keep_samples")
    if cfg.distill.selection_split == "validation":  # what the route scored before the setting: those stay hits
        exclude.add("selection_split")
    if not (reads_synthetic and cfg.distill.num_synthetic is not None):
        exclude.add("num_synthetic")
    return cfg.distill.model_dump(mode="json", exclude=exclude)


def _private_validation(cfg: PipelineConfig, data: DataResult, teacher: TeacherResult) -> PrivateValidation:
    """select_by=private_validation: the private validation split (and the training split, with
    distill.selection_split=train+validation) and the teacher's δ and accountant, for the
    distillation's accounted release (pipeline/privacy/private_selection.py)."""
    train = Path(data.train) if cfg.distill.selection_split == "train+validation" else None
    return PrivateValidation(path=Path(data.validation), delta=teacher.ledger.delta,
                             accountant=cfg.teacher.accountant, secure_mode=cfg.teacher.secure_mode,
                             max_length=cfg.teacher.max_length, train=train, prompt=PromptFormat.of(cfg.data))


@stage_task("dp-student", lambda cfg: {"teacher": _teacher_key(cfg), "distill": _distill_key(cfg, reads_synthetic=False),
                                       **_precision(cfg), **_prompt(cfg), **_monitor_key(cfg)},
            planned=_planned_epsilon("dp-student"))
def dp_student_task(
    cfg: PipelineConfig, data: DataResult, base: BaseModels | None, teacher: TeacherResult | None,
    plan: Plan, run_dir: Path,
) -> TeacherResult:
    """Baselines that train the student itself with DP-SGD on the private data."""
    kd = None
    if teacher is not None:  # dpkd
        kd = KnowledgeDistillation(teacher.checkpoint, cfg.distill.alpha, cfg.distill.temperature)
    return _dp_train(cfg, data, run_dir, stage="dp-student", model=resolve_model(cfg.distill.student_model, base),
                     plan=plan, kd=kd)


# Where shards are computed (worker count, Dask cluster) changes how fast, not what: shards
# depend on (seed, shard) alone. The hf engine is left out of the key, as out of the shards'
# fingerprint: runs generated before generate.engine existed stay cached under engine=hf.
@stage_task("generation", lambda cfg: {"generate": cfg.generate.model_dump(
    mode="json", exclude=set(PLACEMENT_FIELDS) | ({"engine"} if cfg.generate.engine == "hf" else set())),
                                       **_precision(cfg), **_prompt(cfg)}, optional=("base_teacher",))
def generation_task(
    cfg: PipelineConfig, teacher: TeacherResult | None, codes: CodesResult, ledger: list[LedgerEntry], run_dir: Path,
    base_teacher: str | None = None,
) -> GenerateResult:
    """The DP teacher's samples; `base_teacher` (the ε = 0 control, no DP teacher): the base model's."""
    # Only the DP checkpoint (or the public base model) and the released control-code counts cross into this stage.
    with StageProgress("generation", "samples") as progress:
        return generate_with_workers(  # shards as tasks; over generate.workers processes when > 1
            cfg.generate,
            teacher_dir=teacher.checkpoint if teacher is not None else base_teacher,
            control_codes_path=codes.path,
            ledger=ledger,
            out_dir=run_dir / "synthetic",
            seed=cfg.seed,
            on_progress=progress,
            progress_every=cfg.progress_seconds,
            runtime=Runtime.from_config(cfg),
            prompt=PromptFormat.of(cfg.data),
        )


@stage_task("distillation", lambda cfg: {"distill": _distill_key(cfg), **_precision(cfg), **_prompt(cfg)},
            optional=("data", "base_teacher"))
def distillation_task(
    cfg: PipelineConfig, synthetic: GenerateResult, teacher: TeacherResult | None, base: BaseModels | None, plan: Plan,
    run_dir: Path, data: DataResult | None = None, base_teacher: str | None = None,
) -> DistillResult:
    """`data`: only with select_by=private_validation, whose release reads the private splits.
    `base_teacher` (the ε = 0 control, no DP teacher): the base model the student learns from."""
    if data is not None:
        _within_max_epsilon(cfg, data, private_selection.STAGE, plan)
    distill_cfg = cfg.distill
    if not method_spec(distill_cfg.method).teacher_logits:  # DP-Syn: the synthetic data alone, no teacher logits
        distill_cfg = distill_cfg.model_copy(update={"alpha": 0.0, "beta": 0.0, "teacher_top_k": None,
                                                     "candidates": []})
    with StageProgress("distillation", "steps") as progress:
        return distill(
            distill_cfg,
            synthetic_path=synthetic.path,
            teacher_dir=teacher.checkpoint if teacher is not None else base_teacher,
            student_model=resolve_model(cfg.distill.student_model, base),
            out_dir=run_dir / "student",
            seed=cfg.seed,
            on_progress=progress,
            progress_every=cfg.progress_seconds,
            runtime=Runtime.from_config(cfg),
            private_validation=_private_validation(cfg, data, teacher) if data is not None else None,
            code_values=declared_values(cfg.data, cfg.control_codes.domain, None) if cfg.control_codes.domain else None,
        )


# The declared code values that code adherence tries (pipeline/stages/adherence.py) come from the
# domain, else from the released codes (`codes`, an input): a new domain alone reruns evaluation.
@stage_task("evaluation", lambda cfg: {"evaluate": cfg.evaluate, "method": cfg.distill.method,
                                       "domain": cfg.control_codes.domain, **_precision(cfg), **_prompt(cfg)})
def evaluation_task(
    cfg: PipelineConfig,
    data: DataResult,
    base: BaseModels | None,
    teacher: TeacherResult | None,
    student: DistillResult | TeacherResult,
    synthetic: GenerateResult | None,
    codes: CodesResult | None,
    run_dir: Path,
) -> dict:
    models = {"base_student": resolve_model(cfg.distill.student_model, base)}  # "zero-shot"
    spec = method_spec(cfg.distill.method)
    if spec.dp_teacher or spec.generates:  # what DP fine-tuning started from, or the ε = 0 control's teacher
        models["base_teacher"] = resolve_model(cfg.teacher.model, base)
    if teacher is not None:
        models["dp_teacher"] = str(teacher.checkpoint)
    models[f"student_{cfg.distill.method}"] = str(student.checkpoint)
    selection = getattr(student, "selection", None)  # a DP-SGD student's TeacherResult has none
    for name, path in (getattr(student, "candidates", None) or {}).items():  # distill.keep_candidates
        models[f"{CANDIDATE_PREFIX}{name}"] = str(path)
    out_dir = run_dir / "evaluation"
    code_values = None
    if synthetic is not None and codes is not None:  # the DP teacher checks its synthetic text's codes
        code_values = declared_values(cfg.data, cfg.control_codes.domain, codes.path)
    metrics = evaluate_models(
        cfg.evaluate, models=models, test_path=data.test, out_dir=out_dir, seed=cfg.seed,
        synthetic_path=synthetic.path if synthetic else None, progress_every=cfg.progress_seconds,
        runtime=Runtime.from_config(cfg), code_values=code_values,
        adherence_model="dp_teacher" if teacher is not None else "base_teacher",  # the teacher that wrote the text
        cache_dir=Path(cfg.run_root).resolve() / PERPLEXITY_DIR,  # the base models score once per run root
        code_columns=cfg.data.code_columns, selection=selection, prompt=PromptFormat.of(cfg.data),
        kept_samples=getattr(student, "kept_samples", None),  # distill.keep_samples=code_adherent
    )
    return {**metrics, "evaluation_dir": str(out_dir)}
