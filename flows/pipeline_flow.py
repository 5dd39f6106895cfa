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

import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

from flows.artifacts import publish_ledger, publish_metrics, publish_report, publish_synthetic_sample
from flows.caching import RESULTS_DIR, STAGE_DIRS, StageCache, stage_dir_of, stale_reason
from flows.generation import generate_with_workers
from flows.progress import StageProgress
from pipeline.codes import CodesResult, release_control_codes
from pipeline.config import PipelineConfig, dump_config, load_config
from pipeline.data import DataResult, prepare_data
from pipeline.distill import DistillResult, distill
from pipeline.evaluate import evaluate_models
from pipeline.generate import GenerateResult
from pipeline.ledger import LEDGER, LedgerEntry, PrivacyLedger, compose, post_processing, write_ledger
from pipeline.manifest import atomic_write_json, atomic_write_text, sha256_file
from pipeline.model_card import write_model_card
from pipeline.models import BaseModels, build_base_models, resolve_model
from pipeline.report import write_report
from pipeline.teacher import KnowledgeDistillation, TeacherResult, finished_teacher, train_teacher



def _uses_builtin(cfg: PipelineConfig) -> bool:
    return any(m.startswith("builtin:") for m in (cfg.teacher.model, cfg.distill.student_model))


def stage_task(stage: str, config_of: Callable[[PipelineConfig], dict]):
    """A stage's Prefect task, cached under a key of the config it reads and its inputs."""
    return task(name=stage, cache_policy=StageCache(stage=stage, config_of=config_of), persist_result=True)


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


@stage_task("data", lambda cfg: {"data": cfg.data, "domain": cfg.control_codes.domain})
def data_task(cfg: PipelineConfig, sources: dict[str, str], run_dir: Path) -> DataResult:
    return prepare_data(cfg.data, run_dir / "data", seed=cfg.seed, code_domain=cfg.control_codes.domain)


@stage_task("control-codes", lambda cfg: {
    "control_codes": cfg.control_codes, "data": cfg.data, "delta": cfg.teacher.target_delta,
    "accountant": cfg.teacher.accountant,
})
def codes_task(cfg: PipelineConfig, data: DataResult, run_dir: Path) -> CodesResult:
    """Release the code distribution that prompts generation (exact, or a DP histogram)."""
    return release_control_codes(
        cfg.control_codes,
        cfg.data,
        train_path=data.train,
        out_dir=run_dir / "control_codes",
        delta=cfg.teacher.target_delta,
        accountant=cfg.teacher.accountant,
        seed=cfg.seed,
    )


def _dp_train(
    cfg: PipelineConfig, data: DataResult, run_dir: Path, *, stage: str, model: str, epsilon: float,
    kd: KnowledgeDistillation | None = None,
) -> TeacherResult:
    done = finished_teacher(run_dir / stage)
    if done is not None:
        get_run_logger().info("%s: already finished in this run directory, reusing it (no new budget spent)", stage)
        return done
    with StageProgress(stage, "steps") as progress:
        return train_teacher(
            cfg.teacher.model_copy(update={"target_epsilon": epsilon}),
            train_path=data.train,
            validation_path=data.validation,
            base_model=model,
            out_dir=run_dir / stage,
            seed=cfg.seed,
            stage=stage,
            kd=kd,
            on_progress=progress,
        )


def _teacher_epsilon(cfg: PipelineConfig) -> float:
    # DPKD splits the budget: ε/2 for the teacher, ε/2 for the student trained with KD.
    return cfg.teacher.target_epsilon / 2 if cfg.distill.method == "dpkd" else cfg.teacher.target_epsilon


@stage_task("teacher", lambda cfg: {"teacher": cfg.teacher, "model": cfg.teacher.model})
def teacher_task(
    cfg: PipelineConfig, data: DataResult, base: BaseModels | None, epsilon: float, run_dir: Path
) -> TeacherResult:
    return _dp_train(cfg, data, run_dir, stage="teacher", model=resolve_model(cfg.teacher.model, base),
                     epsilon=epsilon)


@stage_task("dp-student", lambda cfg: {"teacher": cfg.teacher, "distill": cfg.distill})
def dp_student_task(
    cfg: PipelineConfig, data: DataResult, base: BaseModels | None, teacher: TeacherResult | None,
    epsilon: float, run_dir: Path,
) -> TeacherResult:
    """Baselines that train the student itself with DP-SGD on the private data."""
    kd = None
    if teacher is not None:  # dpkd
        kd = KnowledgeDistillation(teacher.checkpoint, cfg.distill.alpha, cfg.distill.temperature)
    return _dp_train(cfg, data, run_dir, stage="student", model=resolve_model(cfg.distill.student_model, base),
                     epsilon=epsilon, kd=kd)


# The worker count changes how fast, not what: shards depend on (seed, shard) alone.
@stage_task("generation", lambda cfg: {"generate": cfg.generate.model_dump(mode="json", exclude={"workers"})})
def generation_task(
    cfg: PipelineConfig, teacher: TeacherResult, codes: CodesResult, ledger: list[LedgerEntry], run_dir: Path
) -> GenerateResult:
    # Only the DP checkpoint and the released control-code counts cross into this stage.
    with StageProgress("generation", "shards") as progress:
        return generate_with_workers(  # shards as tasks; over generate.workers processes when > 1
            cfg.generate,
            teacher_dir=teacher.checkpoint,
            control_codes_path=codes.path,
            ledger=ledger,
            out_dir=run_dir / "synthetic",
            seed=cfg.seed,
            on_progress=progress,
        )


@stage_task("distillation", lambda cfg: {"distill": cfg.distill})
def distillation_task(
    cfg: PipelineConfig, synthetic: GenerateResult, teacher: TeacherResult, base: BaseModels | None, run_dir: Path
) -> DistillResult:
    distill_cfg = cfg.distill
    if distill_cfg.method == "dp_syn":  # the synthetic data alone, no teacher logits
        distill_cfg = distill_cfg.model_copy(update={"alpha": 0.0, "beta": 0.0, "teacher_top_k": None})
    with StageProgress("distillation", "steps") as progress:
        return distill(
            distill_cfg,
            synthetic_path=synthetic.path,
            teacher_dir=teacher.checkpoint,
            student_model=resolve_model(cfg.distill.student_model, base),
            out_dir=run_dir / "student",
            seed=cfg.seed,
            on_progress=progress,
        )


@stage_task("evaluation", lambda cfg: {"evaluate": cfg.evaluate, "method": cfg.distill.method})
def evaluation_task(
    cfg: PipelineConfig,
    data: DataResult,
    base: BaseModels | None,
    teacher: TeacherResult | None,
    student: DistillResult | TeacherResult,
    synthetic: GenerateResult | None,
    run_dir: Path,
) -> dict:
    models = {"base_student": resolve_model(cfg.distill.student_model, base)}  # "zero-shot"
    if teacher is not None:
        models["base_teacher"] = resolve_model(cfg.teacher.model, base)  # what DP fine-tuning started from
        models["dp_teacher"] = str(teacher.checkpoint)
    models[f"student_{cfg.distill.method}"] = str(student.checkpoint)
    out_dir = run_dir / "evaluation"
    metrics = evaluate_models(
        cfg.evaluate, models=models, test_path=data.test, out_dir=out_dir, seed=cfg.seed,
        synthetic_path=synthetic.path if synthetic else None,
    )
    return {**metrics, "evaluation_dir": str(out_dir)}


# --- run directories -------------------------------------------------------------------

RUN_INFO = "run.json"
STAGES_INFO = "stages.json"


def new_run_dir(cfg: PipelineConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = cfg.run_root / f"{cfg.name}-{stamp}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = cfg.run_root / f"{cfg.name}-{stamp}-{n}"
    run_dir.mkdir(parents=True)
    return run_dir.resolve()


def run_alive(info: dict) -> bool:
    """Whether the process that wrote a run.json may still be running."""
    if info.get("host") != socket.gethostname():
        return True  # another machine's run: assume it is alive
    try:
        os.kill(int(info["pid"]), 0)
    except (ProcessLookupError, ValueError, KeyError):
        return False
    except PermissionError:
        return True
    return True


def find_interrupted_run(cfg: PipelineConfig, flow_run_id: str | None) -> tuple[Path, str] | None:
    """The run directory to continue, if any: the one this very flow run wrote before (a
    retry from the UI), else the newest run with the same config if it was killed or failed."""
    config_sha = _config_sha(cfg)
    runs = []
    for info_path in Path(cfg.run_root).glob(f"{cfg.name}-*/{RUN_INFO}"):
        try:
            runs.append((info_path.stat().st_mtime, info_path.parent, json.loads(info_path.read_text())))
        except (OSError, json.JSONDecodeError):
            continue
    runs.sort(key=lambda r: r[0], reverse=True)
    for _, path, info in runs:
        if flow_run_id and info.get("flow_run_id") == flow_run_id:
            return path.resolve(), "a retry of the same flow run"
    same = [(path, info) for _, path, info in runs if info.get("config_sha256") == config_sha]
    if same:
        path, info = same[0]
        if info.get("status") == "failed" or (info.get("status") == "running" and not run_alive(info)):
            return path.resolve(), f"the newest run with this config was {'killed' if info['status'] == 'running' else 'failed'}"
    return None


def _config_sha(cfg: PipelineConfig) -> str:
    return hashlib.sha256(dump_config(cfg).encode()).hexdigest()


class StageRunner:
    """Runs stage tasks: cache hits verified against their manifests, forced stages rerun,
    and every stage's status, duration and output directory recorded in `stages.json`."""

    def __init__(self, cfg: PipelineConfig, run_dir: Path, rerun: list[str]):
        self.cfg, self.run_dir, self.rerun = cfg, run_dir, set(rerun)
        self.storage = (Path(cfg.run_root) / RESULTS_DIR).resolve()  # Prefect reads a Path as local storage
        info_path = run_dir / STAGES_INFO
        self.stages: dict[str, dict] = json.loads(info_path.read_text()) if info_path.is_file() else {}
        self.log = get_run_logger()

    def _record(self, stage: str, **info) -> None:
        self.stages[stage] = {**self.stages.get(stage, {}), **info}
        atomic_write_json(self.run_dir / STAGES_INFO, self.stages)

    def _call(self, task_fn, args, refresh: bool):
        state = task_fn.with_options(result_storage=self.storage, refresh_cache=refresh)(*args, return_state=True)
        return state.result(), state.name == "Cached"

    def __call__(self, stage: str, task_fn, *args):
        forced = stage in self.rerun
        if forced and stage in STAGE_DIRS:
            own = self.run_dir / STAGE_DIRS[stage]
            if own.exists():  # only ever this run's copy; other runs' outputs are never touched
                if stage in ("teacher", "dp-student"):
                    self.log.warning("%s: forced to rerun: this trains on the private data again and "
                                     "spends a new privacy budget; discard the old model", stage)
                shutil.rmtree(own)
        t0 = time.time()
        self._record(stage, status="running", started_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        try:
            result, cached = self._call(task_fn, args, refresh=forced)
            if cached and (reason := stale_reason(result)):
                self.log.warning("%s: the cached result cannot be trusted (%s); running the stage again", stage, reason)
                result, cached = self._call(task_fn, args, refresh=True)
        except BaseException:
            self._record(stage, status="failed", seconds=round(time.time() - t0, 2))
            raise
        out = stage_dir_of(result)
        if cached:
            where = f"outputs in {out}" if out else "its result"
            self.log.info("%s: cached (same config, inputs, version and seed): reusing %s", stage, where)
        ledger = getattr(result, "ledger", None)
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
    config, continues in its directory; otherwise a new one is made.
    """
    logger = get_run_logger()
    cfg = load_config(config, overrides) if isinstance(config, str) else config
    if run_dir:
        out = Path(run_dir).resolve()
    elif found := find_interrupted_run(cfg, flow_run.id):
        out, why = found
        logger.info("continuing %s (%s); pass a run directory to start elsewhere", out, why)
    else:
        out = new_run_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", dump_config(cfg))
    run_info = {
        "status": "running", "flow_run_id": flow_run.id, "host": socket.gethostname(), "pid": os.getpid(),
        "config_sha256": _config_sha(cfg), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rerun": rerun or [],
    }
    atomic_write_json(out / RUN_INFO, run_info)
    logger.info("run directory: %s", out)
    try:
        final, metrics = _run_stages(cfg, out, rerun or [])
    except BaseException:
        atomic_write_json(out / RUN_INFO, run_info | {"status": "failed"})
        write_report(out)  # what the finished stages show, to help find what went wrong
        raise
    report = write_report(out)
    publish_report(report, out)
    publish_ledger(final)
    publish_metrics(metrics)
    if "generation" in metrics:
        publish_synthetic_sample(Path(metrics["generation"]["path"]))
    atomic_write_json(out / RUN_INFO, run_info | {"status": "completed", "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    logger.info("finished: %s", out)
    return str(out)


def _run_stages(cfg: PipelineConfig, out: Path, rerun: list[str]) -> tuple[PrivacyLedger, dict]:
    stage = StageRunner(cfg, out, rerun)
    method = cfg.distill.method
    base = stage("base-models", base_models_task, cfg)
    data = stage("data", data_task, cfg, source_hashes(cfg), out)
    ledger: list[LedgerEntry] = []
    teacher = codes = synthetic = None

    def typed(entries: list[LedgerEntry]) -> PrivacyLedger:
        delta = next(e.delta for e in entries if e.mechanism == "subsampled_gaussian")
        return PrivacyLedger(entries=entries, total=compose(entries, cfg.teacher.accountant, delta))

    if method in ("distil", "dp_syn"):
        codes = stage("control-codes", codes_task, cfg, data, out)
        ledger.append(codes.ledger)
    if method in ("distil", "dp_syn", "dpkd"):
        teacher = stage("teacher", teacher_task, cfg, data, base, _teacher_epsilon(cfg), out)
        ledger.append(teacher.ledger)
        write_ledger(out / LEDGER, typed(ledger))
    if method in ("distil", "dp_syn"):
        synthetic = stage("generation", generation_task, cfg, teacher, codes, ledger, out)
        ledger.append(post_processing("generation", "samples of the DP teacher, prompted by control codes"))
        student = stage("distillation", distillation_task, cfg, synthetic, teacher, base, out)
        ledger.append(post_processing("distillation", "trains on synthetic samples and the DP teacher only"))
    else:  # dp_sgd, dpkd: the student itself trains on the private data with DP-SGD
        student_epsilon = cfg.teacher.target_epsilon - (_teacher_epsilon(cfg) if teacher else 0.0)
        student = stage("dp-student", dp_student_task, cfg, data, base, teacher, student_epsilon, out)
        ledger.append(student.ledger)
    evaluation = stage("evaluation", evaluation_task, cfg, data, base, teacher, student, synthetic, out)
    ledger.append(
        post_processing(
            "evaluation",
            "with respect to the training records. It reads the held-out test split, which "
            "this ledger does not protect; only aggregate perplexities leave it",
        )
    )
    final = typed(ledger)
    write_ledger(out / LEDGER, final)
    made_by = "student" if method in ("dp_sgd", "dpkd") else "distillation"
    for model, stage_name in ((teacher, "teacher"), (student, made_by)):
        if model is not None and Path(model.checkpoint).resolve().is_relative_to(out):  # not a cached run's copy
            write_model_card(model.checkpoint, final, stage=stage_name, run_name=out.name)

    evaluation = {k: v for k, v in evaluation.items() if k != "evaluation_dir"}
    metrics = {**evaluation, "method": method,
               "seconds": {name: s.get("seconds") for name, s in stage.stages.items()},
               "cached": sorted(name for name, s in stage.stages.items() if s.get("status") == "cached")}
    if teacher is not None:
        metrics["teacher_validation_loss"] = teacher.validation_loss
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
