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


PrefectDocs = dict[str, list]
"""Source name (`prefect:logs`, `prefect:states`, `prefect:parameters`, `prefect:artifact:<key>`)
-> its documents: strings, or decoded JSON values (numbers, dicts, lists) whose texts the audit
reads."""


class FlowRunNotFound(LookupError):
    """The server or database holds no such flow run (another server, or a reset database)."""


def _payload(value):
    """A JSON column as stored: SQLite keeps a number as INTEGER or REAL (a progress artifact's
    `data`), anything else as JSON text; text that is not JSON is kept as the text it is."""
    if not isinstance(value, (str, bytes)):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _artifact(docs: PrefectDocs, key, id_, data, description, metadata) -> None:
    docs.setdefault(f"prefect:artifact:{key or id_}", []).extend(
        [v for v in (data, description, metadata) if v not in (None, "")])


def prefect_documents(flow_run_id: str) -> tuple[PrefectDocs, dict[str, str]]:
    """What Prefect holds of the flow run and its subflow runs (generation's workers), read
    through the API: log messages (task runs' included), state messages and data, parameters,
    and every artifact's data (any type), description and metadata. Returns the documents and
    the sources that could not be read (source -> why)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId,
        LogFilter, LogFilterFlowRunId,
    )
    from prefect.exceptions import ObjectNotFound

    docs: PrefectDocs = {"prefect:logs": [], "prefect:states": [], "prefect:parameters": []}
    unread: dict[str, str] = {}

    def paged(read, **kwargs) -> list:
        out, offset = [], 0
        while True:  # the API pages its answers
            page = read(limit=200, offset=offset, **kwargs)
            out += page
            if len(page) < 200:
                return out
            offset += len(page)

    with get_client(sync_client=True) as client:
        try:
            root = client.read_flow_run(flow_run_id)
        except ObjectNotFound:
            raise FlowRunNotFound(flow_run_id) from None
        runs, frontier = [root], [root]
        while frontier:  # subflow runs, at any depth
            children = paged(client.read_flow_runs, flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[r.id for r in frontier])))
            frontier = [c for c in children if c.id not in {r.id for r in runs}]
            runs += frontier
        ids = [r.id for r in runs]
        docs["prefect:parameters"] += [r.parameters for r in runs if r.parameters]
        docs["prefect:logs"] += [e.message for e in paged(
            client.read_logs, log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids))) if e.message]
        for run in runs:
            states = list(client.read_flow_run_states(run.id))
            task_runs = paged(client.read_task_runs,
                              flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            for task_run in task_runs:
                states += client.read_task_run_states(task_run.id)
            docs["prefect:states"] += [v for st in states for v in (st.message, _state_data(st)) if v]
        for a in paged(client.read_artifacts,
                       artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids))):
            _artifact(docs, a.key, a.id, a.data, a.description, a.metadata_)
    return docs, unread


def _state_data(state):
    """A state's data as the API returns it: a result record's metadata (a storage key), or a
    value; its text is read like any other document."""
    data = getattr(state, "data", None)
    return data.model_dump(mode="json") if hasattr(data, "model_dump") else data if isinstance(
        data, (str, int, float, list, dict)) else None


def local_prefect_database() -> Path | str:
    """The SQLite file a Prefect server started here without PREFECT_API_URL keeps its logs
    in (the setting's default: PREFECT_HOME/prefect.db), or the configured URL when the
    database is not SQLite."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL
    from sqlalchemy.engine import make_url

    url = make_url(PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
    return Path(url.database) if url.drivername.startswith("sqlite") and url.database else url.drivername


def database_documents(db: Path, flow_run_id: str) -> tuple[PrefectDocs, dict[str, str]]:
    """What `prefect_documents` reads through the API, read from the server's SQLite file
    (opened read-only): the flow run and its subflow runs' `log` messages (task runs' carry
    their flow run's id), `flow_run_state` / `task_run_state` messages and data, `flow_run`
    parameters, and the `artifact` table's data (of any type: a progress artifact's is a
    number), descriptions and metadata. Returns the documents and the sources that could not
    be read (source -> why: an exception's type, never its message)."""
    import sqlite3

    docs: PrefectDocs = {"prefect:logs": [], "prefect:states": [], "prefect:parameters": []}
    unread: dict[str, str] = {}
    with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as con:
        if not con.execute("SELECT 1 FROM flow_run WHERE id = ?", (flow_run_id,)).fetchone():
            raise FlowRunNotFound(flow_run_id)
        con.execute("CREATE TEMP TABLE audited(id TEXT PRIMARY KEY)")
        con.execute("""WITH RECURSIVE runs(id) AS (SELECT ? UNION SELECT f.id FROM flow_run f
                       JOIN task_run t ON f.parent_task_run_id = t.id JOIN runs r ON t.flow_run_id = r.id)
                       INSERT INTO audited SELECT id FROM runs""", (flow_run_id,))
        queries = {
            "prefect:logs": "SELECT message FROM log WHERE flow_run_id IN audited ORDER BY timestamp",
            "prefect:states": """SELECT message, data FROM flow_run_state WHERE flow_run_id IN audited
                                 UNION ALL SELECT s.message, s.data FROM task_run_state s
                                 JOIN task_run t ON s.task_run_id = t.id WHERE t.flow_run_id IN audited""",
            "prefect:parameters": "SELECT parameters FROM flow_run WHERE id IN audited",
        }
        for name, sql in queries.items():
            try:
                docs[name] += [_payload(v) for row in con.execute(sql) for v in row if v not in (None, "")]
            except sqlite3.Error as e:  # a database of another schema
                unread[name] = f"the database could not be read ({type(e).__name__})"
        try:
            rows = con.execute("""SELECT key, id, data, description, metadata_ FROM artifact
                                  WHERE flow_run_id IN audited OR task_run_id IN
                                  (SELECT id FROM task_run WHERE flow_run_id IN audited)""").fetchall()
        except sqlite3.Error as e:
            unread["prefect:artifacts"] = f"the database could not be read ({type(e).__name__})"
            rows = []
        for key, id_, data, description, metadata in rows:
            _artifact(docs, key, id_, _payload(data), description, _payload(metadata))
    return docs, unread


def prefect_sources(run_dir: Path) -> tuple[PrefectDocs | None, str, dict[str, str]]:
    """The Prefect documents of the run's flow run: through the API when PREFECT_API_URL is
    set, else from the local server's SQLite database, where a flow run made without a
    server (Prefect's ephemeral one) left its logs. Returns (the documents or None, a note
    for the report, what could not be read: source -> why). A run made by the flow that cannot
    be read in Prefect is unread (the audit is then INCOMPLETE), never passed over."""
    from flows.run_info import RUN_INFO, TOOL

    info_path = Path(run_dir) / RUN_INFO
    try:
        info = json.loads(info_path.read_text()) if info_path.is_file() else None
    except (OSError, ValueError) as e:
        info = e
    if not isinstance(info, dict):
        why = ("not found" if info is None else f"not readable ({type(info).__name__})") + (
            ": the flow run whose Prefect logs and artifacts the run published cannot be found")
        return None, f"not scanned ({RUN_INFO} {why})", {"prefect": f"{RUN_INFO} {why}"}
    flow_run_id = info.get("flow_run_id")
    if not flow_run_id:
        if info.get("tool") == TOOL:  # the flow always records its flow run
            why = f"{RUN_INFO} was written by the flow but names no flow run: its Prefect logs cannot be found"
            return None, f"not scanned ({why})", {"prefect": why}
        return None, f"not scanned ({RUN_INFO} names no flow run: the run was not made by the flow)", {}
    from prefect.settings import PREFECT_API_URL

    if api := PREFECT_API_URL.value():  # the environment, the active profile or a test harness
        where, read = f"server {api}", prefect_documents
    else:
        db = local_prefect_database()
        if not isinstance(db, Path) or not db.is_file():
            why = (f"PREFECT_API_URL is not set and there is no local SQLite database at {db}: set PREFECT_API_URL "
                   "to the server that ran the flow")
            return None, f"not scanned ({why})", {"prefect": why}
        where, read = f"database {db}", lambda run_id: database_documents(db, run_id)
    try:
        docs, unread = read(str(flow_run_id))
    except FlowRunNotFound:
        why = f"flow run {flow_run_id} is not in the {where} (another server or a reset database?)"
        return None, f"not scanned ({why})", {"prefect": why}
    except Exception as e:  # unreachable server, a database of another schema
        why = f"the {where} could not be read ({type(e).__name__})"
        return None, f"not scanned ({why})", {"prefect": why}
    n_artifacts = sum(name.startswith("prefect:artifact:") for name in docs)
    return docs, (f"flow run {flow_run_id} from the {where}: {len(docs['prefect:logs'])} log lines, "
                  f"{len(docs['prefect:states'])} state messages and data, {n_artifacts} artifact(s)"), unread


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
