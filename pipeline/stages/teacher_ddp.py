"""The two sides of the torchrun process boundary for a data-parallel stage (teacher.processes > 1).

`launch` (called by pipeline/stages/teacher.py) writes the job's arguments to `<work>/args.json`
(paths and config only, never private text on a command line) and runs

    python -m torch.distributed.run --standalone --nproc_per_node=<processes> -m pipeline.stages.teacher_ddp <work>/args.json

Each process runs `main`: it joins the process group and calls the job's `target`
("module:function", e.g. pipeline.stages.teacher:ddp_worker) with the arguments and, on rank 0, an
`on_progress` that appends to a file. Each rank logs to `<work>/rank<r>.log`; rank 0's log
lines and progress records are relayed to the caller's logger and `on_progress` while the
job runs; when the job fails, the log of the rank that failed first is quoted (`FIRST_FAILURE`).
This module knows nothing of the teacher: it imports the target by name, so the
teacher imports this module and not the other way round.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.manifest import atomic_write_json

log = logging.getLogger(__name__)

WORKDIR = "ddp"
PROGRESS = "progress.jsonl"
FIRST_FAILURE = "first_failure"  # the rank that failed first, once its log holds the error
LOG_TAIL_LINES = 40


class _Tail:
    """New complete lines appended to a file since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def lines(self) -> list[str]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end].decode(errors="replace").splitlines()


def _record_failure(work: Path, rank: int) -> None:
    """Claim `FIRST_FAILURE` for this rank unless another rank has (O_EXCL: exactly one wins).
    Called after the error is logged: whoever reads the file finds that rank's log complete.
    torchrun stops the other ranks when one fails, so rank 0 may be killed before it logs
    anything, and its log alone can be empty (issue 22, seen at load 10)."""
    try:
        with open(work / FIRST_FAILURE, "x") as f:
            f.write(str(rank))
    except FileExistsError:
        pass


def _failed_rank(work: Path) -> int:
    """The rank whose log explains a failed job: the first to fail, else rank 0 (a rank killed
    from outside, by a signal or the OOM killer, records nothing)."""
    try:
        return int((work / FIRST_FAILURE).read_text())
    except (OSError, ValueError):
        return 0


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return "(no log written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def stop_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Stop a process started with start_new_session and its whole process group (torchrun
    and its workers; a test's server and its children): SIGTERM, then SIGKILL after `timeout` s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout)
            return
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def launch(
    args: dict,
    *,
    target: str,
    processes: int,
    backend: str,
    work: Path,
    threads: int | None = None,
    stage: str,
    on_progress: Callable[[dict], None] | None = None,
    error: type[Exception] = RuntimeError,
) -> None:
    """Run `target(args, on_progress)` in `processes` ranks under torchrun and wait; a failed
    job raises `error` with the end of rank 0's log. `threads`: CPU threads of each rank
    (OMP_NUM_THREADS; None: the cores shared out); the target applies its own as well."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        raise error(
            f"{stage}: called inside torchrun without an initialised process group; call "
            "torch.distributed.init_process_group first, or call it outside torchrun with processes > 1"
        )
    if backend == "nccl" and torch.cuda.device_count() < processes:
        raise error(
            f"{stage}: ddp_backend=nccl needs one CUDA device per process ({processes} processes, "
            f"{torch.cuda.device_count()} visible); use ddp_backend=gloo on CPU or fewer processes"
        )
    work.mkdir(parents=True, exist_ok=True)
    for old in [work / PROGRESS, work / FIRST_FAILURE, *work.glob("rank*.log")]:
        old.unlink(missing_ok=True)
    atomic_write_json(work / "args.json", {"target": target, "backend": backend, "args": args})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           "-m", "pipeline.stages.teacher_ddp", str(work / "args.json")]
    # Share the cores out instead of every process using all of them.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads or max(1, (os.cpu_count() or 1) // processes))}
    log.info("%s: data-parallel over %d processes (%s): %s", stage, processes, backend, " ".join(cmd))
    progress, rank0_log = _Tail(work / PROGRESS), _Tail(work / "rank0.log")

    def relay() -> None:
        for line in rank0_log.lines():
            log.info("%s", line.split(" | ", 1)[-1])  # without the file's timestamp
        for line in progress.lines():
            if on_progress:
                on_progress(json.loads(line))

    with open(work / "torchrun.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                relay()
            relay()
        except BaseException:  # on_progress raised, or the caller was interrupted: stop the job too
            stop_group(proc)
            raise
    if proc.returncode != 0:
        rank = _failed_rank(work)
        rank_log = work / f"rank{rank}.log"
        raise error(
            f"{stage}: the data-parallel job (torchrun, {processes} processes) failed with exit code "
            f"{proc.returncode}; rank {rank}'s log ({rank_log}) ends with:\n{_tail(rank_log)}\n"
            f"(all processes: {work / 'torchrun.log'})"
        )


def main(argv: list[str] | None = None) -> None:
    """One torchrun process: join the group, run the target on this rank, leave the group."""
    args_path = Path((argv if argv is not None else sys.argv[1:])[0])
    job = json.loads(args_path.read_text())
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    work = args_path.parent
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s | rank {rank} %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(work / f"rank{rank}.log"), logging.StreamHandler()],
        force=True,
    )
    if job["backend"] == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=job["backend"])
    on_progress = None
    if rank == 0:
        def on_progress(record: dict) -> None:  # the target's progress records (public quantities only)
            with open(work / PROGRESS, "a") as f:
                f.write(json.dumps(record) + "\n")

    module, function = job["target"].split(":")
    try:
        getattr(importlib.import_module(module), function)(job["args"], on_progress)
    except BaseException:
        logging.getLogger(__name__).exception("rank %d failed", rank)  # FileHandler flushes each record
        _record_failure(work, rank)
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
