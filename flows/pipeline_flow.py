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

import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.artifacts import publish_ledger, publish_metrics
from pipeline.codes import CodesResult, release_control_codes
from pipeline.config import PipelineConfig, dump_config
from pipeline.data import DataResult, prepare_data
from pipeline.distill import DistillResult, distill
from pipeline.evaluate import evaluate_models
from pipeline.generate import GenerateResult, generate_synthetic
from pipeline.ledger import LEDGER, LedgerEntry, PrivacyLedger, compose, post_processing, write_ledger
from pipeline.manifest import atomic_write_json, atomic_write_text
from pipeline.models import BaseModels, build_base_models, resolve_model
from pipeline.teacher import KnowledgeDistillation, TeacherResult, finished_teacher, train_teacher

# Caching across runs comes with manifests-based keys later; results are small and
# recomputed from the run directory, so nothing is persisted by Prefect itself.
_TASK = dict(cache_policy=NO_CACHE, persist_result=False)


def new_run_dir(cfg: PipelineConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = cfg.run_root / f"{cfg.name}-{stamp}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = cfg.run_root / f"{cfg.name}-{stamp}-{n}"
    run_dir.mkdir(parents=True)
    return run_dir.resolve()


def _uses_builtin(cfg: PipelineConfig) -> bool:
    return any(m.startswith("builtin:") for m in (cfg.teacher.model, cfg.distill.student_model))


@task(name="base-models", **_TASK)
def base_models_task(cfg: PipelineConfig) -> BaseModels | None:
    """Build the offline tiny models from public text if a stage names `builtin:...`."""
    if not _uses_builtin(cfg):
        return None
    return build_base_models(cfg.base_models, seed=cfg.seed)


@task(name="data", **_TASK)
def data_task(cfg: PipelineConfig, run_dir: Path) -> DataResult:
    return prepare_data(cfg.data, run_dir / "data", seed=cfg.seed, code_domain=cfg.control_codes.domain)


@task(name="control-codes", **_TASK)
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
    return train_teacher(
        cfg.teacher.model_copy(update={"target_epsilon": epsilon}),
        train_path=data.train,
        validation_path=data.validation,
        base_model=model,
        out_dir=run_dir / stage,
        seed=cfg.seed,
        stage=stage,
        kd=kd,
    )


def _teacher_epsilon(cfg: PipelineConfig) -> float:
    # DPKD splits the budget: ε/2 for the teacher, ε/2 for the student trained with KD.
    return cfg.teacher.target_epsilon / 2 if cfg.distill.method == "dpkd" else cfg.teacher.target_epsilon


@task(name="teacher", **_TASK)
def teacher_task(cfg: PipelineConfig, data: DataResult, base: BaseModels | None, run_dir: Path) -> TeacherResult:
    return _dp_train(cfg, data, run_dir, stage="teacher", model=resolve_model(cfg.teacher.model, base),
                     epsilon=_teacher_epsilon(cfg))


@task(name="dp-student", **_TASK)
def dp_student_task(
    cfg: PipelineConfig, data: DataResult, base: BaseModels | None, teacher: TeacherResult | None, run_dir: Path
) -> TeacherResult:
    """Baselines that train the student itself with DP-SGD on the private data."""
    kd = None
    if teacher is not None:  # dpkd
        kd = KnowledgeDistillation(teacher.checkpoint, cfg.distill.alpha, cfg.distill.temperature)
    return _dp_train(cfg, data, run_dir, stage="student", model=resolve_model(cfg.distill.student_model, base),
                     epsilon=cfg.teacher.target_epsilon - (_teacher_epsilon(cfg) if kd else 0.0), kd=kd)


@task(name="generation", **_TASK)
def generation_task(
    cfg: PipelineConfig, teacher: TeacherResult, codes: CodesResult, ledger: list[LedgerEntry], run_dir: Path
) -> GenerateResult:
    # Only the DP checkpoint and the released control-code counts cross into this stage.
    return generate_synthetic(
        cfg.generate,
        teacher_dir=teacher.checkpoint,
        control_codes_path=codes.path,
        ledger=ledger,
        out_dir=run_dir / "synthetic",
        seed=cfg.seed,
    )


@task(name="distillation", **_TASK)
def distillation_task(
    cfg: PipelineConfig, synthetic: GenerateResult, teacher: TeacherResult, base: BaseModels | None, run_dir: Path
) -> DistillResult:
    distill_cfg = cfg.distill
    if distill_cfg.method == "dp_syn":  # the synthetic data alone, no teacher logits
        distill_cfg = distill_cfg.model_copy(update={"alpha": 0.0, "beta": 0.0})
    return distill(
        distill_cfg,
        synthetic_path=synthetic.path,
        teacher_dir=teacher.checkpoint,
        student_model=resolve_model(cfg.distill.student_model, base),
        out_dir=run_dir / "student",
        seed=cfg.seed,
    )


@task(name="evaluation", **_TASK)
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
    return evaluate_models(
        cfg.evaluate, models=models, test_path=data.test, out_dir=run_dir / "evaluation", seed=cfg.seed,
        synthetic_path=synthetic.path if synthetic else None,
    )


@flow(name="dp-distill", persist_result=False, log_prints=True)
def dp_distill(config: PipelineConfig, run_dir: str | None = None) -> str:
    """Teacher (DP-SGD) → generation → distillation → evaluation; returns the run directory."""
    logger = get_run_logger()
    cfg = config
    out = Path(run_dir).resolve() if run_dir else new_run_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", dump_config(cfg))
    logger.info("run directory: %s", out)
    timings: dict[str, float] = {}

    def timed(name, fn, *args):
        t0 = time.time()
        result = fn(*args)
        timings[name] = round(time.time() - t0, 2)
        return result

    method = cfg.distill.method
    base = timed("base_models", base_models_task, cfg)
    data = timed("data", data_task, cfg, out)
    ledger: list[LedgerEntry] = []
    teacher = codes = synthetic = None

    def typed(entries: list[LedgerEntry]) -> PrivacyLedger:
        delta = next(e.delta for e in entries if e.mechanism == "subsampled_gaussian")
        return PrivacyLedger(entries=entries, total=compose(entries, cfg.teacher.accountant, delta))

    if method in ("distil", "dp_syn"):
        codes = timed("control_codes", codes_task, cfg, data, out)
        ledger.append(codes.ledger)
    if method in ("distil", "dp_syn", "dpkd"):
        teacher = timed("teacher", teacher_task, cfg, data, base, out)
        ledger.append(teacher.ledger)
        write_ledger(out / LEDGER, typed(ledger))
    if method in ("distil", "dp_syn"):
        synthetic = timed("generation", generation_task, cfg, teacher, codes, ledger, out)
        ledger.append(post_processing("generation", "samples of the DP teacher, prompted by control codes"))
        student = timed("distillation", distillation_task, cfg, synthetic, teacher, base, out)
        ledger.append(post_processing("distillation", "trains on synthetic samples and the DP teacher only"))
    else:  # dp_sgd, dpkd: the student itself trains on the private data with DP-SGD
        student = timed("dp_student", dp_student_task, cfg, data, base, teacher, out)
        ledger.append(student.ledger)
    evaluation = timed("evaluation", evaluation_task, cfg, data, base, teacher, student, synthetic, out)
    ledger.append(
        post_processing(
            "evaluation",
            "with respect to the training records. It reads the held-out test split, which "
            "this ledger does not protect; only aggregate perplexities leave it",
        )
    )
    final = typed(ledger)
    write_ledger(out / LEDGER, final)

    metrics = {**evaluation, "method": method, "seconds": timings}
    if teacher is not None:
        metrics["teacher_validation_loss"] = teacher.validation_loss
    if synthetic is not None:
        metrics["generation"] = {
            "samples": synthetic.n_samples,
            "validation_samples": synthetic.n_validation,
            "dropped_empty": synthetic.n_dropped_empty,
            "new_tokens_per_second": synthetic.tokens_per_second,
            "shards": len(synthetic.shards),
            "resumed_shards": synthetic.resumed_shards,
            # Aggregate shares only: the requested distribution is the released one.
            "control_codes": {
                code: {"requested": synthetic.requested_codes.get(code, 0.0), "generated": share}
                for code, share in synthetic.generated_codes.items()
            },
        }
    atomic_write_json(out / "metrics.json", metrics)
    publish_ledger(final)
    publish_metrics(metrics)
    logger.info("finished: %s", out)
    return str(out)
