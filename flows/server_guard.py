"""The temporary Prefect server, ended when the process that started it is gone.

Prefect starts its temporary API server (uvicorn) as a child process and stops it when the run
ends. A run killed outright (the kernel's OOM killer, `kill -9`) never stops it: the server lived
on, an orphan polling its database at a few per cent of a core, one more after every such
crash (three on our machines after one morning of killed study runs). `flows.run_log.route_server_output`
starts the server through this module instead of `python -m uvicorn`:

    python -m flows.server_guard PARENT_PID [uvicorn's arguments ...]

It runs uvicorn in this process, as `python -m uvicorn` would, with a thread that checks once a
second whether PARENT_PID is still its parent; once it is not, the server gets SIGTERM (uvicorn's
own graceful shutdown), and is ended outright if it has not exited 10 s later. Parent-death
signals (prctl) would need code in the forked child before exec, which is unsafe in a process
with threads, and Linux only; polling is neither.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

POLL_SECONDS = 1.0
GRACE_SECONDS = 10.0


def watch(parent: int) -> None:
    """End this process once `parent` is no longer its parent (it died; init or a subreaper adopted us)."""
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os._exit(1)


def main() -> None:
    parent = int(sys.argv[1])
    threading.Thread(target=watch, args=(parent,), name="parent-watch", daemon=True).start()
    sys.argv = ["uvicorn", *sys.argv[2:]]
    runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
