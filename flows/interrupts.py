"""Ctrl-C and SIGTERM stop `dpdistill run` within seconds and leave a run to continue.

    with Interrupts() as interrupts:   # in the CLI, around the flow (main thread)
        ...
    # on SIGINT/SIGTERM: run.json says "interrupted", child processes are gone, the last
    # line says how to continue, and the exit code is 130 (SIGINT) or 143 (SIGTERM).

Why not just let the exception unwind: Ctrl-C (and `kill` of a process group) signals
the temporary Prefect server too, which stops at once; Prefect then spends minutes
retrying to report the crash to it, printing `httpx.ConnectError` tracebacks. So the
signal is also seen by a watcher thread (through `signal.set_wakeup_fd`, which works
whichever Python handler is installed: during a flow Prefect installs its own SIGTERM
handler, which raises `TerminationSignal`). The watcher mutes the terminal (run.log keeps
everything) and gives the main thread `GRACE_S` seconds to unwind: the flow's `except`
marks run.json, the data-parallel teacher stops torchrun, and a live Prefect server
records the flow run as crashed. After that, or at a second signal, it finishes the run
itself: run.json marked, every child process (temporary server, Dask workers, torchrun
and its ranks) terminated, then killed, one line, `os._exit`.

A signal can also meet the main thread inside a call whose exceptions Python can only
report (a `__del__`, a weakref callback, C code that calls back into Python): Python hands
that exception to `sys.unraisablehook`, which printed it on the terminal before the watcher
muted it. While a run is on, a signal's exception reported that way goes to run.log only,
and the watcher ends the run as for a flow that did not unwind.

The run resumes like a killed one: finished stages are cached, the teacher continues from
its last checkpoint (flows/pipeline_flow.py `find_interrupted_run`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

import psutil
from prefect.exceptions import TerminationSignal

from flows.run_info import mark_stopped
from flows.run_log import latest_run_dir, mute_terminal

GRACE_S = 4.0  # for the flow to unwind; with KILL_WAIT_S the whole stop stays well under 10 s
KILL_WAIT_S = 1.0  # for children to exit after SIGTERM before SIGKILL
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by our handler (outside Prefect's SIGTERM handler)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal = signum


def exit_code(signum: int) -> int:
    return 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


def stop_children(wait_s: float = KILL_WAIT_S) -> None:
    """Terminate every descendant process (SIGTERM), then kill the ones still there."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=wait_s)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=wait_s)


class Interrupts:
    """SIGINT/SIGTERM handling for one `dpdistill run` (see the module docstring)."""

    def __init__(self, grace_s: float = GRACE_S):
        self.grace_s = grace_s
        self.signum: int | None = None
        self._raised = False
        self._finished = threading.Lock()
        self._on_exit: list = []

    def __enter__(self) -> "Interrupts":
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)  # set_wakeup_fd needs a non-blocking fd
        self._old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._raise) for s in SIGNALS}
        self._old_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        threading.Thread(target=self._watch, name="dpdistill-interrupts", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._old_fd)
        sys.unraisablehook = self._old_hook
        self._write.close()  # ends the watcher

    def on_exit(self, call) -> None:
        """Have `finish` call `call()` before it ends the process: what a `finally` would do (delete
        private files) where the main thread did not unwind in time."""
        self._on_exit.append(call)

    def _raise(self, signum: int, frame) -> None:
        # The first signal unwinds the main thread; a second one is the watcher's to handle,
        # so that it does not break the unwinding halfway.
        if not self._raised:
            self._raised = True
            raise Interrupted(signum)

    def _unraisable(self, report) -> None:
        # In the main thread, at once: the watcher may not have muted the terminal yet.
        if self.signum is None and not isinstance(report.exc_value, (KeyboardInterrupt, TerminationSignal)):
            self._old_hook(report)
            return
        mute_terminal()
        logging.getLogger(__name__).warning(
            "%s: %r", report.err_msg or "Exception ignored in", report.object,
            exc_info=(report.exc_type, report.exc_value, report.exc_traceback))

    def _watch(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum not in SIGNALS:
                    continue
                if self.signum is None:
                    self.signum = signum
                    mute_terminal()  # Prefect's crash reports and retries go to run.log only
                    threading.Timer(self.grace_s, self.finish).start()
                else:
                    self.finish()  # a second signal: stop now

    def finish(self, signum: int | None = None) -> None:
        """Mark the run interrupted, stop the children, print the last line, exit. Called by
        the CLI when the flow has unwound, or by the watcher when it did not in time."""
        if not self._finished.acquire(blocking=False):
            threading.Event().wait()  # the other thread is finishing; it ends the process
        signum = self.signum or signum or signal.SIGINT
        name = signal.Signals(signum).name
        run_dir = latest_run_dir()
        if run_dir is not None:
            # Unless the flow already did. "failed" too: killing the process group stops the
            # temporary Prefect server as well, and under load the flow may first see that
            # server gone (an error, not the signal) and mark the run failed; the signal is why.
            mark_stopped(run_dir, "interrupted", f"stopped by {name}", replacing=("running", "failed"))
        mute_terminal()
        stop_children()
        for call in self._on_exit:
            call()
        where = f" {run_dir}" if run_dir is not None else ""
        line = (f"dpdistill: interrupted ({name}); run the same command again to continue{where}"
                + (f" (log: {run_dir / 'run.log'})" if run_dir is not None else ""))
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        os._exit(exit_code(signum))
