"""`dpdistill run`, `serve`, `build-base` and `join-teacher`: the commands that run the pipeline,
and the checks of config, inputs and models before them (and before `plan`, flows/cli_plan.py);
each user error is one line.

    dpdistill run --config configs/demo.yaml [key=value ...]   # the whole pipeline, as a Prefect flow
    dpdistill serve --config C --cron "0 3 * * *"              # a scheduled deployment

Light at import, like flows/cli.py: torch, transformers, Opacus and Prefect load in the handlers,
after the config and the inputs are checked (issue 10).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import warnings
from pathlib import Path

from flows.cli_plan import run_plan
from flows.run_info import RunDirError, stages_to_rerun
from pipeline.config import ConfigError, load_config

EPHEMERAL_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that carry a message for the user. Most live beside torch code, so only
    the commands that run the pipeline call this."""
    from pipeline.records import DataError
    from pipeline.stages.distill import DistillError
    from pipeline.stages.generate import GenerateError
    from pipeline.models.base import ModelError
    from pipeline.privacy.dpsgd import TeacherError

    return (ConfigError, DataError, TeacherError, GenerateError, DistillError, ModelError, RunDirError)


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
    from pipeline.devices import Runtime  # torch; the stage (Opacus, transformers) loads in the ranks only
    from pipeline.stages.teacher import ddp as teacher_ddp

    return teacher_ddp.join(processes=t.processes, backend=t.ddp_backend, nodes=teacher_ddp.Nodes.of(t),
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
    if args.command != "join-teacher":  # its ranks, not this process, load the libraries
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
            return run_plan(cfg)
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
