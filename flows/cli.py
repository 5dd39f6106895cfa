"""`dpdistill`: the command line.

    dpdistill run --config configs/demo.yaml [key=value ...]   # the whole pipeline
    dpdistill run --config C --from generation                 # rerun generation and later stages
    dpdistill run --config C --force teacher                   # rerun one stage
    dpdistill status runs/demo-...                             # stages done, durations, ε
    dpdistill report runs/demo-...                             # (re)write its report.html
    dpdistill serve --config C --cron "0 3 * * *"              # a scheduled deployment
    dpdistill build-base --config configs/builtin.yaml        # only the offline base models
    dpdistill build-base --config configs/builtin.yaml --export pipeline/models/builtin   # rebuild the shipped pair
    dpdistill plan --config C [key=value ...]                 # N, q, σ, steps, ε and time; trains nothing
    dpdistill ledger show runs/demo-...                       # a run's privacy ledger
    dpdistill audit runs/demo-... [--span 10]                 # published files vs training records
    dpdistill audit --canaries 8 --config C [key=value ...]   # canary exposure of a fresh run
    dpdistill audit --empirical runs/demo-...                # empirical ε, membership, extraction
    dpdistill models fetch smollm2-135m                      # a real model into the model cache (cache:smollm2-135m)
    dpdistill models student smollm2-135m --layers 4         # a pruned, healed student of it (flows/cli_models.py)

Overrides use dotted keys: `teacher.target_epsilon=4 generate.num_samples=500`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

# Only light modules here: `--help`, `status`, `ledger show`, `report` and config errors
# must answer without importing torch, transformers, Opacus or Prefect (tens of seconds on a
# loaded machine; issue 10). The commands that need them import them in their handlers.
from flows.cli_audit import add_audit_parser, run_empirical
from flows.cli_models import add_models_parser, run_models
from flows.run_info import RUN_INFO, STAGES, STAGES_INFO, TOOL, RunDirError, read_run_info, run_alive, stages_to_rerun
from pipeline.config import ConfigError, load_config
from pipeline.reports import STAGE_WORDS
from pipeline.privacy.ledger import LEDGER, format_table, read_ledger

AUDIT_INCOMPLETE = 3
"""`dpdistill audit`'s exit status when nothing was found but not everything could be read."""
EPHEMERAL_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


class DamagedFileError(Exception):
    """A run directory's JSON file that cannot be read; the message names it and the fix."""


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that carry a message for the user. Most live beside torch code, so only
    the commands that run the pipeline call this."""
    from pipeline.records import DataError
    from pipeline.stages.distill import DistillError
    from pipeline.stages.generate import GenerateError
    from pipeline.models.base import ModelError
    from pipeline.privacy.dpsgd import TeacherError

    return (ConfigError, DataError, TeacherError, GenerateError, DistillError, ModelError, RunDirError)


# What to do about each damaged file, as the flow treats it on a rerun: a run directory with
# an unreadable run.json is refused (not provably ours), an unreadable stages.json stops the
# resume, while ledger.json and metrics.json are rewritten from the finished stages.
_REWRITE = {
    RUN_INFO: "run the same config again without --run-dir (finished stages are reused from the cache)",
    STAGES_INFO: "it holds only the table `dpdistill status` prints: delete it and run the same command "
                 "with --run-dir {run_dir} to rebuild it",
    LEDGER: "run the same command with --run-dir {run_dir} (finished stages are reused) to rewrite it",
    "metrics.json": "run the same command with --run-dir {run_dir} --from evaluation to rewrite it",
}


def _damaged(path: Path, err: Exception) -> DamagedFileError:
    fix = _REWRITE.get(path.name, "run the same command again").format(run_dir=path.parent)
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return DamagedFileError(f"{path} is damaged ({reason}); {fix}")


def read_json_file(path: Path):
    """A run directory's JSON file; a truncated or garbled one raises DamagedFileError."""
    try:
        return json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise _damaged(Path(path), e) from e


def read_ledger_file(path: Path):
    try:
        return read_ledger(path)
    except (ValueError, UnicodeDecodeError) as e:  # bad JSON, or JSON that is not a ledger (pydantic)
        raise _damaged(Path(path), e) from e


def prefect_server_error(err: BaseException) -> str | None:
    """One line for Prefect's 'ephemeral API server did not start in time' RuntimeError,
    None for any other error."""
    if not (isinstance(err, RuntimeError) and "ephemeral Prefect API server" in str(err)):
        return None
    timeout = os.environ.get(EPHEMERAL_TIMEOUT_ENV, "?")
    return (
        f"the temporary local Prefect server did not start within {timeout} s (PREFECT_API_URL is unset, "
        f"so each run starts one; the machine is probably busy). Set {EPHEMERAL_TIMEOUT_ENV} higher "
        "(e.g. 600), or run `prefect server start` in another terminal and set "
        "PREFECT_API_URL=http://127.0.0.1:4200/api"
    )


def quiet_libraries() -> None:
    """Keep the terminal to our progress lines: no per-load progress bars or advice."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("opacus").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="Secure RNG turned off")  # we log our own warning
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    # numpy's divide-by-zero/overflow inside the PRV accountant at extreme σ: ε stays correct
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"opacus\.accountants")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpdistill", description="Differentially private distillation of LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("run", "run the whole pipeline as a Prefect flow"),
        ("serve", "serve the flow on a cron schedule against a Prefect server (blocks)"),
        ("build-base", "build the offline tokenizer and base models from public text (base_models.corpus)"),
        ("plan", "print N, batch size, q, σ, steps, ε (each stage and total) and a time estimate; "
                 "trains and writes nothing"),
        ("join-teacher", "on node 1..nnodes-1: run this node's ranks of the data-parallel teacher that "
                         "node 0's flow starts (teacher.nnodes > 1; set teacher.node_rank)"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", required=True, help="YAML config, e.g. configs/demo.yaml")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
        if name == "run":
            p.add_argument(
                "--run-dir",
                help="write into this run directory; an interrupted run resumes there "
                "(the teacher continues from its last checkpoint and accountant state). Without it, "
                "a killed or failed run with the same config is continued, else a new directory is made",
            )
            p.add_argument("--from", dest="rerun_from", choices=STAGES, metavar="STAGE",
                           help=f"rerun this stage and every later one even if cached ({', '.join(STAGES)})")
            p.add_argument("--force", action="append", choices=STAGES, metavar="STAGE", default=[],
                           help="rerun this stage even if cached (repeatable)")
        if name == "build-base":
            p.add_argument("--export", metavar="DIR",
                           help="also write the pair as the shipped one is stored (fp16 safetensors, "
                           "tokenizer, build.json): --export pipeline/models/builtin replaces the shipped pair")
        if name == "serve":
            p.add_argument("--cron", required=True, help='cron schedule, e.g. "0 3 * * *" (03:00 every day)')
            p.add_argument("--timezone", default="UTC", help="time zone of the schedule (default UTC)")
            p.add_argument("--name", help="deployment name (default: <config name>-scheduled)")
    status = sub.add_parser("status", help="which stages of a run are done, their durations and ε")
    status.add_argument("run_dir", help="a run directory")
    report = sub.add_parser("report", help="(re)write a run's report.html")
    report.add_argument("run_dir", help="a run directory")
    ledger = sub.add_parser("ledger", help="inspect a run's privacy ledger")
    ledger.add_argument("action", choices=["show"])
    ledger.add_argument("run_dir", help="a run directory (holding ledger.json)")
    add_audit_parser(sub)
    add_models_parser(sub)
    return parser


def run_audit(args) -> int:
    """`dpdistill audit`: 0 clean (everything read, nothing found), 1 a leak, 2 a usage error,
    3 incomplete (nothing found, but something the run publishes could not be read: a clean
    exit would be a claim about what was not read). Counts and names only."""
    import prefect.main  # noqa: F401  (before pipeline.* imports Opacus: see flows/__init__.py)
    from pipeline.audits.audit import AuditError, audit_run, format_audit

    def usage(msg: str) -> int:
        print(f"dpdistill audit: error: {msg}", file=sys.stderr)
        return 2

    if args.empirical:
        return run_empirical(args, usage, user_errors())
    if args.canaries is None:
        if args.config or not args.run_dir or args.overrides:
            return usage("pass one run directory (dpdistill audit RUN_DIR), or --canaries N --config C")
        from flows.audit import prefect_sources

        run_dir = Path(args.run_dir)
        if not (run_dir / "config.yaml").is_file():
            return usage(f"{run_dir} holds no config.yaml: pass a run directory")
        extra, note, unread = prefect_sources(run_dir)
        try:
            result = audit_run(run_dir, span=args.span, extra=extra, extra_note=note, extra_unread=unread)
        except (AuditError, *user_errors()) as e:  # their messages name rows and fields, never records
            return usage(str(e))
        print(format_audit(result.report))
        print(f"written: {result.path}")
        return 1 if result.leak else AUDIT_INCOMPLETE if result.incomplete else 0

    if not args.config:
        return usage("--canaries needs --config, e.g. --config configs/demo.yaml")
    overrides = ([args.run_dir] if args.run_dir else []) + args.overrides  # key=value lands in run_dir first
    if any("=" not in o for o in overrides):
        return usage("with --canaries, pass no run directory: the tool makes its own run")
    try:
        repetitions = tuple(int(r) for r in args.repetitions.split(","))
    except ValueError:
        return usage(f"--repetitions {args.repetitions!r}: use comma-separated counts, e.g. 1,1,4,16")
    if args.canaries < 1 or args.candidates < 1 or min(repetitions) < 1:
        return usage("--canaries, --candidates and every repetition must be at least 1")
    quiet_libraries()
    from flows.audit import canary_audit, format_canary_report

    try:
        cfg = load_config(args.config, overrides)
        work = Path(args.work_dir) if args.work_dir else cfg.run_root / f"canaries-{time.strftime('%Y%m%d-%H%M%S')}"
        path, report = canary_audit(cfg, args.canaries, work, repetitions, args.candidates)
    except user_errors() as e:
        return usage(str(e))
    print(format_canary_report(report))
    print(f"written: {path}")
    verbatim = report["verbatim_audit"]
    return 1 if verbatim["total_hits"] else AUDIT_INCOMPLETE if verbatim["incomplete"] else 0


def make_deployment(config_path: str, cron: str, overrides: list[str], name: str | None = None,
                    timezone: str = "UTC"):
    """The scheduled deployment `serve` runs: the flow reads the YAML file at each run, so
    edits to it apply from the next run on."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.schedules import Cron

    from flows.pipeline_flow import dp_distill

    cfg = load_config(config_path, overrides)  # fail now, not at 3 a.m.
    return dp_distill.to_deployment(
        name=name or f"{cfg.name}-scheduled",
        schedule=Cron(cron, timezone=timezone),
        # One run at a time (issue 10): a slow run and the next scheduled one must never train
        # two teachers on the same data at once; the later run waits (ENQUEUE), it is not dropped.
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        parameters={"config": str(Path(config_path).resolve()), "overrides": overrides},
        description=f"dpdistill on {config_path}, schedule {cron} ({timezone})",
    )


def print_status(run_dir: Path) -> int:
    info_path, stages_path = run_dir / RUN_INFO, run_dir / STAGES_INFO
    if not info_path.is_file():
        print(f"dpdistill: error: {info_path} not found; pass a run directory", file=sys.stderr)
        return 2
    # Every file is read before the first line prints: a damaged one gives one error line.
    info = read_json_file(info_path)
    if not isinstance(info, dict) or "status" not in info:
        raise _damaged(info_path, ValueError("no status field"))
    stages = read_json_file(stages_path) if stages_path.is_file() else {}
    ledger = read_ledger_file(run_dir / LEDGER) if (run_dir / LEDGER).is_file() else None
    state = info["status"]
    if state == "running" and not run_alive(info):
        state = "interrupted (its process is gone): run the same command again to continue it"
    elif state in ("failed", "interrupted"):
        why = f" ({info['reason']})" if info.get("reason") else ""
        state = f"{state}{why}: run the same command again to continue it (log: {run_dir / 'run.log'})"
    print(f"run {run_dir}\nstatus: {state}; started {info.get('started_at')}"
          + (f", finished {info['finished_at']}" if info.get("finished_at") else ""))
    rows = [("stage", "status", "seconds", "epsilon", "replace-one", "output")]
    entries = {e.stage: e for e in ledger.entries} if ledger is not None else {}  # for an older stages.json
    for name in STAGES:
        if name not in stages:
            continue
        s = stages[name]
        out = s.get("output") or ""
        if out and Path(out).is_relative_to(run_dir.resolve()):
            out = str(Path(out).relative_to(run_dir.resolve()))
        elif out and s["status"] == "cached":
            out = f"reused from {out}"
        eps = s.get("epsilon")
        replace_one = s.get("epsilon_replace_one", getattr(entries.get(name), "epsilon_replace_one", None))
        rows.append((name, STAGE_WORDS.get(s["status"], s["status"]),
                     f"{s['seconds']:.1f}" if s.get("seconds") is not None else "",
                     f"{eps:.4f}" if eps else "", f"{replace_one:.4f}" if eps and replace_one else "", out))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
    if ledger is not None:
        total = ledger.total
        if total:
            replace_one = "" if total.epsilon_replace_one is None else f", replace-one ε = {total.epsilon_replace_one:.4f}"
            print(f"total: ε = {total.epsilon:.4f}{replace_one}, δ = {total.delta:.3g} ({total.accountant})"
                  + ("" if total.complete else "; incomplete: " + total.note))
    return 0


def planned_budget(cfg, plan) -> str:
    """`plan`'s lines on the training records' budget under run_root: spent by earlier runs, and
    with this run; BudgetExceeded past privacy.max_epsilon. Writes nothing."""
    from pipeline.privacy.budget import budget_of, check_max_epsilon, dataset_total
    from pipeline.stages.data import with_training_split

    root = Path(cfg.run_root).resolve()
    budget = with_training_split(cfg.data, root, cfg.control_codes.domain, lambda train: budget_of(root, train))
    delta, accountant, limit = plan.total.accountant_delta(), cfg.teacher.accountant, cfg.privacy.max_epsilon
    spent = dataset_total(budget, accountant, delta)
    total = check_max_epsilon(budget, plan.entries, limit, accountant, delta)
    lines = [f"  budget of these {budget.n_records} training records under {cfg.run_root} (every run, with records "
             "overlapping them): " + ("nothing spent yet" if spent is None else
                                      f"ε = {spent.epsilon:.4f} over {len(budget.releases)} DP releases")]
    if total is not None:
        fixed = "" if total.accountant_delta() == delta else " (the δ the budget's first run fixed)"
        lines.append(f"    with this run: ε = {total.epsilon:.4f}, replace-one ε = {total.epsilon_replace_one:.4f} "
                     f"at δ = {total.delta:.3g}{fixed}"
                     + ("" if limit is None else f", within privacy.max_epsilon={limit:g}")
                     + ("" if spent is None else " (if no stage of it is cached: a cached stage spends nothing)"))
    return "\n".join(lines)


def print_dataset_budget(run_dir: Path, ledger) -> None:
    """Every DP release charged to the budget of the run's training records (made on them or on
    records overlapping them, by any run), composed at the δ its first release fixed (pipeline/privacy/budget.py)."""
    from pipeline.privacy.budget import dataset_total, format_budget, read_budget, stored_total

    info = read_run_info(run_dir)
    budget_id = info.get("records_id") or info.get("dataset_sha256")  # keyed by the file's bytes before issue 21
    if not (budget_id and info.get("run_root")):
        return  # a run from before the dataset budget was kept
    budget = read_budget(Path(info["run_root"]), budget_id)
    total = None
    if ledger.total and budget.releases:
        delta = budget.delta or ledger.total.accountant_delta()  # the first release's, fixed (a run's only if none is Gaussian)
        # The total the run's accountant composed at its end, if the releases are still those;
        # else compose now (dataset_total imports Opacus and torch then: seconds).
        total = (stored_total(budget, ledger.total.accountant, delta)
                 or dataset_total(budget, ledger.total.accountant, delta))
    print(f"\nAll releases on this dataset (on these training records or records overlapping them, every run "
          f"under {info['run_root']}; budget {budget_id[:12]}…):")
    print(format_budget(budget, total))


def write_run_report(run_dir: Path) -> int:
    """`dpdistill report`: check the files it reads, then (re)write report.html."""
    if not run_dir.is_dir():
        print(f"dpdistill: error: run directory {run_dir} does not exist; pass the directory a run wrote "
              "(`dpdistill status` lists its stages)", file=sys.stderr)
        return 2
    for name in (RUN_INFO, STAGES_INFO, "metrics.json"):
        if (run_dir / name).is_file():
            read_json_file(run_dir / name)
    if (run_dir / LEDGER).is_file():
        read_ledger_file(run_dir / LEDGER)
    from pipeline.reports.report import write_report  # matplotlib and pyarrow, not torch

    # A stage that stages.json records as running is running only while the run's process is.
    info = read_run_info(run_dir)
    print(write_report(run_dir, writer_alive=info.get("status") == "running" and run_alive(info)))
    return 0


def show_ledger(run_dir: Path) -> int:
    path = run_dir / LEDGER
    if not path.is_file():
        info = read_run_info(run_dir)
        if info.get("tool") != TOOL:
            why = f"{run_dir} is not a run directory (no {RUN_INFO} written by dpdistill); pass the directory a run wrote"
        else:  # a run of ours that has not written its ledger (yet)
            state = "is still running" if info.get("status") == "running" and run_alive(info) else \
                f"stopped ({info.get('status', 'unknown')})"
            why = (f"{run_dir} has no {LEDGER} yet: the run {state} before writing it, so it has released "
                   "nothing a ledger would list; `dpdistill status` shows how far its stages got")
        print(f"dpdistill: error: {why}", file=sys.stderr)
        return 2
    ledger = read_ledger_file(path)
    print(format_table(ledger))
    print_dataset_budget(run_dir, ledger)
    return 0


def one_line(err: BaseException, run_log: str | None = None, limit: int = 1500) -> str:
    """An error's message on one line (a data error lists its rows on several), cut at
    `limit` characters with a pointer to the run's log, which holds all of it."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
    if len(text) > limit:
        text = text[:limit] + " ... (cut; all of it in " + (run_log or "the output above") + ")"
    return text


def _failure(err: BaseException) -> tuple[str, int]:
    """The last line of a failed `dpdistill run`, and its exit code: 2 for a user error (the
    message says what to fix), 1 for a bug (the traceback was logged)."""
    log = getattr(err, "dpdistill_run_log", None)
    if isinstance(err, user_errors()):
        return f"dpdistill: error: {one_line(err, log)}", 2
    if (message := prefect_server_error(err)) is not None:
        return f"dpdistill: error: {message}", 2
    if log is None:  # raised before the flow's run log existed: Prefect logged no traceback
        import traceback

        traceback.print_exc()
    where = f"above and in {log}" if log else "above"
    return (f"dpdistill: error: unexpected {type(err).__name__}: {one_line(err, log, 300)} "
            f"(a bug: the traceback is {where}; please report it)"), 1


def _stop_prefect() -> None:
    """Send Prefect's queued log lines and events, then stop the temporary server if this
    run started one (PREFECT_API_URL unset), so that none of their shutdown messages lands
    after our last line (Prefect would stop it at exit)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10, at_exit=False)
    if not PREFECT_API_URL.value():
        SubprocessASGIServer().stop()


class EarlyServer:
    """Prefect's temporary server (PREFECT_API_URL unset), started in a thread as soon as the
    data has been read, so that its start (7 s in a process of its own, 19 s on a new
    PREFECT_HOME's database) runs beside torch's imports and the σ calibration instead of
    after them; `wait` joins it before the flow asks for a client, which then finds it
    running. Nothing starts before every row has been checked: a bad record still stops the
    run with no server (issue 10)."""

    def __init__(self):
        self.thread, self.error = None, None

    def start(self) -> None:
        import threading

        from prefect.server.api.server import SubprocessASGIServer
        from prefect.settings import PREFECT_API_URL

        from flows.run_log import route_server_output

        if PREFECT_API_URL.value():
            return
        route_server_output()  # its lines through logging, muted after an interrupt

        def start():
            try:
                SubprocessASGIServer().start()
            except Exception as e:  # raised in the main thread by `wait`
                self.error = e
        self.thread = threading.Thread(target=start, name="prefect-server-start", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error


def run_flow(args, cfg) -> int:
    """`dpdistill run`: the flow, with one line at the end of the terminal output saying how
    it ended (run.log in the run directory holds the tracebacks). Exit codes: 0 done, 2 a
    user error, 1 a bug, 130/143 interrupted by SIGINT/SIGTERM (flows/interrupts.py)."""
    from prefect.exceptions import TerminationSignal

    from flows.interrupts import Interrupts
    from flows.run_log import keep_early_lines, quiet_expected_errors

    with Interrupts() as interrupts:
        try:
            import prefect.main  # noqa: F401  Prefect configures logging first (flows/__init__.py)

            from flows.tasks import split_for_plan  # Opacus; torch came with require_models

            keep_early_lines()  # the data, the server's start and the plan, for run.log once the run directory exists
            rerun = stages_to_rerun(args.rerun_from, args.force)
            # Every row of the data read before any Prefect server starts, and σ calibrated
            # before the flow: a bad record or an unreachable budget is one line, with no run
            # directory left (and, for a bad record, no server started). The split is made once
            # (issue 61), here, in a private directory that the data stage moves into the run
            # and that is deleted on the way out; not at all where the data stage's cached split
            # serves. The flow takes this plan and this split, and makes neither again.
            with split_for_plan(cfg, rerun) as (split, ahead):
                if ahead is not None:  # os._exit after a signal skips the `with`'s exit
                    interrupts.on_exit(lambda: shutil.rmtree(ahead, ignore_errors=True))
                server = EarlyServer()
                server.start()
                from pipeline.plan import make_plan

                plan = make_plan(cfg, split=split)
                from flows.pipeline_flow import dp_distill

                server.wait()
                # A signal's traceback too: Prefect logs it as the flow unwinds, maybe before the
                # watcher thread has muted the terminal (flows/interrupts.py); run.log keeps it.
                quiet_expected_errors(user_errors() + (KeyboardInterrupt, TerminationSignal))
                run_dir = dp_distill(cfg, run_dir=args.run_dir, rerun=rerun, plan=plan, split=ahead)
        except (KeyboardInterrupt, TerminationSignal) as e:
            interrupts.finish(getattr(e, "signal", None))  # does not return
            raise
        except Exception as e:
            if interrupts.signum is not None:  # e.g. a worker that the signal stopped first
                interrupts.finish()
            line, code = _failure(e)
        else:
            line, code = f"\nrun directory: {run_dir}", 0
        _stop_prefect()
        print(line, file=sys.stderr if code else sys.stdout, flush=True)
        return code


def join_teacher(cfg) -> int:
    """This node's ranks of a teacher across nodes, until node 0's job ends: torchrun's exit code."""
    t = cfg.teacher
    if t.nnodes < 2 or t.node_rank == 0:
        print(f"dpdistill: error: join-teacher runs on nodes 1..nnodes-1 of a teacher across nodes (the config has "
              f"teacher.nnodes={t.nnodes}, teacher.node_rank={t.node_rank}); node 0 runs `dpdistill run`",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from pipeline.devices import Runtime
    from pipeline.stages.teacher import ddp as teacher_ddp
    from pipeline.stages.teacher import recipe as teacher

    return teacher_ddp.join(processes=t.processes, backend=t.ddp_backend, nodes=teacher.nodes(t),
                            threads=Runtime.from_config(cfg).threads_for(t.processes))


def run_pipeline(args) -> int:
    """`run`, `serve`, `plan` and `build-base`: the commands that import torch (and but for
    `plan`, Prefect)."""
    try:
        cfg = load_config(args.config, args.overrides)  # a config error answers before the heavy imports
    except ConfigError as e:
        print(f"dpdistill: error: {e}", file=sys.stderr)
        return 2
    if args.command in ("run", "serve", "plan"):
        from pipeline.preflight import PreflightError, require_inputs  # no torch, no Prefect

        try:  # before any Prefect server starts or run directory is made (issue 10)
            require_inputs(cfg)
        except PreflightError as e:
            print(f"dpdistill: error: {e}", file=sys.stderr)
            return 2
    quiet_libraries()
    if args.command in ("run", "plan"):
        from pipeline.preflight import PreflightError
        from pipeline.preflight_models import require_models  # torch: the models' configs on the meta device

        try:  # a model no stage can run is refused now, not after the data stage (issue 35)
            require_models(cfg)
        except PreflightError as e:
            print(f"dpdistill: error: {e}", file=sys.stderr)
            return 2
    if args.command == "run":
        return run_flow(args, cfg)
    try:
        if args.command == "plan":
            # The plan prints its own lines: a stage's INFO lines (the data split's, read for the
            # budget) in Opacus's basicConfig format ("11/24/2026 04:44:31:INFO:data: ...") were
            # noise after it. Warnings still show, in our format (set before Opacus's, a no-op then).
            logging.basicConfig(format="dpdistill: %(levelname)s: %(message)s")
            logging.getLogger("pipeline").setLevel(logging.WARNING)
            from pipeline.plan import format_plan, format_times, make_plan  # torch, Opacus; no Prefect
            from pipeline.plan_time import estimate_seconds
            from pipeline.stages.data import planned_split

            # Progress on stderr while it works, the plan itself on stdout: its privacy numbers and
            # the budget as soon as they are known (seconds), then the time (the steps timed, more).
            started = time.monotonic()

            def say(line: str) -> None:
                print(f"{line} ({time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)
            split = planned_split(cfg.data, Path(cfg.run_root), cfg.control_codes.domain)
            plan = make_plan(cfg, say=say, split=split)
            print(format_plan(plan), flush=True)
            print(planned_budget(cfg, plan), flush=True)  # refused past privacy.max_epsilon: a user error, exit code 2
            for warning in plan.warnings:
                print(f"dpdistill: warning: {warning}", file=sys.stderr, flush=True)
            plan.seconds = estimate_seconds(cfg, plan, split, say)
            print(format_times(plan))
            return 0
        if args.command == "join-teacher":
            return join_teacher(cfg)
        if args.command == "build-base":
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
            from pipeline.models.base import build_base_models, export_base_models

            base = build_base_models(cfg.base_models, seed=cfg.seed)
            print(f"teacher: {base.teacher}\nstudent: {base.student}")
            if args.export:
                print(f"exported: {export_base_models(base, Path(args.export))}")
            return 0
        if args.command == "serve":
            from prefect import serve

            deployment = make_deployment(args.config, args.cron, args.overrides, args.name, args.timezone)
            serve(deployment)
            return 0
    except user_errors() as e:
        print(f"dpdistill: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        message = prefect_server_error(e)
        if message is None:
            raise
        print(f"dpdistill: error: {message}", file=sys.stderr)
        return 2
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `key=value` overrides anywhere on it: argparse gives a positional
    `nargs="*"` only the words before the first option, so `run --config c.yaml a=1 --force
    generation b=2` left b=2 "unrecognized" (issue 37). The rest of the line's key=value words
    join the overrides, in order; an unknown option, or an override given to a command that
    takes none, is still an error."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    late = [word for word in rest if "=" in word and not word.startswith("-")]
    unknown = [word for word in rest if word not in late] + (late if not hasattr(args, "overrides") else [])
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "status":
            return print_status(Path(args.run_dir))
        if args.command == "report":
            return write_run_report(Path(args.run_dir))
        if args.command == "ledger":
            return show_ledger(Path(args.run_dir))
    except DamagedFileError as e:
        print(f"dpdistill: error: {e}", file=sys.stderr)
        return 2
    if args.command == "audit":
        return run_audit(args)
    if args.command == "models":
        quiet_libraries()
        return run_models(args)
    return run_pipeline(args)


if __name__ == "__main__":
    sys.exit(main())
