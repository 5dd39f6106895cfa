"""The Prefect flow: one task per pipeline stage, chained through files in a run directory.

Run it with the CLI (`dpdistill run --config configs/demo.yaml`) or from Python:

    from flows.pipeline_flow import dp_distill
    run_dir = dp_distill(load_config("configs/demo.yaml"))

The stage tasks are flows/tasks.py, the runner that calls them (cache checks, stages.json, the
records' budget) flows/stage_runner.py; this module is the flow that chains them.

Without PREFECT_API_URL, Prefect runs against its embedded default (a local SQLite
database and a temporary server), so nothing needs to be started first. Tasks take and
return paths and small summaries only: no private record ever passes through Prefect's
state, parameters, results or artifacts.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.artifacts import publish_ledger, publish_metrics, publish_report, publish_synthetic_sample
from flows.run_dirs import claim_run_dir, config_sha, prepare_run_root
from flows.run_info import RUN_INFO, TOOL, mark_stopped, read_run_info, stop_reason
from flows.run_log import route_server_output, run_log
from flows.stage_runner import StageRunner
from flows.tasks import (base_models_task, codes_task, data_task, distillation_task, dp_student_task, evaluation_task,
                         generation_task, public_codes_task, source_hashes, split_for_plan, teacher_task)
from pipeline.config import PipelineConfig, dump_config, load_config
from pipeline.locks import unlock
from pipeline.manifest import atomic_write_json, atomic_write_text, private_dir
from pipeline.plan import Plan, dp_tokenizer_used, format_plan, make_plan, private_selection_used
from pipeline.preflight import require_inputs
from pipeline.preflight_models import require_models
from pipeline.privacy.budget import dataset_total, read_budget, store_total
from pipeline.privacy.control_codes import STAGE as CODES_STAGE
from pipeline.methods import Method, method_spec
from pipeline.models.base import BaseModels, resolve_model
from pipeline.privacy.control_codes import CodesResult
from pipeline.privacy.ledger import LEDGER, LedgerEntry, LedgerTotal, PrivacyLedger, RunLedger, post_processing
from pipeline.reports.model_card import write_model_card
from pipeline.reports.report import write_report
from pipeline.stages.data import DataResult, delete_private_copies
from pipeline.stages.distill import DistillResult
from pipeline.stages.generate import GenerateResult
from pipeline.stages.teacher.state import TeacherResult

route_server_output()  # the temporary server's lines through logging (flows/run_log.py)


@flow(name="dp-distill", persist_result=False, log_prints=True)
def dp_distill(
    config: PipelineConfig | str,
    run_dir: str | None = None,
    overrides: list[str] | None = None,
    rerun: list[str] | None = None,
    plan: Plan | None = None,
    split: str | None = None,
) -> str:
    """Teacher (DP-SGD) → generation → distillation → evaluation; returns the run directory.

    `config` is a config or the path of a YAML file (with dotted `overrides`); `rerun`
    names stages to run again even when cached (`flows.caching.stages_to_rerun`).
    Without `run_dir`, a retried flow run, or a killed or failed run with the same
    config, continues in its directory; otherwise a new one is made. The run directory is
    locked for this process (flows.run_info.RUN_LOCK): two runs never share one.

    `plan`: the run's plan, where the caller made it (`dpdistill run` does), with `split`, the
    directory of the split it was made from (`flows.tasks.split_for_plan`; None where the data
    stage's cached split served), which the data stage moves into the run; the caller deletes
    it. Without them (scheduled runs, Python callers) the flow makes both, once. A `Plan` is a
    dataclass of numbers that Prefect 3.8.8 validates as it is (the same object) and stores as
    JSON with the flow run; `split` is a path, never a record.
    """
    logger = get_run_logger()
    cfg = load_config(config, overrides) if isinstance(config, str) else config
    if split is not None and plan is None:
        raise ValueError("dp_distill: `split` comes with the `plan` made from it; pass both or neither")
    # Fail clean before anything is made (scheduled runs never pass through the CLI's check),
    # then say what the run will spend: the plan reads the data's split and calibrates σ, once
    # per run (here unless the CLI handed it down): each DP-SGD stage takes its σ, q, steps and δ
    # from it, as privacy.max_epsilon's checks do.
    require_inputs(cfg)
    require_models(cfg)
    with ExitStack() as made_here:  # the split this flow makes for its plan, deleted on the way out
        if plan is None:
            planned, split = made_here.enter_context(split_for_plan(cfg, rerun or []))
            plan = make_plan(cfg, split=planned)
        logger.info("%s", format_plan(plan))
        for warning in plan.warnings:
            logger.warning("%s", warning)
        prepare_run_root(cfg)
        out, lock, why = claim_run_dir(cfg, run_dir, flow_run.id)
        if why:
            logger.info("continuing %s (%s); pass a run directory to start elsewhere", out, why)
        try:  # the lock is held until the flow ends, and dropped by the kernel if it is killed
            return _run_in(cfg, out, rerun, logger, plan, split)
        finally:
            unlock(lock)


def _run_in(cfg: PipelineConfig, out: Path, rerun: list[str] | None, logger, plan: Plan, split: str | None) -> str:
    """The flow's body, in the run directory `out` this process holds the lock of; `plan` the run's,
    `split` where the split it was made from waits for the data stage (None: the stage splits)."""
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
            final, metrics = _run_stages(cfg, out, rerun or [], sources, plan, split)
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
        store_total(Path(cfg.run_root).resolve(), budget_id, cfg.teacher.accountant, dataset.delta, dataset)
    publish_ledger(final, budget, dataset)
    publish_metrics(metrics)
    if "generation" in metrics:
        publish_synthetic_sample(Path(metrics["generation"]["path"]))
    atomic_write_json(out / RUN_INFO, run_info | {"status": "completed", "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    logger.info("finished: %s", out)


def _dataset_total(budget, run_total: LedgerTotal | None, accountant: str) -> LedgerTotal | None:
    """Every release on the dataset composed at the budget's δ (this run's if it made the first release)."""
    return dataset_total(budget, accountant, run_total.accountant_delta()) if budget and run_total and budget.releases else None


@dataclass
class _Run:
    """What the method's stages hand each other: their results, as each finishes."""

    cfg: PipelineConfig
    out: Path
    plan: Plan
    stage: StageRunner
    ledger: RunLedger
    data: DataResult | None = None
    base: BaseModels | None = None
    codes: CodesResult | None = None
    teacher: TeacherResult | None = None
    synthetic: GenerateResult | None = None
    student: DistillResult | TeacherResult | None = None
    evaluation: dict = field(default_factory=dict)


# Each stage of a method (pipeline/methods.py `Method.stages`): run it, keep its result, and hand
# back its ledger entries (its DP releases, charged to the records' budget, or post-processing).
def _codes(run: _Run) -> list[LedgerEntry]:
    if method_spec(run.cfg.distill.method).releases_codes:  # a DP release of the training split's codes
        run.codes = run.stage(CODES_STAGE, codes_task, run.cfg, run.data, run.plan, run.out)
    else:  # the ε = 0 control: the public domain, no record read
        run.codes = run.stage(CODES_STAGE, public_codes_task, run.cfg, run.out)
    return run.stage.charge(CODES_STAGE, run.codes)


def _base_teacher(run: _Run) -> str | None:
    """The ε = 0 control's teacher, the base model; None with a DP teacher."""
    return None if run.teacher is not None else resolve_model(run.cfg.teacher.model, run.base)


def _teacher(run: _Run) -> list[LedgerEntry]:
    run.teacher = run.stage("teacher", teacher_task, run.cfg, run.data, run.base, run.plan, run.out)
    return run.stage.charge("teacher", run.teacher)


def _generation(run: _Run) -> list[LedgerEntry]:
    run.synthetic = run.stage("generation", generation_task, run.cfg, run.teacher, run.codes, run.ledger.entries,
                              run.out, base_teacher=_base_teacher(run))
    teacher = "the DP teacher" if run.teacher is not None else "the base teacher (no private record)"
    return [post_processing("generation", f"samples of {teacher}, prompted by control codes")]


def _distillation(run: _Run) -> list[LedgerEntry]:
    private = run.data if private_selection_used(run.cfg) else None  # its only private read
    run.student = run.stage("distillation", distillation_task, run.cfg, run.synthetic, run.teacher, run.base,
                            run.plan, run.out, data=private, base_teacher=_base_teacher(run))
    teacher = "the DP teacher" if run.teacher is not None else "the base teacher"
    return ([post_processing("distillation", f"trains on synthetic samples and {teacher} only")]
            + run.stage.charge("distillation", run.student))


def _dp_student(run: _Run) -> list[LedgerEntry]:
    """The student itself trained on the private data with DP-SGD (with the teacher's KD: DPKD)."""
    run.student = run.stage("dp-student", dp_student_task, run.cfg, run.data, run.base, run.teacher, run.plan,
                            run.out)
    return run.stage.charge("dp-student", run.student)


def _evaluation(run: _Run) -> list[LedgerEntry]:
    run.evaluation = run.stage("evaluation", evaluation_task, run.cfg, run.data, run.base, run.teacher, run.student,
                               run.synthetic, run.codes, run.out)
    return [post_processing("evaluation", "with respect to the training records. It reads the held-out test split, "
                            "which this ledger does not protect; only aggregate perplexities leave it")]


STEPS = {CODES_STAGE: _codes, "teacher": _teacher, "generation": _generation, "distillation": _distillation,
         "dp-student": _dp_student, "evaluation": _evaluation}


def _run_stages(
    cfg: PipelineConfig, out: Path, rerun: list[str], sources: dict[str, str], plan: Plan, split: str | None = None
) -> tuple[PrivacyLedger, dict]:
    stage = StageRunner(cfg, out, rerun)
    spec = method_spec(cfg.distill.method)
    run = _Run(cfg, out, plan, stage, RunLedger(out / LEDGER, cfg.teacher.accountant))
    if dp_tokenizer_used(cfg):  # the vocabulary is a DP release of the split's words: the data first
        run.data = stage("data", data_task, cfg, sources, out, split)
        stage.use_records(run.data)
        run.base = stage("base-models", base_models_task, cfg, run.data, plan, out)
        run.ledger.add(stage.charge("base-models", run.base))
    else:
        run.base = stage("base-models", base_models_task, cfg)
        run.data = stage("data", data_task, cfg, sources, out, split)
        stage.use_records(run.data)
    for name in spec.stages:
        final = run.ledger.add(STEPS[name](run))
    _write_model_cards(run, final, spec.student_stage)
    _delete_private_copies(run)
    metrics = _metrics(run, spec)
    atomic_write_json(out / "metrics.json", metrics)
    return final, metrics


def _write_model_cards(run: _Run, final: PrivacyLedger, student_stage: str) -> None:
    for model, stage_name in ((run.teacher, "teacher"), (run.student, student_stage)):
        if model is not None and Path(model.checkpoint).resolve().is_relative_to(run.out):  # not a cached run's copy
            write_model_card(model.checkpoint, final, stage=stage_name, run_name=run.out.name)


def _delete_private_copies(run: _Run) -> None:
    """Nothing after evaluation reads the splits (report, status and artifacts read manifests,
    ledgers and metrics). Only this run's copy: a cached data stage lives in another run."""
    if not run.cfg.data.keep_private_copies and Path(run.data.train).parent.is_relative_to(run.out):
        deleted = delete_private_copies(run.data)
        run.stage.log.info("data: deleted the private splits (%s) now that evaluation is done; their sha256 "
                           "stay in data/manifest.json (data.keep_private_copies=true keeps them)",
                           ", ".join(p.name for p in deleted))


def _metrics(run: _Run, spec: Method) -> dict:
    """metrics.json: evaluation's figures, and what each stage took and made (sizes and timings: published)."""
    stage, data, teacher, student, synthetic = run.stage, run.data, run.teacher, run.student, run.synthetic
    evaluation = {k: v for k, v in run.evaluation.items() if k != "evaluation_dir"}
    metrics = {**evaluation, "method": spec.name,
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
    return metrics
