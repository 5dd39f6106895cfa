"""The two sides of the torchrun process boundary for a data-parallel stage (teacher.processes > 1).

`launch` (called by pipeline/stages/teacher/recipe.py) writes the job's arguments to `<work>/args.json`
(paths and config only, never private text on a command line) and runs

    python -m torch.distributed.run --standalone --nproc_per_node=<processes> -m pipeline.stages.teacher.ddp <work>/args.json

Across machines (`Nodes.count` > 1) torchrun meets the other nodes at a c10d rendezvous on node 0
(`--nnodes --rdzv_backend=c10d --rdzv_endpoint`) instead of `--standalone`; each other node runs
`join` (`dpdistill join-teacher`), whose ranks start with no job and receive it from the
launching node's ranks over the process group, so a node needs no path but the shared storage
the job names. The global rank count is what DPDDP and the accountant see: one Poisson draw
over all ranks, noise added once, as on one node.

Each process runs `main`: it joins the process group and calls the job's `target`
("module:function", e.g. pipeline.stages.teacher.recipe:ddp_worker) with the arguments and, on rank 0, an
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
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Nodes:
    """The machines a data-parallel job spans: `count` nodes meet at `endpoint` (host:port on
    node 0, torchrun's c10d rendezvous) under the job id `job_id`, and wait up to `timeout` s
    for one another. count = 1: one machine, torchrun --standalone."""

    count: int = 1
    endpoint: str | None = None
    job_id: str = "dpdistill"
    timeout: int = 900

    @classmethod
    def of(cls, cfg, job_id: str = "dpdistill") -> Nodes:
        """The machines of a data-parallel teacher config (`teacher.nnodes`, `rdzv_endpoint`,
        `rdzv_timeout`): one unless nnodes > 1. Read here, not in the recipe, so that `dpdistill
        join-teacher` makes them without importing the stage."""
        return cls(cfg.nnodes, cfg.rdzv_endpoint, job_id, cfg.rdzv_timeout)

    def torchrun_args(self, processes: int, *, host: bool) -> list[str]:
        """torchrun's options for `processes` ranks on this node; `host`: this node holds the
        rendezvous store (node 0, which runs the flow)."""
        if self.count == 1:
            return ["--standalone", f"--nproc_per_node={processes}"]
        return [f"--nnodes={self.count}", f"--nproc_per_node={processes}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={self.endpoint}", f"--rdzv_id={self.job_id}",
                f"--rdzv_conf=is_host={int(host)},join_timeout={self.timeout},read_timeout={self.timeout}"]


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
    nodes: Nodes = Nodes(),
) -> None:
    """Run `target(args, on_progress)` in `processes` ranks under torchrun and wait; a failed
    job raises `error` with the end of rank 0's log. `threads`: CPU threads of each rank
    (OMP_NUM_THREADS; None: the cores shared out); the target applies its own as well.
    `nodes`: with count > 1 this node is node 0 and the others `join` (their ranks count in
    the world, `processes` is this node's share); `work` must be on storage they all mount."""
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
    atomic_write_json(work / "args.json", {"target": target, "backend": backend, "args": args,
                                           "work": str(work.resolve())})
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_args(processes, host=True),
           "-m", "pipeline.stages.teacher.ddp", str(work / "args.json")]
    env = _rank_env(processes, threads)
    log.info("%s: data-parallel over %d processes (%s): %s", stage, processes, backend, " ".join(cmd))
    if nodes.count > 1:
        log.info("%s: waiting up to %d s for %d more node(s) at %s: run `dpdistill join-teacher --config <this "
                 "config> teacher.node_rank=<1..%d>` on each", stage, nodes.timeout, nodes.count - 1, nodes.endpoint,
                 nodes.count - 1)
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
        where = f"{processes} processes" if nodes.count == 1 else f"{nodes.count} nodes, {processes} processes here"
        raise error(
            f"{stage}: the data-parallel job (torchrun, {where}) failed with exit code "
            f"{proc.returncode}; rank {rank}'s log ({rank_log}) ends with:\n{_tail(rank_log)}\n"
            f"(all processes: {work / 'torchrun.log'})"
        )


def _rank_env(processes: int, threads: int | None) -> dict[str, str]:
    """The ranks' environment: the cores shared out instead of every process using all of them."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads or max(1, (os.cpu_count() or 1) // processes))}


def join(*, processes: int, backend: str, nodes: Nodes, threads: int | None = None) -> int:
    """Run this node's `processes` ranks of a job that node 0 launches (`launch` with the same
    `nodes`), in the foreground: torchrun's output on this terminal, its exit code returned.
    The job (target, arguments, work directory) arrives from node 0's ranks."""
    if nodes.count < 2:
        raise ValueError("joining needs a job across nodes: set teacher.nnodes > 1 and teacher.rdzv_endpoint")
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_args(processes, host=False),
           "-m", "pipeline.stages.teacher.ddp", "--join", backend]
    log.info("joining the data-parallel job %s at %s with %d process(es) (%s), waiting up to %d s: %s",
             nodes.job_id, nodes.endpoint, processes, backend, nodes.timeout, " ".join(cmd))
    return subprocess.run(cmd, env=_rank_env(processes, threads)).returncode


def _job(argv: list[str]) -> dict | None:
    """The job of a launching node's rank (its args.json), None on a joining node's."""
    if argv[0] == "--join":
        return None
    return {"work": str(Path(argv[0]).parent), **json.loads(Path(argv[0]).read_text())}


JOINABLE = {"pipeline.stages.teacher.recipe:ddp_worker"}  # the only targets a joining node runs


def _shared_job(job: dict | None) -> dict:
    """Across nodes, every rank gets the job from the launching node's ranks (all-gather: the
    launching node need not hold global rank 0). A launching rank keeps its own; a joining rank
    runs only a JOINABLE target (whoever reaches the rendezvous could offer another)."""
    jobs: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(jobs, job)
    return _adopt(job, jobs)


def _adopt(own: dict | None, gathered: list[dict | None]) -> dict:
    if own is not None:
        return own
    job = next(j for j in gathered if j is not None)
    if job.get("target") not in JOINABLE:
        raise ValueError(f"refusing to join a job whose target is {job.get('target')!r}: a joining node runs "
                         f"only {sorted(JOINABLE)}")
    return job


def _check_shared_storage(job: dict) -> None:
    """Every rank checks it sees the job's work directory and data; all fail together (naming
    each rank, host and path it misses) rather than leave the others waiting in a collective."""
    paths = [job["work"], *(v for k, v in job["args"].items() if k.endswith("_path") and v)]
    missing = [p for p in paths if not Path(p).exists()]
    mine = f"rank {dist.get_rank()} on {socket.gethostname()} cannot see {', '.join(missing)}" if missing else None
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if problems := [m for m in every if m]:
        raise FileNotFoundError("; ".join(problems) + ": a teacher across nodes needs the run directory and the "
                                "data on storage that every node mounts at the same path")


def main(argv: list[str] | None = None) -> None:
    """One torchrun process: join the group, (across nodes: receive the job), run the target on
    this rank, leave the group."""
    argv = argv if argv is not None else sys.argv[1:]
    job = _job(argv)
    backend = argv[1] if job is None else job["backend"]
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    fmt = f"%(asctime)s | rank {rank} %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=fmt, force=True)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    if nodes > 1:
        job = _shared_job(job)
    work = Path(job["work"])
    if work.is_dir():  # else the storage check below fails, on this terminal
        file_log = logging.FileHandler(work / f"rank{rank}.log")
        file_log.setFormatter(logging.Formatter(fmt))
        logging.getLogger().addHandler(file_log)
    on_progress = None
    if rank == 0:
        def on_progress(record: dict) -> None:  # the target's progress records (public quantities only)
            with open(work / PROGRESS, "a") as f:
                f.write(json.dumps(record) + "\n")

    module, function = job["target"].split(":")
    try:
        if nodes > 1:
            _check_shared_storage(job)
        getattr(importlib.import_module(module), function)(job["args"], on_progress)
    except BaseException:
        logging.getLogger(__name__).exception("rank %d failed", rank)  # FileHandler flushes each record
        if work.is_dir():
            _record_failure(work, rank)
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
