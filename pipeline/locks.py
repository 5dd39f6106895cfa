"""Locks between dpdistill processes on one machine: flock(2) on a lock file.

Two runs started together meet at three places: a run directory (one process writes it,
for the whole flow), a stage's cache entry (one process computes it, the others wait and
then reuse it) and a dataset's privacy budget (read-modify-write). Each is guarded by an
exclusive flock on a file beside it:

    with file_lock(root / ".cache" / "locks" / f"{key}.lock"):   # waits for the holder
        ...
    fd = try_lock(run_dir / ".lock")   # None when another process holds it
    ...
    unlock(fd)

Why flock and not a file holding a pid: the kernel drops the lock when the holding
process dies, however it dies (SIGKILL, OOM), so a killed run never leaves a stale lock
and nothing needs to tell a dead pid from a reused one. The lock belongs to the open
file, which a child process inherits and would keep alive after its parent died, so the
descriptor is opened close-on-exec: the processes a run starts (Dask generation workers,
DDP ranks) are exec'd and do not hold it.
Lock files are left in place: deleting one while a process waits on it would let a third
process lock a new file of the same name at the same time.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def _open(path: Path) -> int:
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def try_lock(path: Path) -> int | None:
    """Take the lock on `path` if no process holds it: its descriptor (pass it to `unlock`),
    else None. Held until `unlock` or the end of this process."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlock(fd: int) -> None:
    os.close(fd)  # closing the only descriptor of the open file drops its flock


@contextmanager
def file_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the lock on `path` for the `with` block, waiting for another holder first
    (`on_wait` is called once if it has to wait, to say so)."""
    fd = try_lock(path)
    if fd is None:
        if on_wait is not None:
            on_wait()
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks; returns when the holder releases or dies
        except BaseException:
            os.close(fd)
            raise
    try:
        yield
    finally:
        unlock(fd)
