"""A run's log file, `<run_dir>/run.log`, and a terminal that ends on one clean line.

    with run_log(run_dir):          # in the flow: every log line of the run also goes to run.log
        ...
    quiet_expected_errors(types)    # in the CLI: no traceback on the terminal for a user error

The file receives every record the terminal does (our `pipeline.*` loggers and Prefect's
flow/task run loggers reach the root logger, whose console handler prints them), in the
same format, plus the tracebacks: those of user errors stay out of the terminal (the CLI
prints their message once, last), and the traceback of whatever ended the run is written
to the file only. Log lines never quote a private record (house rule), so the file holds
what the terminal showed; it is 0600 inside the 0700 run directory, and `dpdistill audit`
scans it with the run's other files.

No torch, transformers or Opacus here; Prefect only through the handlers it installed, and
in `route_server_output`, which wraps how Prefect starts its temporary server.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RUN_LOG = "run.log"

# The run directory of this process's latest run: on SIGINT/SIGTERM the CLI marks it
# interrupted when the flow cannot do so itself in time (flows/interrupts.py).
_latest: Path | None = None


def latest_run_dir() -> Path | None:
    return _latest


def _console_handlers() -> list[logging.Handler]:
    """The handlers that print to the terminal: Prefect's console handler on the root logger
    (and on the loggers it configures without propagation, e.g. uvicorn)."""
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in ("uvicorn", "fastapi"))]
    return [h for lg in loggers for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, (logging.FileHandler, _RunLogHandler))]


class _RunLogHandler(logging.StreamHandler):
    """run.log's handler (told apart from the terminal's)."""


class _EarlyLines(logging.Handler):
    """The lines logged before the run directory exists (the plan, the temporary server's
    start), kept in memory, at most `cap`, for the top of run.log (issue 24: run.log lacked
    what the terminal had shown first)."""

    def __init__(self, cap: int = 2000):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.cap = cap

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.cap:
            self.records.append(record)


_early: _EarlyLines | None = None


def keep_early_lines() -> None:
    """From now on, lines logged before `run_log` opens the file are kept for it (the CLI's
    `run` calls this first)."""
    global _early
    if _early is None:
        _early = _EarlyLines()
        logging.getLogger().addHandler(_early)


def _flush_early_lines(handler: logging.Handler) -> None:
    global _early
    if _early is not None:
        logging.getLogger().removeHandler(_early)
        for record in _early.records:
            handler.emit(record)
        _early = None


def _terminal_formatter() -> logging.Formatter:
    """The formatter of the terminal's lines, so that run.log reads the same."""
    for h in _console_handlers():
        if h.formatter is not None:
            return h.formatter
    return logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s")


@contextmanager
def run_log(run_dir: Path) -> Iterator[Path]:
    """Copy every log line of the run into `run_dir/run.log` (appended on a resumed run);
    on an exception, write its traceback there (not on the terminal) and re-raise it with
    `dpdistill_run_log` set to the file, for the CLI's last line."""
    global _latest
    path = Path(run_dir) / RUN_LOG
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)  # also when an older run.log was made with another mode
    handler = _RunLogHandler(os.fdopen(fd, "a", encoding="utf-8"))
    handler.setFormatter(_terminal_formatter())
    root = logging.getLogger()
    root.addHandler(handler)
    _latest = Path(run_dir)
    handler.stream.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} dpdistill (pid {os.getpid()}) ---\n")
    _flush_early_lines(handler)
    try:
        yield path
    except BaseException as e:
        # The file alone gets this traceback; the terminal gets the CLI's one line.
        handler.emit(logging.LogRecord("dpdistill", logging.ERROR, __file__, 0, "the run stopped: %s",
                                       (type(e).__name__,), sys.exc_info()))
        try:
            e.dpdistill_run_log = str(path)
        except AttributeError:  # an exception type with __slots__
            pass
        raise
    finally:
        root.removeHandler(handler)
        handler.close()


# Prefect's failure messages: "Task run encountered an exception DataError: ..." and
# "Flow run encountered an exception: DataError: ..." inside "Finished in state Failed(...)".
_FAILED = re.compile(r"Finished in state Failed\(.*?encountered an exception:? (\w+):", re.DOTALL)


class QuietExpectedErrors(logging.Filter):
    """On the terminal, a user error (a config, data, ... error whose message says what to
    fix) costs one line per failed task or flow run, and no traceback: the CLI prints the
    message itself as the last line. Other exceptions keep their tracebacks.

    Prefect 3.8.8 logs a failed task run three times ("Task run failed with exception: ..."
    with the traceback, "Failed to write result" when the result serializer refuses the
    exception, "Finished in state Failed(...)") and a failed flow run twice ("Encountered
    exception during execution" with the traceback, "Finished in state Failed(...)"); the
    first two kinds are dropped here and the last shortened to the exception's type (a
    shortened copy is printed through `handler`; the record itself, which the other
    handlers also see, is never changed)."""

    def __init__(self, expected: tuple[type[BaseException], ...], handler: logging.Handler):
        super().__init__()
        self.expected, self.handler = expected, handler
        self.names = {t.__name__ for t in expected}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], self.expected):
            return False  # its traceback is in run.log; the CLI prints its message
        if not record.name.startswith("prefect"):
            return True
        msg = record.getMessage()
        if msg.startswith("Failed to write result") and any(f"type '{n}'" in msg for n in self.names):
            return False  # our result serializer refused to store the exception: expected
        match = _FAILED.match(msg)
        if match and match.group(1) in self.names:
            short = logging.makeLogRecord(record.__dict__)
            short.msg, short.args = f"Finished in state Failed ({match.group(1)})", ()
            self.handler.handle(short)  # passes this filter: no "Failed(" in it
            return False
        return True


class _Mute(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def quiet_expected_errors(expected: tuple[type[BaseException], ...]) -> None:
    """Install `QuietExpectedErrors` on the terminal's handlers (not on run.log's)."""
    for h in _console_handlers():
        if not any(isinstance(f, QuietExpectedErrors) for f in h.filters):
            h.addFilter(QuietExpectedErrors(expected, h))


SERVER_LOGGER = "dpdistill.server"


def route_server_output() -> None:
    """The temporary Prefect server's own output (uvicorn's and its services' errors) through
    logging, line by line at the line's own level (logger `dpdistill.server`; lines it cannot
    parse, a traceback's, at the level before them): on the terminal and in run.log like
    every other line, and off the terminal with them after an interrupt. Left to inherit the
    terminal, the server, which a process group's SIGTERM stops too, printed a shutdown
    traceback there past `mute_terminal` (once in a suite run under load:
    tests/flows/test_signals.py).

    Prefect 3.8.8's `SubprocessASGIServer._run_uvicorn_command` starts it with no stdout or
    stderr arguments; this replaces it with the same command, its output piped to a thread,
    run through `flows.server_guard`, which ends the server once this process is gone (a run
    killed outright left it running)."""
    from prefect.server.api import server

    if getattr(server.SubprocessASGIServer, "_dpdistill_routed", False):
        return
    launch = server.SubprocessASGIServer._run_uvicorn_command
    popen = server.subprocess.Popen

    def piped(*args, **kwargs):
        command = list(kwargs.pop("args", None) or args[0])
        args = args[1:] if args else ()
        if command[1:3] == ["-m", "uvicorn"]:  # ended when this process is gone (flows/server_guard.py)
            command[1:3] = ["-m", "flows.server_guard", str(os.getpid())]
            env = dict(kwargs.get("env") or os.environ)  # this checkout's flows, wherever the run was started
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
            kwargs["env"] = env
        proc = popen(command, *args, **kwargs, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     errors="replace")
        threading.Thread(target=_log_lines, args=(proc.stdout,), name="prefect-server-output", daemon=True).start()
        # The thread's alone: Prefect reads `stdout` to EOF when the server does not answer
        # in time, which blocked for as long as the server lived (a run that hung).
        proc.stdout = None
        return proc

    def run_uvicorn_command(self):
        private_prefect_database()  # before the server creates it
        server.subprocess = _WithPopen(piped)  # this module's Popen only, for this call
        try:
            return launch(self)
        finally:
            server.subprocess = subprocess

    server.SubprocessASGIServer._run_uvicorn_command = run_uvicorn_command
    # What it prints, its own PREFECT_SERVER_LOGGING_LEVEL chose (WARNING unless set): pass it all.
    logging.getLogger(SERVER_LOGGER).setLevel(logging.DEBUG)
    server.SubprocessASGIServer._dpdistill_routed = True


def private_prefect_database() -> None:
    """Make the temporary server's SQLite database 0600 (created so if new) and PREFECT_HOME,
    where it lives by default, 0700, whatever the umask. It holds the run's logs, states and
    artifacts, as private as the 0700 run directory; SQLite gave it 0644 under a 0755 home
    (issue 62 item 7). SQLite creates its -wal, -shm and -journal files with the database
    file's mode, so they follow it. A database elsewhere (PREFECT_SERVER_DATABASE_CONNECTION_URL)
    keeps its folder's mode: that folder is the user's choice."""
    from prefect.settings import PREFECT_HOME, PREFECT_SERVER_DATABASE_CONNECTION_URL
    from sqlalchemy.engine import make_url

    from pipeline.manifest import private_dir

    url = make_url(PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
    if not (url.drivername.startswith("sqlite") and url.database and url.database != ":memory:"):
        return  # a database server's own access rules apply
    db, home = Path(url.database).expanduser().resolve(), Path(PREFECT_HOME.value()).expanduser().resolve()
    if db.parent == home:
        private_dir(home)
    db.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(db, os.O_CREAT | os.O_WRONLY, 0o600))  # an empty file is an empty SQLite database
    for path in (db, *(db.with_name(db.name + suffix) for suffix in ("-wal", "-shm", "-journal"))):
        if path.exists():
            os.chmod(path, 0o600)


_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding flows/


class _WithPopen:
    """The subprocess module, with another Popen."""

    def __init__(self, popen):
        self.Popen = popen

    def __getattr__(self, name):
        return getattr(subprocess, name)


# A line of the server's own log ("04:31:02.830 | INFO    | uvicorn.error - ..."); others
# (a traceback's) keep the level of the line before them.
_SERVER_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d+ \| (\w+) *\| (.*)$")


def _log_lines(stream) -> None:
    log, level = logging.getLogger(SERVER_LOGGER), logging.WARNING
    for line in stream:
        text = line.rstrip()
        if m := _SERVER_LINE.match(text):
            level = logging.getLevelName(m[1])
            level, text = (level if isinstance(level, int) else logging.WARNING), m[2]
        if text.strip():
            log.log(level, "Prefect server: %s", text)


def mute_terminal() -> None:
    """Nothing more from logging on the terminal (run.log still gets it): after an interrupt,
    Prefect's crash reports and its attempts to reach a temporary server that is gone."""
    for h in _console_handlers():
        if not any(isinstance(f, _Mute) for f in h.filters):
            h.addFilter(_Mute())
    # Prefect's API log worker writes "--- Error logging to API ---" and the error, with no
    # newline, straight to stderr when it cannot send its queued lines, unless this is off
    # (as the stdlib's handlers do): the temporary server dies with the same signal.
    logging.raiseExceptions = False
