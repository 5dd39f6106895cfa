"""The Prefect flow: one task per pipeline stage, chained through files in a run directory.

Run it with the CLI (`dpdistill run --config configs/demo.yaml`) or from Python:

    from flows.pipeline_flow import dp_distill
    run_dir = dp_distill(load_config("configs/demo.yaml"))

Without PREFECT_API_URL, Prefect runs against its embedded default (a local SQLite
database and a temporary server), so nothing needs to be started first. Tasks take and
return paths and small summaries only: no private record ever passes through Prefect's
state, parameters, results or artifacts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run
from prefect.utilities.callables import get_call_parameters

from flows.artifacts import publish_ledger, publish_metrics, publish_report, publish_synthetic_sample
from flows.caching import (CACHE_LOCKS, PERPLEXITY_DIR, RESULTS_DIR, STAGE_DIRS, StageCache, deleted_after_evaluation,
                           stage_dir_of, stale_reason)
from flows.generation import generate_with_workers
from flows.progress import StageProgress
from flows.run_info import (  # noqa: F401 (RunDirError re-exported)
    RUN_INFO, STAGES_INFO, TOOL, RunDirError, mark_stopped, read_run_info, stop_reason,
)
from flows.run_dirs import claim_run_dir, config_sha, prepare_run_root
from flows.run_log import route_server_output, run_log
from flows.results import StageResultSerializer, stage_result_storage
from pipeline.stages.adherence import declared_values
from pipeline.privacy.control_codes import STAGE as CODES_STAGE, CodesResult, release_control_codes
from pipeline.config import NODE_FIELDS, PipelineConfig, dump_config, load_config
from pipeline.records import split_key
from pipeline.stages.data import DataResult, delete_private_copies, format_public_split, prepare_data
from pipeline.devices import Runtime
from pipeline.stages.distill import DistillResult, distill
from pipeline.stages.evaluate import CANDIDATE_PREFIX, evaluate_models
from pipeline.stages.generate import PLACEMENT_FIELDS, GenerateResult
from pipeline.privacy.budget import (
    budget_of, check_max_epsilon, dataset_total, read_budget, record_release, records_key, register_records,
    split_digests, store_total,
)
from pipeline.locks import file_lock, unlock
from pipeline.privacy.ledger import (
    LEDGER, LedgerEntry, LedgerTotal, PrivacyLedger, compose, post_processing, with_pld_epsilons, write_ledger,
)
from pipeline.manifest import atomic_write_json, atomic_write_text, manifest_digest, private_dir, sha256_file
from pipeline.reports.model_card import write_model_card
from pipeline.plan import dp_sgd_budgets, format_plan, make_plan, private_selection_used
from pipeline.privacy import private_selection
from pipeline.privacy.private_selection import PrivateValidation
from pipeline.preflight import require_inputs
from pipeline.preflight_models import require_models
from pipeline.models.base import BaseModels, build_base_models, resolve_model
from pipeline.reports.report import write_report
from pipeline.stages.teacher.monitor import TIMING_WINDOW_STEPS
from pipeline.stages.teacher.state import KnowledgeDistillation, TeacherResult
from pipeline.stages.teacher.recipe import finished_teacher, train_teacher

route_server_output()  # the temporary server's lines through logging (flows/run_log.py)


def _uses_builtin(cfg: PipelineConfig) -> bool:
    return any(m.startswith("builtin:") for m in (cfg.teacher.model, cfg.distill.student_model))


def stage_task(stage: str, config_of: Callable[[PipelineConfig], dict], optional: tuple[str, ...] = ()):
    """A stage's Prefect task, cached under a key of the config it reads and its inputs
    (`optional` inputs only when given: flows/caching.py)."""
    return task(name=stage, cache_policy=StageCache(stage=stage, config_of=config_of, optional=optional),
                persist_result=True, result_serializer=StageResultSerializer())


@stage_task("base-models", lambda cfg: {"base_models": cfg.base_models, "builtin": _uses_builtin(cfg)})
def base_models_task(cfg: PipelineConfig) -> BaseModels | None:
    """Build the offline tiny models from public text if a stage names `builtin:...`."""
    if not _uses_builtin(cfg):
        return None
    return build_base_models(cfg.base_models, seed=cfg.seed)


def source_hashes(cfg: PipelineConfig) -> dict[str, str]:
    """sha256 of the private input files: a changed file reruns the data stage and all after."""
    paths = {"path": cfg.data.path, "test_path": cfg.data.test_path}
    return {name: sha256_file(Path(p)) for name, p in paths.items() if p is not None and Path(p).is_file()}


def _data_key(cfg: PipelineConfig) -> dict:
    # Whether the splits are deleted after evaluation changes nothing a stage computes.
    return cfg.data.model_dump(mode="json", exclude={"keep_private_copies"})


@stage_task("data", lambda cfg: {"data": _data_key(cfg), "domain": cfg.control_codes.domain})
def data_task(cfg: PipelineConfig, sources: dict[str, str], run_dir: Path) -> DataResult:
    return prepare_data(cfg.data, run_dir / "data", cfg.control_codes.domain,
                        split_key(Path(cfg.run_root).resolve()))


@stage_task("control-codes", lambda cfg: {
    "control_codes": cfg.control_codes, "data": _data_key(cfg), "delta": cfg.teacher.target_delta,
    "accountant": cfg.teacher.accountant, "secure_mode": cfg.teacher.secure_mode,
})
def codes_task(cfg: PipelineConfig, data: DataResult, run_dir: Path) -> CodesResult:
    """Release the code distribution that prompts generation (exact, or a DP histogram)."""
    _within_max_epsilon(cfg, data, CODES_STAGE)
    return release_control_codes(
        cfg.control_codes,
        cfg.data,
        train_path=data.train,
        out_dir=run_dir / "control_codes",
        delta=cfg.teacher.target_delta,
        accountant=cfg.teacher.accountant,
        secure_mode=cfg.teacher.secure_mode,  # one switch for every DP noise source of the run
    )


def _dp_train(
    cfg: PipelineConfig, data: DataResult, run_dir: Path, *, stage: str, model: str, epsilon: float,
    kd: KnowledgeDistillation | None = None,
) -> TeacherResult:
    out_dir = run_dir / STAGE_DIRS[stage]  # teacher/, or student/ for the dp-student stage
    done = finished_teacher(out_dir)
    if done is not None:
        get_run_logger().info("%s: already finished in this run directory, reusing it (no new budget spent)", stage)
        return done
    _within_max_epsilon(cfg, data, stage)
    monitor_path = None
    if cfg.teacher.monitor == "public":  # formatted as the private splits are, so the loss is comparable
        monitor_path = format_public_split(cfg.data, cfg.teacher.monitor_path,
                                           run_dir / PUBLIC_MONITOR_DIR / f"{stage}.parquet")
    with StageProgress(stage, "steps", window=TIMING_WINDOW_STEPS) as progress:
        return train_teacher(
            cfg.teacher.model_copy(update={"target_epsilon": epsilon}),
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
        )


PUBLIC_MONITOR_DIR = "public_monitor"
"""Where teacher.monitor=public's records are written as a split, in the run directory."""


def _monitor_key(cfg: PipelineConfig) -> dict:
    """monitor=public: the public file's bytes are an input of the DP-SGD stages (their cache key)."""
    path = cfg.teacher.monitor_path
    return {"monitor_sha256": sha256_file(Path(path))} if cfg.teacher.monitor == "public" else {}


def _within_max_epsilon(cfg: PipelineConfig, data: DataResult, stage: str) -> None:
    """Refuse (BudgetExceeded) a DP stage about to compute when it and the run's later DP releases
    would take its records' budget past privacy.max_epsilon. Called in the task's body: a
    cached stage spends nothing and never gets here. Before the teacher: the control codes come first."""
    if cfg.privacy.max_epsilon is None:
        return
    plan = make_plan(cfg, timing=False)  # the releases as they will be: σ, q, steps, δ
    stages = [e.stage for e in plan.entries]
    planned = plan.entries[stages.index(stage):]
    total = check_max_epsilon(budget_of(Path(cfg.run_root).resolve(), data.train), planned,
                              cfg.privacy.max_epsilon, cfg.teacher.accountant, plan.total.delta)
    if total is not None:
        get_run_logger().info("%s: with this run, the training records' budget comes to ε = %.4f of "
                              "privacy.max_epsilon=%g", stage, total.epsilon, cfg.privacy.max_epsilon)


def _teacher_epsilon(cfg: PipelineConfig) -> float:
    return dp_sgd_budgets(cfg)["teacher"]  # DPKD: ε/2 (pipeline/plan.py)


def _teacher_key(cfg: PipelineConfig) -> dict:
    return cfg.teacher.model_dump(mode="json", exclude=set(NODE_FIELDS))


def _precision(cfg: PipelineConfig) -> dict:
    """The precision is in the keys of every stage that runs a model (bf16 gives other weights,
    samples and perplexities); the device and threads are not: they change rounding, not results.
    fp32 adds nothing, so results cached before the setting existed stay hits (a teacher found
    again spends no new budget)."""
    return {} if cfg.precision == "fp32" else {"precision": cfg.precision}


@stage_task("teacher", lambda cfg: {"teacher": _teacher_key(cfg), "model": cfg.teacher.model, **_precision(cfg),
                                    **_monitor_key(cfg)})
def teacher_task(
    cfg: PipelineConfig, data: DataResult, base: BaseModels | None, epsilon: float, run_dir: Path
) -> TeacherResult:
    return _dp_train(cfg, data, run_dir, stage="teacher", model=resolve_model(cfg.teacher.model, base),
                     epsilon=epsilon)


PRIVATE_SELECTION_FIELDS = {"selection_epsilon", "selection_clip", "selection_records"}


def _distill_key(cfg: PipelineConfig, *, reads_synthetic: bool = True) -> dict:
    """The distill section as a key. `num_synthetic` counts only where synthetic data is read,
    and only when set: results cached before the setting existed stay hits, and one generation
    serves every size (its key never holds the distill section). The private selection's
    settings count only when it is used (select_by=private_validation), for the same reason."""
    exclude = set() if cfg.distill.select_by == "private_validation" else set(PRIVATE_SELECTION_FIELDS)
    if not (reads_synthetic and cfg.distill.num_synthetic is not None):
        exclude.add("num_synthetic")
    return cfg.distill.model_dump(mode="json", exclude=exclude)


def _private_validation(cfg: PipelineConfig, data: DataResult, teacher: TeacherResult) -> PrivateValidation:
    """select_by=private_validation: the private validation split and the teacher's δ and
    accountant, for the distillation's accounted release (pipeline/privacy/private_selection.py)."""
    return PrivateValidation(path=Path(data.validation), delta=teacher.ledger.delta,
                             accountant=cfg.teacher.accountant, secure_mode=cfg.teacher.secure_mode,
                             max_length=cfg.teacher.max_length)


@stage_task("dp-student", lambda cfg: {"teacher": _teacher_key(cfg), "distill": _distill_key(cfg, reads_synthetic=False),
                                       **_precision(cfg), **_monitor_key(cfg)})
def dp_student_task(
    cfg: PipelineConfig, data: DataResult, base: BaseModels | None, teacher: TeacherResult | None,
    epsilon: float, run_dir: Path,
) -> TeacherResult:
    """Baselines that train the student itself with DP-SGD on the private data."""
    kd = None
    if teacher is not None:  # dpkd
        kd = KnowledgeDistillation(teacher.checkpoint, cfg.distill.alpha, cfg.distill.temperature)
    return _dp_train(cfg, data, run_dir, stage="dp-student", model=resolve_model(cfg.distill.student_model, base),
                     epsilon=epsilon, kd=kd)


# Where shards are computed (worker count, Dask cluster) changes how fast, not what: shards
# depend on (seed, shard) alone. The hf engine is left out of the key, as out of the shards'
# fingerprint: runs generated before generate.engine existed stay cached under engine=hf.
@stage_task("generation", lambda cfg: {"generate": cfg.generate.model_dump(
    mode="json", exclude=set(PLACEMENT_FIELDS) | ({"engine"} if cfg.generate.engine == "hf" else set())),
                                       **_precision(cfg)})
def generation_task(
    cfg: PipelineConfig, teacher: TeacherResult, codes: CodesResult, ledger: list[LedgerEntry], run_dir: Path
) -> GenerateResult:
    # Only the DP checkpoint and the released control-code counts cross into this stage.
    with StageProgress("generation", "samples") as progress:
        return generate_with_workers(  # shards as tasks; over generate.workers processes when > 1
            cfg.generate,
            teacher_dir=teacher.checkpoint,
            control_codes_path=codes.path,
            ledger=ledger,
            out_dir=run_dir / "synthetic",
            seed=cfg.seed,
            on_progress=progress,
            progress_every=cfg.progress_seconds,
            runtime=Runtime.from_config(cfg),
        )


@stage_task("distillation", lambda cfg: {"distill": _distill_key(cfg), **_precision(cfg)}, optional=("data",))
def distillation_task(
    cfg: PipelineConfig, synthetic: GenerateResult, teacher: TeacherResult, base: BaseModels | None, run_dir: Path,
    data: DataResult | None = None,
) -> DistillResult:
    """`data`: only with select_by=private_validation, whose release reads the validation split."""
    if data is not None:
        _within_max_epsilon(cfg, data, private_selection.STAGE)
    distill_cfg = cfg.distill
    if distill_cfg.method == "dp_syn":  # the synthetic data alone, no teacher logits
        distill_cfg = distill_cfg.model_copy(update={"alpha": 0.0, "beta": 0.0, "teacher_top_k": None,
                                                     "candidates": []})
    with StageProgress("distillation", "steps") as progress:
        return distill(
            distill_cfg,
            synthetic_path=synthetic.path,
            teacher_dir=teacher.checkpoint,
            student_model=resolve_model(cfg.distill.student_model, base),
            out_dir=run_dir / "student",
            seed=cfg.seed,
            on_progress=progress,
            progress_every=cfg.progress_seconds,
            runtime=Runtime.from_config(cfg),
            private_validation=_private_validation(cfg, data, teacher) if data is not None else None,
        )


# The declared code values that code adherence tries (pipeline/stages/adherence.py) come from the
# domain, else from the released codes (`codes`, an input): a new domain alone reruns evaluation.
@stage_task("evaluation", lambda cfg: {"evaluate": cfg.evaluate, "method": cfg.distill.method,
                                       "domain": cfg.control_codes.domain, **_precision(cfg)})
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
    if teacher is not None:
        models["base_teacher"] = resolve_model(cfg.teacher.model, base)  # what DP fine-tuning started from
        models["dp_teacher"] = str(teacher.checkpoint)
    models[f"student_{cfg.distill.method}"] = str(student.checkpoint)
    selection = getattr(student, "selection", None)  # a TeacherResult (dp_sgd, dpkd) has none
    for name, path in (getattr(student, "candidates", None) or {}).items():  # distill.keep_candidates
        models[f"{CANDIDATE_PREFIX}{name}"] = str(path)
    out_dir = run_dir / "evaluation"
    code_values = None
    if synthetic is not None and codes is not None:  # the DP teacher checks its synthetic text's codes
        code_values = declared_values(cfg.data, cfg.control_codes.domain, codes.path)
    metrics = evaluate_models(
        cfg.evaluate, models=models, test_path=data.test, out_dir=out_dir, seed=cfg.seed,
        synthetic_path=synthetic.path if synthetic else None, progress_every=cfg.progress_seconds,
        runtime=Runtime.from_config(cfg), code_values=code_values, adherence_model="dp_teacher",
        cache_dir=Path(cfg.run_root).resolve() / PERPLEXITY_DIR,  # the base models score once per run root
        code_columns=cfg.data.code_columns, selection=selection,
    )
    return {**metrics, "evaluation_dir": str(out_dir)}


class StageRunner:
    """Runs stage tasks: cache hits verified against their manifests, forced stages rerun,
    and every stage's status, duration and output directory recorded in `stages.json`.
    Once `use_records` has named the training records, each DP release is also charged to their
    budget across runs (pipeline/privacy/budget.py)."""

    def __init__(self, cfg: PipelineConfig, run_dir: Path, rerun: list[str]):
        self.cfg, self.run_dir, self.rerun = cfg, run_dir, set(rerun)
        self.budget_id: str | None = None
        self.run_delta: float | None = None  # δ of this run's first Gaussian release
        self.releases: set[str] = set()  # this run's releases (manifest digests)
        # JSON of our result types only, never a pickle (flows/results.py)
        self.storage = stage_result_storage((Path(cfg.run_root) / RESULTS_DIR).resolve())
        info_path = run_dir / STAGES_INFO
        self.stages: dict[str, dict] = json.loads(info_path.read_text()) if info_path.is_file() else {}
        self.log = get_run_logger()

    def use_records(self, data: DataResult) -> str:
        """Name the budget of the training split's records (keyed digests, pipeline/privacy/budget.py)
        and note it in run.json, where `dpdistill ledger show` finds it."""
        root = Path(self.cfg.run_root).resolve()
        self.budget_id = register_records(root, split_digests(data.train, records_key(root)))
        atomic_write_json(self.run_dir / RUN_INFO, read_run_info(self.run_dir) | {"records_id": self.budget_id})
        return self.budget_id

    def _delta(self, budget) -> float | None:
        """The δ the dataset total is composed at: this run's, else the newest release's."""
        deltas = [r.entry.delta for r in budget.releases if r.entry.delta]
        return self.run_delta or (deltas[-1] if deltas else None)

    def _record_release(self, stage: str, result, entry: LedgerEntry, part: str = "") -> None:
        """Add this DP release to the dataset's budget; warn when it raises the total that
        earlier runs had spent on the same data. `part` names a second release of the same
        stage run (its validation loss, teacher.monitor=dp), identified by its manifest too."""
        root, sha = Path(self.cfg.run_root).resolve(), self.budget_id
        if self.run_delta is None and entry.history:
            self.run_delta = entry.delta
        release_id = manifest_digest(stage_dir_of(result)) + part
        before = read_budget(root, sha)
        earlier = [r for r in before.releases if r.release_id not in self.releases | {release_id}]
        budget, new = record_release(root, sha, release_id=release_id, stage=stage, run_dir=self.run_dir, entry=entry)
        self.releases.add(release_id)
        if not new or not earlier or (delta := self._delta(budget)) is None:
            return
        accountant = self.cfg.teacher.accountant
        was, now = dataset_total(before, accountant, delta), dataset_total(budget, accountant, delta)
        self.log.warning(
            "%s: a new DP release on records already used by earlier runs: the privacy spent on these records "
            "(budget %s…) over every run rises from ε = %.4f to ε = %.4f at δ = %.3g (replace-one: from %.4f "
            "to %.4f; %d releases); see `dpdistill ledger show %s`", stage, sha[:12], was.epsilon, now.epsilon,
            delta, was.epsilon_replace_one, now.epsilon_replace_one, len(budget.releases), self.run_dir,
        )

    def _record(self, stage: str, **info) -> None:
        self.stages[stage] = {**self.stages.get(stage, {}), **info}
        atomic_write_json(self.run_dir / STAGES_INFO, self.stages)

    def _lock_path(self, task_fn, args) -> Path:
        """The lock file of the cache entry this call reads or writes, named by its key
        (the key Prefect computes from the same policy and arguments)."""
        key = task_fn.cache_policy.compute_key(None, get_call_parameters(task_fn.fn, args, {}), {})
        return Path(self.cfg.run_root).resolve() / CACHE_LOCKS / f"{key}.lock"

    def _borrowed_private_copies(self, result) -> bool:
        """Whether a cached data stage's splits are another run's, deleted when that run ends."""
        stage_dir = stage_dir_of(result)
        return (not self.cfg.data.keep_private_copies and stage_dir is not None
                and not Path(stage_dir).resolve().is_relative_to(self.run_dir.resolve()))

    def _call(self, task_fn, args, refresh: bool):
        configured = task_fn.with_options(result_serializer=StageResultSerializer(), refresh_cache=refresh)
        # Set after construction: `Task.__init__` refuses a block not saved on the server, which
        # would register our storage class there. Prefect itself runs a `Path` storage as an
        # unsaved LocalFileSystem; ours is that, with reads refused unless ours (flows/results.py).
        configured.result_storage = self.storage
        state = configured(*args, return_state=True)
        return state.result(), state.name == "Cached"

    def __call__(self, stage: str, task_fn, *args):
        forced = stage in self.rerun
        if forced and stage in STAGE_DIRS:
            own = self.run_dir / STAGE_DIRS[stage]
            if own.exists():  # only ever this run's copy; other runs' outputs are never touched
                if read_run_info(self.run_dir).get("tool") != TOOL:
                    raise RunDirError(f"not deleting {own}: {self.run_dir} is not a dpdistill run directory")
                if stage in ("teacher", "dp-student"):
                    self.log.warning("%s: forced to rerun: this trains on the private data again and "
                                     "spends a new privacy budget; discard the old model", stage)
                shutil.rmtree(own)
        t0 = time.time()
        self._record(stage, status="running", started_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        try:
            # One process at a time computes a cache entry: a second run of the same stage
            # waits here, then finds the first one's result in the cache instead of computing
            # (and, for a DP stage, spending budget on) it again.
            with file_lock(self._lock_path(task_fn, args), on_wait=lambda: self.log.info(
                    "%s: another run is computing this stage with the same cache key; waiting for it "
                    "to reuse its result", stage)):
                result, cached = self._call(task_fn, args, refresh=forced)
                if cached and (reason := stale_reason(result)):
                    if deleted_after_evaluation(result):
                        self.log.info("data: the private splits of %s were deleted after its evaluation "
                                      "(data.keep_private_copies=false), as recorded; writing them again",
                                      stage_dir_of(result).parent)
                    else:
                        self.log.warning("%s: the cached result cannot be trusted (%s); running the stage again",
                                         stage, reason)
                    result, cached = self._call(task_fn, args, refresh=True)
                elif cached and stage == "data" and self._borrowed_private_copies(result):
                    # Their run deletes them when its evaluation ends, maybe while this run still
                    # reads them (two runs at once): this run writes its own (they are cheap).
                    self.log.info("data: the cached splits belong to %s, which deletes them when it ends; "
                                  "writing this run's own", stage_dir_of(result).parent)
                    result, cached = self._call(task_fn, args, refresh=True)
        except BaseException as e:
            self._record(stage, status=stop_reason(e)[0], seconds=round(time.time() - t0, 2))
            raise
        out = stage_dir_of(result)
        if cached:
            where = f"outputs in {out}" if out else "its result"
            self.log.info("%s: cached (same config, inputs, version and seed): reusing %s", stage, where)
        ledger = getattr(result, "ledger", None)
        if self.budget_id and isinstance(ledger, LedgerEntry) and ledger.private and ledger.epsilon:
            self._record_release(stage, result, ledger)
        monitor = getattr(result, "monitor_ledger", None)  # the validation loss released with DP
        if self.budget_id and isinstance(monitor, LedgerEntry) and monitor.epsilon:
            self._record_release(monitor.stage, result, monitor, part=":validation")
        chosen = getattr(result, "selection_ledger", None)  # the student chosen on the validation split
        if self.budget_id and isinstance(chosen, LedgerEntry) and chosen.epsilon:
            self._record_release(chosen.stage, result, chosen, part=":selection")
        self._record(
            stage,
            status="cached" if cached else ("forced" if forced else "ran"),
            seconds=round(time.time() - t0, 2),
            finished_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
            output=str(out) if out else None,
            epsilon=ledger.epsilon if isinstance(ledger, LedgerEntry) else None,
        )
        return result


@flow(name="dp-distill", persist_result=False, log_prints=True)
def dp_distill(
    config: PipelineConfig | str,
    run_dir: str | None = None,
    overrides: list[str] | None = None,
    rerun: list[str] | None = None,
) -> str:
    """Teacher (DP-SGD) → generation → distillation → evaluation; returns the run directory.

    `config` is a config or the path of a YAML file (with dotted `overrides`); `rerun`
    names stages to run again even when cached (`flows.caching.stages_to_rerun`).
    Without `run_dir`, a retried flow run, or a killed or failed run with the same
    config, continues in its directory; otherwise a new one is made. The run directory is
    locked for this process (flows.run_info.RUN_LOCK): two runs never share one.
    """
    logger = get_run_logger()
    cfg = load_config(config, overrides) if isinstance(config, str) else config
    # Fail clean before anything is made (scheduled runs never pass through the CLI's check),
    # then say what the run will spend: the plan reads the data's split and calibrates σ.
    require_inputs(cfg)
    require_models(cfg)
    plan = make_plan(cfg, timing=False)
    logger.info("%s", format_plan(plan))
    for warning in plan.warnings:
        logger.warning("%s", warning)
    prepare_run_root(cfg)
    out, lock, why = claim_run_dir(cfg, run_dir, flow_run.id)
    if why:
        logger.info("continuing %s (%s); pass a run directory to start elsewhere", out, why)
    try:  # the lock is held until the flow ends, and dropped by the kernel if it is killed
        return _run_in(cfg, out, rerun, logger)
    finally:
        unlock(lock)


def _run_in(cfg: PipelineConfig, out: Path, rerun: list[str] | None, logger) -> str:
    """The flow's body, in the run directory `out` this process holds the lock of."""
    private_dir(out)
    atomic_write_text(out / "config.yaml", dump_config(cfg))
    sources = source_hashes(cfg)
    run_info = {
        "tool": TOOL, "status": "running", "flow_run_id": flow_run.id, "host": socket.gethostname(),
        "pid": os.getpid(),
        "config_sha256": config_sha(cfg), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rerun": rerun or [],
        # Where the budget spent on the training records over every run is kept (pipeline/privacy/budget.py);
        # its "records_id" is added once the data stage has made the split.
        "run_root": str(Path(cfg.run_root).resolve()),
    }
    atomic_write_json(out / RUN_INFO, run_info)
    with run_log(out):  # every log line from here on also in out/run.log, tracebacks only there
        logger.info("run directory: %s", out)
        try:
            final, metrics = _run_stages(cfg, out, rerun or [], sources)
        except BaseException as e:
            status, reason = stop_reason(e)
            mark_stopped(out, status, reason)  # first: an interrupted run may be killed soon after
            write_report(out)  # what the finished stages show, to help find what went wrong
            raise
        _finish(cfg, out, run_info, final, metrics)
    return str(out)


def _finish(cfg: PipelineConfig, out: Path, run_info: dict, final: PrivacyLedger, metrics: dict) -> None:
    """Report, artifacts, and run.json's "completed", once every stage is done."""
    logger = get_run_logger()
    report = write_report(out)
    publish_report(report, out)
    run_info = run_info | read_run_info(out)  # with the records' budget id, added after the data stage
    budget_id = run_info.get("records_id")
    budget = read_budget(Path(cfg.run_root).resolve(), budget_id) if budget_id else None
    dataset = _dataset_total(budget, final.total, cfg.teacher.accountant)
    if dataset is not None:  # kept for `dpdistill ledger show`, which then needs no accountant
        store_total(Path(cfg.run_root).resolve(), budget_id, cfg.teacher.accountant, final.total.delta, dataset)
    publish_ledger(final, budget, dataset)
    publish_metrics(metrics)
    if "generation" in metrics:
        publish_synthetic_sample(Path(metrics["generation"]["path"]))
    atomic_write_json(out / RUN_INFO, run_info | {"status": "completed", "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    logger.info("finished: %s", out)


def _dataset_total(budget, run_total: LedgerTotal | None, accountant: str) -> LedgerTotal | None:
    """Every release on the dataset composed at this run's δ."""
    return dataset_total(budget, accountant, run_total.delta) if budget and run_total and budget.releases else None


def _dp_sgd_entries(result: TeacherResult) -> list[LedgerEntry]:
    """A DP-SGD stage's releases: its training, and its validation loss with teacher.monitor=dp."""
    return [result.ledger] + ([result.monitor_ledger] if result.monitor_ledger is not None else [])


def _run_stages(
    cfg: PipelineConfig, out: Path, rerun: list[str], sources: dict[str, str]
) -> tuple[PrivacyLedger, dict]:
    stage = StageRunner(cfg, out, rerun)
    method = cfg.distill.method
    base = stage("base-models", base_models_task, cfg)
    data = stage("data", data_task, cfg, sources, out)
    stage.use_records(data)
    ledger: list[LedgerEntry] = []
    teacher = codes = synthetic = None

    def typed(entries: list[LedgerEntry]) -> PrivacyLedger:
        # The teacher's δ; before it (the control codes alone) the codes' own (the same rule and N).
        delta = next((e.delta for e in entries if e.mechanism == "subsampled_gaussian"),
                     next((e.delta for e in entries if e.history), 0.0))
        # A stage cached by an older version has no replace-one ε yet: computed here, once.
        entries = [e if e.epsilon_replace_one is not None else with_pld_epsilons(e) for e in entries]
        return PrivacyLedger(entries=entries, total=compose(entries, cfg.teacher.accountant, delta))

    if method in ("distil", "dp_syn"):
        codes = stage(CODES_STAGE, codes_task, cfg, data, out)
        # Releases cached before the ledger took the stage's name say "control_codes": the same release.
        ledger.append(codes.ledger.model_copy(update={"stage": CODES_STAGE}))
        write_ledger(out / LEDGER, typed(ledger))  # the first release: an interrupted run shows what it spent
    if method in ("distil", "dp_syn", "dpkd"):
        teacher = stage("teacher", teacher_task, cfg, data, base, _teacher_epsilon(cfg), out)
        ledger += _dp_sgd_entries(teacher)
        write_ledger(out / LEDGER, typed(ledger))
    if method in ("distil", "dp_syn"):
        synthetic = stage("generation", generation_task, cfg, teacher, codes, ledger, out)
        ledger.append(post_processing("generation", "samples of the DP teacher, prompted by control codes"))
        private = (data,) if private_selection_used(cfg) else ()  # its only private read
        student = stage("distillation", distillation_task, cfg, synthetic, teacher, base, out, *private)
        ledger.append(post_processing("distillation", "trains on synthetic samples and the DP teacher only"))
        if student.selection_ledger is not None:
            ledger.append(student.selection_ledger)
    else:  # dp_sgd, dpkd: the student itself trains on the private data with DP-SGD
        student_epsilon = dp_sgd_budgets(cfg)["dp-student"]
        student = stage("dp-student", dp_student_task, cfg, data, base, teacher, student_epsilon, out)
        ledger += _dp_sgd_entries(student)
    evaluation = stage("evaluation", evaluation_task, cfg, data, base, teacher, student, synthetic, codes, out)
    ledger.append(
        post_processing(
            "evaluation",
            "with respect to the training records. It reads the held-out test split, which "
            "this ledger does not protect; only aggregate perplexities leave it",
        )
    )
    final = typed(ledger)
    write_ledger(out / LEDGER, final)
    made_by = "dp-student" if method in ("dp_sgd", "dpkd") else "distillation"
    for model, stage_name in ((teacher, "teacher"), (student, made_by)):
        if model is not None and Path(model.checkpoint).resolve().is_relative_to(out):  # not a cached run's copy
            write_model_card(model.checkpoint, final, stage=stage_name, run_name=out.name)
    # Nothing after evaluation reads the splits (report, status and artifacts read manifests,
    # ledgers and metrics). Only this run's copy: a cached data stage lives in another run.
    if not cfg.data.keep_private_copies and Path(data.train).parent.is_relative_to(out):
        deleted = delete_private_copies(data)
        stage.log.info("data: deleted the private splits (%s) now that evaluation is done; their sha256 "
                       "stay in data/manifest.json (data.keep_private_copies=true keeps them)",
                       ", ".join(p.name for p in deleted))

    evaluation = {k: v for k, v in evaluation.items() if k != "evaluation_dir"}
    metrics = {**evaluation, "method": method,
               "seconds": {name: s.get("seconds") for name, s in stage.stages.items()},
               "cached": sorted(name for name, s in stage.stages.items() if s.get("status") == "cached")}
    for name in ("teacher", "dp-student"):  # a DP-SGD stage's time per training record (sizes and timings: published)
        if (s := stage.stages.get(name, {})).get("status") in ("ran", "forced") and data.n_train:
            metrics.setdefault("seconds_per_training_record", {})[name] = round(s["seconds"] / data.n_train, 4)
    if teacher is not None and teacher.validation_loss is not None:  # teacher.monitor=none: nothing
        metrics["teacher_validation_loss"] = teacher.validation_loss
    if isinstance(student, DistillResult):  # how many synthetic samples the student saw (Figure 3's x)
        metrics["distillation"] = {"train_samples": student.train_samples,
                                   "available_samples": student.available_samples}
    if synthetic is not None:
        metrics["generation"] = {
            "path": str(synthetic.path),
            "samples": synthetic.n_samples,
            "validation_samples": synthetic.n_validation,
            "dropped_empty": synthetic.n_dropped_empty,
            "new_tokens_per_second": synthetic.tokens_per_second,
            "shards": len(synthetic.shards),
            "resumed_shards": synthetic.resumed_shards,
            # Aggregate shares only: the requested distribution is the released one.
            "control_codes": {
                code: {"requested": synthetic.requested_codes.get(code, 0.0),
                       "generated": synthetic.generated_codes.get(code, 0.0)}
                for code in sorted(set(synthetic.requested_codes) | set(synthetic.generated_codes))
            },
        }
    atomic_write_json(out / "metrics.json", metrics)
    return final, metrics
