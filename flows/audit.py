"""The Prefect side of `dpdistill audit`: a run's Prefect logs and artifacts, and canary runs.

    dpdistill audit RUN_DIR [--span 10]                                 # verbatim spans
    dpdistill audit --canaries 8 --config configs/demo.yaml [key=value]  # canary exposure

`prefect_sources` reads what Prefect holds of a flow run (its logs, task runs' logs
included, and its artifacts: through the API, or from the local server's SQLite database
when no PREFECT_API_URL is set) so that `pipeline.audits.audit.audit_run` scans them beside
the run directory's files. `canary_audit` runs the real flow on a copy of the training data
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
from contextlib import closing, contextmanager
from pathlib import Path

from flows.run_info import RunDirError
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
from pipeline.privacy.ledger import LEDGER, read_ledger
from pipeline.manifest import atomic_write_json, private_dir

log = logging.getLogger(__name__)

CANARIES = "canaries.json"


def prefect_documents(flow_run_id: str) -> dict[str, list[str]]:
    """The flow run's log messages and its artifacts' data and descriptions, by source
    name (`prefect:logs`, `prefect:artifact:<key>`), read with the Prefect client."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    docs: dict[str, list[str]] = {"prefect:logs": []}
    with get_client(sync_client=True) as client:
        offset = 0
        while True:  # the API pages its answers
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=offset
            )
            docs["prefect:logs"] += [entry.message for entry in page]
            if len(page) < 200:
                break
            offset += len(page)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    for a in artifacts:
        data = a.data if isinstance(a.data, str) else json.dumps(a.data)
        name = f"prefect:artifact:{a.key or a.id}"
        docs.setdefault(name, []).extend([data, a.description or ""])
    return docs


def local_prefect_database() -> Path | str:
    """The SQLite file a Prefect server started here without PREFECT_API_URL keeps its logs
    in (the setting's default: PREFECT_HOME/prefect.db), or the configured URL when the
    database is not SQLite."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL
    from sqlalchemy.engine import make_url

    url = make_url(PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
    return Path(url.database) if url.drivername.startswith("sqlite") and url.database else url.drivername


def database_documents(db: Path, flow_run_id: str) -> dict[str, list[str]]:
    """What `prefect_documents` reads through the API, read from the server's SQLite file:
    the `log` table's messages of the flow run (its task runs' logs carry its id too) and
    the `artifact` table's data and descriptions. Opened read-only."""
    import sqlite3

    with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as con:
        logs = con.execute("SELECT message FROM log WHERE flow_run_id = ? ORDER BY timestamp", (flow_run_id,))
        docs: dict[str, list[str]] = {"prefect:logs": [m for (m,) in logs if m]}
        rows = con.execute("SELECT key, id, data, description FROM artifact WHERE flow_run_id = ?", (flow_run_id,))
        for key, id_, data, description in rows:
            value = json.loads(data) if data else ""
            docs.setdefault(f"prefect:artifact:{key or id_}", []).extend(
                [value if isinstance(value, str) else json.dumps(value), description or ""])
    return docs


def prefect_sources(run_dir: Path) -> tuple[dict[str, list[str]] | None, str]:
    """The Prefect documents of the run's flow run: through the API when PREFECT_API_URL is
    set, else from the local server's SQLite database, where a flow run made without a
    server (Prefect's ephemeral one) left its logs. None and why not when neither can be read
    (the audit then says so)."""
    info_path = Path(run_dir) / "run.json"
    flow_run_id = json.loads(info_path.read_text()).get("flow_run_id") if info_path.is_file() else None
    if not flow_run_id:
        return None, "not scanned (run.json names no flow run)"
    from prefect.settings import PREFECT_API_URL

    if api := PREFECT_API_URL.value():  # the environment, the active profile or a test harness
        where, read = f"server {api}", prefect_documents
    else:
        db = local_prefect_database()
        if not isinstance(db, Path) or not db.is_file():
            return None, (f"not scanned (PREFECT_API_URL is not set and there is no local SQLite database at {db}: "
                          "set PREFECT_API_URL to the server that ran the flow)")
        where, read = f"database {db}", lambda run_id: database_documents(db, run_id)
    try:
        docs = read(str(flow_run_id))
    except Exception as e:  # unreachable server, unknown flow run, a database of another schema
        return None, f"not scanned ({where} could not be read: {type(e).__name__})"
    n_logs = len(docs["prefect:logs"])
    return docs, f"flow run {flow_run_id} from the {where}: {n_logs} log lines, {len(docs) - 1} artifact(s)"


# --- canaries ---------------------------------------------------------------------------


def _models(cfg: PipelineConfig, run_dir: Path) -> dict[str, str]:
    """The models whose exposure is measured: the base models as references, the DP
    teacher (when the method has one) and the final student."""
    from pipeline.models.base import build_base_models, resolve_model

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
    extra, note = prefect_sources(run_dir)
    audit = audit_run(run_dir, extra=extra, extra_note=note).report
    verbatim = {k: audit[k] for k in ("span", "total_hits", "private_records_found", "files_with_hits",
                                      "extra_sources")}
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
    ledger = read_ledger(run_dir / LEDGER)
    teacher = next((e for e in ledger.entries if e.stage in ("teacher", "dp-student", "student") and e.epsilon), None)
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
        "epsilon_total": ledger.total.epsilon if ledger.total else None,
        "delta": ledger.total.delta if ledger.total else None,
        "epsilon_dp_training": teacher.epsilon if teacher else None,
        "noise_multiplier": teacher.noise_multiplier if teacher else None,
        "ledger_complete": ledger.total.complete if ledger.total else None,
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


def format_canary_report(report: dict) -> str:
    models = list(report["models"])
    eps = report["epsilon_total"]
    head = (f"canary exposure: {report['canaries']} canaries ({report['records_added']} records added), "
            f"{report['candidates']} candidates each; ledger ε = {eps:.4g}, δ = {report['delta']:.3g}"
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
    if not audit["total_hits"]:
        return head + "clean"
    return head + f"LEAK: {audit['total_hits']} span(s) in {', '.join(audit['files_with_hits'])}"
