"""The data-parallel teacher's two sides of the process boundary (teacher.processes > 1).

`launch` (called by `train_teacher`) writes the stage's arguments to `out_dir/ddp/args.json`
(paths and config only, never private text on a command line) and runs

    python -m torch.distributed.run --standalone --nproc_per_node=<processes> -m pipeline.teacher_ddp out_dir/ddp/args.json

Each process runs `main`: it joins the process group and calls `train_teacher` again, which
trains data-parallel inside it (see pipeline/teacher.py). Each rank logs to
`out_dir/ddp/rank<r>.log`; rank 0's log lines and step records are relayed to the caller's
logger and `on_progress` while the job runs. The result is read back from the finished
stage with `finished_teacher`, the same TeacherResult as one process would return.
"""

from __future__ import annotations

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

from pipeline.config import TeacherConfig
from pipeline.manifest import atomic_write_json
from pipeline.progress import DEFAULT_EVERY
from pipeline.teacher import KnowledgeDistillation, TeacherError, TeacherResult, finished_teacher, train_teacher

log = logging.getLogger(__name__)

WORKDIR = "ddp"
PROGRESS = "progress.jsonl"
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


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return "(no log written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def _stop(proc: subprocess.Popen) -> None:
    """Stop torchrun and its workers (their own process group); they stop at once or are killed."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def launch(
    cfg: TeacherConfig,
    *,
    train_path: Path,
    validation_path: Path,
    base_model: str,
    out_dir: Path,
    seed: int,
    on_progress: Callable[[dict], None] | None = None,
    stage: str = "teacher",
    kd: KnowledgeDistillation | None = None,
    progress_every: float = DEFAULT_EVERY,
) -> TeacherResult:
    """Run `train_teacher` in `cfg.processes` processes under torchrun; wait; return its result."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        raise TeacherError(
            "train_teacher was called inside torchrun without an initialised process group; call "
            "torch.distributed.init_process_group first, or call it outside torchrun with teacher.processes > 1"
        )
    if cfg.ddp_backend == "nccl" and torch.cuda.device_count() < cfg.processes:
        raise TeacherError(
            f"teacher.ddp_backend=nccl needs one CUDA device per process (teacher.processes={cfg.processes}, "
            f"{torch.cuda.device_count()} visible); use teacher.ddp_backend=gloo on CPU or fewer processes"
        )
    out_dir = Path(out_dir).resolve()
    work = out_dir / WORKDIR
    work.mkdir(parents=True, exist_ok=True)
    for old in [work / PROGRESS, *work.glob("rank*.log")]:
        old.unlink(missing_ok=True)
    args = {
        "config": cfg.model_dump(mode="json"),
        "train_path": str(Path(train_path).resolve()),
        "validation_path": str(Path(validation_path).resolve()),
        "base_model": base_model,
        "out_dir": str(out_dir),
        "seed": seed,
        "stage": stage,
        "progress_every": progress_every,
        "kd": None if kd is None else {"teacher_dir": str(Path(kd.teacher_dir).resolve()), "alpha": kd.alpha,
                                       "temperature": kd.temperature},
    }
    atomic_write_json(work / "args.json", args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.processes}",
           "-m", "pipeline.teacher_ddp", str(work / "args.json")]
    # Share the cores out instead of every process using all of them.
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cfg.processes)), **os.environ}
    log.info("%s: data-parallel over %d processes (%s): %s", stage, cfg.processes, cfg.ddp_backend, " ".join(cmd))
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
            _stop(proc)
            raise
    if proc.returncode != 0:
        raise TeacherError(
            f"{stage}: the data-parallel teacher (torchrun, {cfg.processes} processes) failed with exit code "
            f"{proc.returncode}; rank 0's log ({work / 'rank0.log'}) ends with:\n{_tail(work / 'rank0.log')}\n"
            f"(all processes: {work / 'torchrun.log'})"
        )
    result = finished_teacher(out_dir)
    if result is None:
        raise TeacherError(f"{stage}: torchrun exited cleanly but {out_dir} holds no finished teacher; see {work}")
    return result


def main(argv: list[str] | None = None) -> None:
    """One torchrun process: join the group, train this rank's share, leave the group."""
    args_path = Path((argv if argv is not None else sys.argv[1:])[0])
    args = json.loads(args_path.read_text())
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    work = args_path.parent
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s | rank {rank} %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(work / f"rank{rank}.log"), logging.StreamHandler()],
        force=True,
    )
    cfg = TeacherConfig.model_validate(args["config"])
    if cfg.ddp_backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=cfg.ddp_backend)
    on_progress = None
    if rank == 0:
        def on_progress(record: dict) -> None:  # public quantities only: step, ε, validation loss, seconds
            with open(work / PROGRESS, "a") as f:
                f.write(json.dumps(record) + "\n")

    kd = args["kd"]
    try:
        train_teacher(
            cfg,
            train_path=Path(args["train_path"]),
            validation_path=Path(args["validation_path"]),
            base_model=args["base_model"],
            out_dir=Path(args["out_dir"]),
            seed=args["seed"],
            on_progress=on_progress,
            stage=args["stage"],
            progress_every=args.get("progress_every", DEFAULT_EVERY),
            kd=None if kd is None else KnowledgeDistillation(Path(kd["teacher_dir"]), kd["alpha"], kd["temperature"]),
        )
    except BaseException:
        logging.getLogger(__name__).exception("rank %d failed", rank)
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
