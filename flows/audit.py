"""The Prefect side of `dpdistill audit`: a run's Prefect logs and artifacts, and canary runs.

    dpdistill audit RUN_DIR [--span 10]                                 # verbatim spans
    dpdistill audit --canaries 8 --config configs/demo.yaml [key=value]  # canary exposure

`prefect_sources` (flows/audit_prefect.py) reads what Prefect holds of a flow run, through the
API or from the local server's SQLite database, so that `pipeline.audits.audit.audit_run` scans
it beside the run directory's files. `canary_audit` runs the real flow on a copy of the training data
with canaries inserted (in a 0700 work directory deleted at the end), audits the run and
measures the canaries' exposure (`pipeline.audits.canaries`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flows.audit_prefect import (  # noqa: F401  (the audit's Prefect side, imported from here by the CLI)
    FlowRunNotFound, PrefectDocs, database_documents, local_prefect_database, prefect_documents, prefect_sources,
)
from flows.run_info import STAGES_INFO, RunDirError
from pipeline.audits.audit import audit_run, training_texts
from pipeline.audits.canaries import (
    DEFAULT_CANDIDATES,
    DEFAULT_REPETITIONS,
    canary_exposures,
    copies_in,
    emissions,
    format_table,
    make_canaries,
    read_source,
    summarise,
    write_canary_data,
)
from pipeline.config import PipelineConfig, config_from_dict
from pipeline.privacy.ledger import LEDGER, PrivacyLedger, read_ledger
from pipeline.manifest import atomic_write_json, private_dir

log = logging.getLogger(__name__)

CANARIES = "canaries.json"


# --- canaries ---------------------------------------------------------------------------


def _models(cfg: PipelineConfig, run_dir: Path) -> dict[str, str]:
    """The models whose exposure is measured: the base models as references, the DP
    teacher (when the method has one) and the final student."""
    from pipeline.models.base import BaseModels, build_base_models, resolve_model

    if cfg.base_models.tokenizer == "dp":  # built by the run, in a run directory (its stages.json says which)
        built = Path(json.loads((run_dir / STAGES_INFO).read_text())["base-models"]["output"])
        base = BaseModels(teacher=built / "teacher", student=built / "student")
    else:
        base = build_base_models(cfg.base_models, seed=cfg.seed)  # cached: built by the run
    models = {"base_teacher": resolve_model(cfg.teacher.model, base)}
    if (run_dir / "teacher" / "model").is_dir():
        models["dp_teacher"] = str(run_dir / "teacher" / "model")
    models["base_student"] = resolve_model(cfg.distill.student_model, base)
    models["student"] = str(run_dir / "student" / "model")
    return models


@contextmanager
def secret_work_dir(path: Path) -> Iterator[Path]:
    """The canary audit's work directory, for the data copy (the whole training file plus
    the secrets): new or empty, 0700 whatever the umask as a run directory is
    (pipeline/manifest.py private_dir), and deleted when the audit ends, also on failure."""
    path = Path(path).resolve()
    if path.exists() and (not path.is_dir() or any(path.iterdir()) or path.stat().st_uid != os.geteuid()):
        raise RunDirError(f"--work-dir {path} exists and is not an empty directory of yours: pass a new "
                          "directory (it is deleted when the audit ends)")
    private_dir(path)
    try:
        yield path
    finally:
        shutil.rmtree(path)  # not ignore_errors: a copy of the secrets left behind must not pass silently


def _run_with_canaries(cfg: PipelineConfig, source, canaries: list, work_dir: Path) -> tuple[PipelineConfig, Path, dict]:
    """Write the canaried copy of `source` into `work_dir`, run the flow on it, and count what
    only the copy can tell (canary copies in the training split, the verbatim audit); returns the
    run's config, its directory and those figures."""
    from flows.pipeline_flow import dp_distill

    data_copy = work_dir / f"{Path(cfg.data.path).stem}_with_canaries.parquet"
    added = write_canary_data(source, canaries, cfg.data, data_copy)
    tree = cfg.model_dump(mode="json")
    # The run goes under run_root like any other (0700, its split copies deleted after
    # evaluation), not into the work directory, which is deleted with the copy.
    tree["data"] |= {"path": str(data_copy), "max_records": None}
    tree["name"] = f"{cfg.name}-canaries"
    run_cfg = config_from_dict(tree)
    run_dir = Path(dp_distill(run_cfg))
    # The run deletes its split copies after evaluation: rebuilt from the data copy if so,
    # and audited now, while the copy exists to rebuild its records from.
    in_train = copies_in(training_texts(run_dir)[0], canaries)
    extra, note, unread = prefect_sources(run_dir)
    audit = audit_run(run_dir, extra=extra, extra_note=note, extra_unread=unread).report
    verbatim = {k: audit[k] for k in ("span", "total_hits", "private_records_found", "files_with_hits",
                                      "incomplete", "extra_sources")}
    return run_cfg, run_dir, {"records_added": added, "in_train": in_train, "data_copy": str(data_copy),
                              "verbatim_audit": verbatim}


def canary_audit(
    cfg: PipelineConfig,
    n_canaries: int,
    work_dir: Path,
    repetitions: tuple[int, ...] = DEFAULT_REPETITIONS,
    n_candidates: int = DEFAULT_CANDIDATES,
) -> tuple[Path, dict]:
    """Insert canaries into a copy of the training data (in `work_dir`, deleted at the end),
    run the flow on it, audit the run for verbatim spans, measure the canaries' exposure
    under each model and their verbatim emission in the synthetic data. Writes
    `canaries.json` into the run directory and returns (its path, the report)."""
    from pipeline.stages.generate import read_synthetic
    from pipeline.models.base import load_causal_lm, load_tokenizer

    t0 = time.time()
    source = read_source(cfg.data)
    canaries = make_canaries(n_canaries, source, cfg.data, repetitions)
    with secret_work_dir(work_dir) as work:
        run_cfg, run_dir, made = _run_with_canaries(cfg, source, canaries, work)
    del source
    flow_seconds = time.time() - t0
    in_train = made["in_train"]
    synthetic = read_synthetic(run_dir / "synthetic")["text"].to_pylist() if (run_dir / "synthetic").is_dir() else []
    emitted = emissions(synthetic, canaries)

    models = _models(cfg, run_dir)
    exposures = {}
    for name, path in models.items():
        exposures[name] = canary_exposures(
            load_causal_lm(path), load_tokenizer(path), canaries, run_cfg.data, n_candidates, cfg.seed
        )
    rows = [
        {"canary": c.id, "repetitions": c.repetitions, "copies_in_train": in_train[i],
         "synthetic_emissions": emitted[i],
         "exposure": {m: exposures[m][i]["exposure"] for m in models},
         "rank": {m: exposures[m][i]["rank"] for m in models}}
        for i, c in enumerate(canaries)
    ]
    report = {
        "run_dir": str(run_dir),
        "data_copy": made["data_copy"] + " (deleted)",
        "canaries": len(canaries),
        "records_added": made["records_added"],
        "repetitions": list(repetitions),
        "candidates": n_candidates,
        "max_exposure_bits": math.log2(n_candidates + 1),
        "format": "my account number is <9 random digits> (the secrets are not written here)",
        "models": models,
        **ledger_figures(read_ledger(run_dir / LEDGER)),
        "synthetic_samples": len(synthetic),
        "canaries_emitted": sum(e > 0 for e in emitted),
        "by_repetitions": summarise(rows, list(models)),
        "per_canary": rows,
        "verbatim_audit": made["verbatim_audit"],
        "flow_seconds": round(flow_seconds, 1),
        "elapsed_seconds": round(time.time() - t0, 1),
    }
    out = run_dir / CANARIES
    atomic_write_json(out, report)
    return out, report


def ledger_figures(ledger: PrivacyLedger) -> dict:
    """What canaries.json says of the run's guarantee: the total's ε and the DP training's, each
    add/remove and replace-one (issue 38 item 6), δ, σ and whether every release is DP."""
    teacher = next((e for e in ledger.entries if e.stage in ("teacher", "dp-student") and e.epsilon), None)
    total = ledger.total
    return {
        "epsilon_total": total.epsilon if total else None,
        "epsilon_total_replace_one": total.epsilon_replace_one if total else None,
        "delta": total.delta if total else None,
        "epsilon_dp_training": teacher.epsilon if teacher else None,
        "epsilon_dp_training_replace_one": teacher.epsilon_replace_one if teacher else None,
        "noise_multiplier": teacher.noise_multiplier if teacher else None,
        "ledger_complete": total.complete if total else None,
    }


def format_canary_report(report: dict) -> str:
    models = list(report["models"])
    eps, replace_one = report["epsilon_total"], report.get("epsilon_total_replace_one")  # absent: written before
    head = (f"canary exposure: {report['canaries']} canaries ({report['records_added']} records added), "
            f"{report['candidates']} candidates each; ledger ε = {eps:.4g}"
            + ("" if replace_one is None else f" (replace-one {replace_one:.4g})") + f", δ = {report['delta']:.3g}"
            + ("" if report["ledger_complete"] else " (incomplete: not every release is DP)"))
    return "\n".join([
        head,
        format_table(report["by_repetitions"], models, report["max_exposure_bits"]),
        f"canaries emitted verbatim in {report['synthetic_samples']} synthetic samples: {report['canaries_emitted']}",
        _format_verbatim(report["verbatim_audit"]),
        f"run {report['run_dir']} ({report['flow_seconds']:.0f} s flow, {report['elapsed_seconds']:.0f} s in all)",
    ])


def _format_verbatim(audit: dict) -> str:
    head = f"verbatim audit ({audit['span']}-word spans of the private records; Prefect: {audit['extra_sources']}): "
    found = [f"LEAK: {audit['total_hits']} span(s) in {', '.join(audit['files_with_hits'])}"
             ] if audit["total_hits"] else []
    if unread := audit.get("incomplete"):
        found.append(f"INCOMPLETE: not (wholly) read: {', '.join(unread)} (canaries.json says why)")
    return head + ("; ".join(found) or "clean")
