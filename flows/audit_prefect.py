"""What Prefect holds of a run, for `dpdistill audit RUN_DIR` (pipeline/audits/audit.py).

    docs, note, unread = prefect_sources(run_dir)   # documents by source, a note, source -> why unread

A run's flow run is named by `run.json`'s `flow_run_id`; its subflow runs (generation's
workers) and every task run of them are its Prefect records. Read through the API when
PREFECT_API_URL is set, else from the local server's SQLite database (read-only), where a flow
run made without a server left them. Every table that can hold text is read (issue 62 item 2):
the runs' own rows (flow and task runs: names, parameters, context, tags; their states, logs,
artifacts and artifact collections, flow-run inputs, events naming them, their flow and
deployment), and the tables any run can write to (variables; in the database also automations,
blocks' names, saved searches, concurrency limits, work pools). A database table this module does
not know is named unread, so a newer Prefect's new table makes the audit INCOMPLETE, never clean.
A run whose flow run is unknown (no `run.json`, or one naming no flow run: whoever made the run
directory, its Prefect records cannot be found) is INCOMPLETE too (item 5).
"""

from __future__ import annotations

import json
from contextlib import closing
from datetime import datetime, timedelta, timezone
from pathlib import Path

PrefectDocs = dict[str, list]
"""Source name (`prefect:logs`, `prefect:states`, `prefect:parameters`, `prefect:artifact:<key>`, ...)
-> its documents: strings, or decoded JSON values (numbers, dicts, lists) whose texts the audit reads."""

# Tables the run's records live in, each with the rows that are the run's: `runs` holds the flow
# run and its subflow runs, `tasks` their task runs, `resources` their event resource ids.
_RUN_ROWS = {
    "flow_run": ("prefect:flow_runs", "id IN runs"),
    "task_run": ("prefect:task_runs", "flow_run_id IN runs"),
    "log": ("prefect:logs", "flow_run_id IN runs OR task_run_id IN tasks"),
    "flow_run_state": ("prefect:states", "flow_run_id IN runs"),
    "task_run_state": ("prefect:states", "task_run_id IN tasks"),
    "artifact": ("prefect:artifact:", "flow_run_id IN runs OR task_run_id IN tasks"),
    # The latest artifact of each key, kept apart: it outlives a deleted artifact row.
    "artifact_collection": ("prefect:artifact:", "flow_run_id IN runs OR task_run_id IN tasks"),
    "flow_run_input": ("prefect:flow_run_input", "flow_run_id IN runs"),
    "events": ("prefect:events", "resource_id IN resources OR id IN "
               "(SELECT event_id FROM event_resources WHERE resource_id IN resources)"),
    "event_resources": ("prefect:events", "resource_id IN resources"),
    "flow": ("prefect:flows", "id IN (SELECT flow_id FROM flow_run WHERE id IN runs)"),
    "deployment": ("prefect:deployments", "id IN (SELECT deployment_id FROM flow_run WHERE id IN runs)"),
    "deployment_schedule": ("prefect:deployments",
                            "deployment_id IN (SELECT deployment_id FROM flow_run WHERE id IN runs)"),
    "deployment_version": ("prefect:deployments",
                           "deployment_id IN (SELECT deployment_id FROM flow_run WHERE id IN runs)"),
}
# Tables any flow run can write text to, not tied to one run: read whole.
_SHARED = ("variable", "automation", "automation_bucket", "automation_event_follower", "automation_related_resource",
           "composite_trigger_child_firing", "block_document", "saved_search", "concurrency_limit",
           "concurrency_limit_v2", "work_pool", "work_queue", "worker", "agent")
# Prefect's own: its schema version, the block types' schemas and code, server settings (its
# encryption key), CSRF tokens, links between rows and cache keys; no text a run writes.
_PREFECT_OWN = ("alembic_version", "block_schema", "block_schema_reference", "block_type", "block_document_reference",
                "configuration", "csrf_token", "task_run_state_cache")


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


def _add(docs: PrefectDocs, source: str, values) -> None:
    docs.setdefault(source, []).extend(v for v in values if v not in (None, ""))


def _artifact(docs: PrefectDocs, row: dict) -> None:
    """An artifact (or artifact collection) row under `prefect:artifact:<key or id>`."""
    _add(docs, f"prefect:artifact:{row.get('key') or row.get('latest_id') or row.get('id')}",
         [_payload(v) if k in ("data", "metadata_") else v for k, v in row.items()])


def _run_row(docs: PrefectDocs, row: dict) -> None:
    """A flow run's row: its parameters apart (what the run was called with), the rest beside."""
    _add(docs, "prefect:parameters", [_payload(row.pop("parameters", None))])
    _add(docs, "prefect:flow_runs", [_payload(v) for v in row.values()])


def database_documents(db: Path, flow_run_id: str) -> tuple[PrefectDocs, dict[str, str]]:
    """What the server's SQLite file (opened read-only) holds of the flow run, its subflow runs
    and their task runs: every column of their rows in `_RUN_ROWS`' tables and every row of the
    `_SHARED` ones. Returns the documents and the sources that could not be read (source -> why:
    an exception's type, never its message); a table of none of the lists is one of them."""
    import sqlite3

    docs: PrefectDocs = {"prefect:logs": [], "prefect:states": [], "prefect:parameters": []}
    unread: dict[str, str] = {}
    with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as con:
        con.row_factory = sqlite3.Row
        if not con.execute("SELECT 1 FROM flow_run WHERE id = ?", (flow_run_id,)).fetchone():
            raise FlowRunNotFound(flow_run_id)
        con.execute("CREATE TEMP TABLE runs(id TEXT PRIMARY KEY)")
        con.execute("""WITH RECURSIVE r(id) AS (SELECT ? UNION SELECT f.id FROM flow_run f
                       JOIN task_run t ON f.parent_task_run_id = t.id JOIN r ON t.flow_run_id = r.id)
                       INSERT INTO runs SELECT id FROM r""", (flow_run_id,))
        con.execute("CREATE TEMP TABLE tasks AS SELECT id FROM task_run WHERE flow_run_id IN runs")
        con.execute("""CREATE TEMP TABLE resources AS SELECT 'prefect.flow-run.' || id AS id FROM runs
                       UNION SELECT 'prefect.task-run.' || id FROM tasks""")
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                            "AND name NOT LIKE 'sqlite_%'")]
        for table in sorted(tables):
            if table in _RUN_ROWS:
                source, where = _RUN_ROWS[table]
                sql = f"SELECT * FROM {table} WHERE {where}"
            elif table in _SHARED:
                source, sql = f"prefect:table:{table}", f"SELECT * FROM {table}"
            elif table in _PREFECT_OWN:
                continue
            else:
                unread[f"prefect:table:{table}"] = ("a table this audit does not know (a newer Prefect?): not read; "
                                                    "add it to flows/audit_prefect.py")
                continue
            try:
                rows = [dict(row) for row in con.execute(sql)]
            except sqlite3.Error as e:  # a database of another schema
                unread[f"prefect:table:{table}"] = f"could not be read ({type(e).__name__})"
                continue
            for row in rows:
                if table in ("artifact", "artifact_collection"):
                    _artifact(docs, row)
                elif table == "flow_run":
                    _run_row(docs, row)
                else:
                    _add(docs, source, [_payload(v) for v in row.values()])
    return docs, unread


def _paged(read, **kwargs) -> list:
    out, offset = [], 0
    while True:  # the API pages its answers
        page = read(limit=200, offset=offset, **kwargs)
        out += page
        if len(page) < 200:
            return out
        offset += len(page)


def _dump(obj):
    return obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj


def prefect_documents(flow_run_id: str) -> tuple[PrefectDocs, dict[str, str]]:
    """What `database_documents` reads, through the API: the flow run and its subflow runs, their
    task runs, states, logs, artifacts and latest artifacts, flow-run inputs, events, flow and
    deployment, whole as the API returns them, and the server's variables."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId,
        LogFilter, LogFilterFlowRunId,
    )
    from prefect.exceptions import ObjectNotFound

    docs: PrefectDocs = {"prefect:logs": [], "prefect:states": [], "prefect:parameters": []}
    with get_client(sync_client=True) as client:
        try:
            root = client.read_flow_run(flow_run_id)
        except ObjectNotFound:
            raise FlowRunNotFound(flow_run_id) from None
        runs, frontier = [root], [root]
        while frontier:  # subflow runs, at any depth
            children = _paged(client.read_flow_runs, flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[r.id for r in frontier])))
            frontier = [c for c in children if c.id not in {r.id for r in runs}]
            runs += frontier
        ids, task_ids = [r.id for r in runs], []
        for run in runs:
            _run_row(docs, _dump(run))
            states = list(client.read_flow_run_states(run.id))
            task_runs = _paged(client.read_task_runs, flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            _add(docs, "prefect:task_runs", [_dump(t) for t in task_runs])
            task_ids += [t.id for t in task_runs]
            for task_run in task_runs:
                states += client.read_task_run_states(task_run.id)
            _add(docs, "prefect:states", [_dump(st) for st in states])
            _add(docs, "prefect:flow_run_input", [_dump(i) for i in client.filter_flow_run_input(
                run.id, key_prefix="", limit=10_000, exclude_keys=set())])
            _add(docs, "prefect:flows", [_dump(client.read_flow(run.flow_id))])
            if run.deployment_id:
                _add(docs, "prefect:deployments", [_dump(client.read_deployment(run.deployment_id))])
        _add(docs, "prefect:logs", [_dump(e) for e in _paged(
            client.read_logs, log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)))])
        artifact_filter = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids))
        for a in _paged(client.read_artifacts, artifact_filter=artifact_filter):
            _artifact(docs, _dump(a))
        for a in _paged(client.read_latest_artifacts, flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids))):
            _artifact(docs, _dump(a))
        _add(docs, "prefect:events", _events(client, runs, task_ids))
        _add(docs, "prefect:table:variable", [_dump(v) for v in client.read_variables()])
    return docs, {}


def _events(client, runs, task_ids) -> list:
    """Every event naming one of the runs or their task runs, as resource or related resource."""
    from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventOccurredFilter

    created = [r.created for r in runs if r.created]
    since = min(created) - timedelta(minutes=5) if created else datetime(2000, 1, 1, tzinfo=timezone.utc)
    named = [f"prefect.flow-run.{r.id}" for r in runs] + [f"prefect.task-run.{t}" for t in task_ids]
    event_filter = EventFilter(occurred=EventOccurredFilter(since=since, until=datetime.now(timezone.utc)),
                               any_resource=EventAnyResourceFilter(id=named))
    out, page = [], client.read_events(filter=event_filter, limit=50)  # the API allows 50 a page
    while True:
        out += [_dump(event) for event in page.events]
        if not page.next_page:
            return out
        page = client.read_events_page(page.next_page)


def local_prefect_database() -> Path | str:
    """The SQLite file a Prefect server started here without PREFECT_API_URL keeps its logs
    in (the setting's default: PREFECT_HOME/prefect.db), or the configured URL when the
    database is not SQLite."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL
    from sqlalchemy.engine import make_url

    url = make_url(PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
    return Path(url.database) if url.drivername.startswith("sqlite") and url.database else url.drivername


def _flow_run_id(run_dir: Path) -> tuple[str | None, str]:
    """The run's flow run id, or None and why it is unknown."""
    from flows.run_info import RUN_INFO

    info_path = Path(run_dir) / RUN_INFO
    try:
        info = json.loads(info_path.read_text()) if info_path.is_file() else None
    except (OSError, ValueError) as e:
        info = e
    if not isinstance(info, dict):
        return None, ("not found" if info is None else f"not readable ({type(info).__name__})") + (
            ": the flow run whose Prefect logs and artifacts the run published cannot be found")
    if not info.get("flow_run_id"):
        # Whoever wrote it (the flow always records its flow run): a copy of a run directory
        # with the id removed must not pass as one that never had Prefect records (issue 62 item 5).
        return None, (f"names no flow run: its Prefect logs and artifacts cannot be found. Fix: restore the "
                      f"run's {RUN_INFO} (the flow writes its flow_run_id there)")
    return str(info["flow_run_id"]), ""


def prefect_sources(run_dir: Path) -> tuple[PrefectDocs | None, str, dict[str, str]]:
    """The Prefect documents of the run's flow run: through the API when PREFECT_API_URL is set,
    else from the local server's SQLite database. Returns (the documents or None, a note for the
    report, what could not be read: source -> why). A run whose flow run is unknown or cannot be
    read is unread (the audit is then INCOMPLETE), never passed over."""
    from flows.run_info import RUN_INFO
    from prefect.settings import PREFECT_API_URL

    flow_run_id, why = _flow_run_id(run_dir)
    if flow_run_id is None:
        return None, f"not scanned ({RUN_INFO} {why})", {"prefect": f"{RUN_INFO} {why}"}
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
        docs, unread = read(flow_run_id)
    except FlowRunNotFound:
        why = f"flow run {flow_run_id} is not in the {where} (another server or a reset database?)"
        return None, f"not scanned ({why})", {"prefect": why}
    except Exception as e:  # unreachable server, a database of another schema
        why = f"the {where} could not be read ({type(e).__name__})"
        return None, f"not scanned ({why})", {"prefect": why}
    n_artifacts = sum(name.startswith("prefect:artifact:") for name in docs)
    return docs, (f"flow run {flow_run_id} from the {where}: {len(docs['prefect:logs'])} log lines, "
                  f"{len(docs['prefect:states'])} states, {n_artifacts} artifact(s), "
                  f"{len(docs.get('prefect:events', []))} event(s)"), unread
