"""Run directories: where a run writes, and which earlier run it continues.

A run directory is made new (named after the config and the time), named by the caller
(checked to be under run_root and ours), or an interrupted run's, continued. Every one is
locked by the process writing it for the whole flow (flows.run_info.RUN_LOCK), 0700, under a
0700 run_root that nobody else can write.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import stat
import time
from pathlib import Path

from flows.caching import RESULTS_DIR
from flows.run_info import RUN_INFO, RUN_LOCK, TOOL, RunDirError, read_run_info
from pipeline.config import PipelineConfig, dump_config
from pipeline.locks import try_lock, unlock
from pipeline.manifest import private_dir


def prepare_run_root(cfg: PipelineConfig) -> Path:
    """`run_root` and its cache, 0700: they hold private splits, DP checkpoints, results."""
    root = Path(cfg.run_root)
    if root.is_dir():
        # Never chmod a shared directory (/tmp) or someone else's: others could write there.
        st = root.stat()
        if st.st_uid != os.geteuid() or st.st_mode & stat.S_ISVTX:
            raise RunDirError(
                f"run_root {root} is shared or not yours (owner or sticky bit); set run_root to a "
                "directory only you use, e.g. runs"
            )
    root = private_dir(root).resolve()
    private_dir(root / ".cache")
    private_dir(root / RESULTS_DIR)
    return root


def new_run_dir(cfg: PipelineConfig) -> Path:
    """A new, empty run directory named after the config and the time. Two runs started in
    the same second get `-2`, `-3`...: `mkdir` either creates the name or fails, atomically,
    so no two processes ever get the same directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    Path(cfg.run_root).mkdir(mode=0o700, parents=True, exist_ok=True)
    for n in itertools.count(1):
        run_dir = cfg.run_root / (f"{cfg.name}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            run_dir.mkdir(mode=0o700)
        except FileExistsError:
            continue
        return private_dir(run_dir).resolve()
    raise AssertionError("unreachable")


def checked_run_dir(cfg: PipelineConfig, run_dir: str | Path) -> Path:
    """The run directory a caller names, if the flow may write (and `--force` delete) there:
    inside `run_root`, and either new, empty, or a run directory dpdistill made."""
    root, out = Path(cfg.run_root).resolve(), Path(run_dir).resolve()
    if out == root or not out.is_relative_to(root):
        raise RunDirError(
            f"run directory {out} is not inside run_root {root}: pass a directory under run_root, "
            "or set run_root to where your run directories live"
        )
    if out.exists() and not out.is_dir():
        raise RunDirError(f"run directory {out} exists and is not a directory; pass a new directory")
    if out.is_dir() and any(p.name != RUN_LOCK for p in out.iterdir()) and read_run_info(out).get("tool") != TOOL:
        raise RunDirError(
            f"{out} is not empty and holds no {RUN_INFO} written by dpdistill, so it is not a run "
            "directory this flow may write into (a forced stage deletes its folder there); pass a "
            "new or empty directory under run_root"
        )
    return out


def find_interrupted_run(cfg: PipelineConfig, flow_run_id: str | None) -> tuple[Path, str, int] | None:
    """The run directory to continue, if any, with its lock taken (the lock's descriptor
    third): the one this very flow run wrote before (a retry from the UI), else the newest
    run with the same config that no live process holds, if it was killed or failed.

    A directory whose lock is held belongs to a live run and is skipped, never shared. The
    lock is taken before run.json is trusted: the run may have finished in between."""
    wanted = config_sha(cfg)
    runs = []
    for info_path in Path(cfg.run_root).glob(f"{cfg.name}-*/{RUN_INFO}"):
        try:
            runs.append((info_path.stat().st_mtime, info_path.parent, json.loads(info_path.read_text())))
        except (OSError, json.JSONDecodeError):
            continue
    runs.sort(key=lambda r: r[0], reverse=True)
    retried = [path for _, path, info in runs if flow_run_id and info.get("flow_run_id") == flow_run_id]
    same = [path for _, path, info in runs if info.get("config_sha256") == wanted]
    for path, retry in [(p, True) for p in retried] + [(p, False) for p in same]:
        fd = try_lock(path / RUN_LOCK)
        if fd is None:
            continue  # a live run is writing it
        status = read_run_info(path).get("status")  # read again, now that nobody else can write it
        if retry:
            return path.resolve(), "a retry of the same flow run", fd
        if status in ("failed", "interrupted", "running"):  # "running" with its lock free: its process was killed
            return path.resolve(), f"the newest run with this config was {'killed' if status == 'running' else status}", fd
        unlock(fd)
        return None  # the newest run with this config completed: start a new one
    return None


def claim_run_dir(cfg: PipelineConfig, run_dir: str | Path | None, flow_run_id: str | None) -> tuple[Path, int, str | None]:
    """The run directory this flow writes, locked for this process: (path, the lock's
    descriptor, why an earlier run is continued or None). `run_dir` named by the caller
    must not be in use by another process; unnamed, an interrupted run no live process
    holds is continued, else a new directory is made."""
    if run_dir:
        out = checked_run_dir(cfg, run_dir)
        private_dir(out)
        fd = try_lock(out / RUN_LOCK)
        if fd is None:
            raise RunDirError(
                f"run directory {out} is in use by another dpdistill run (its {RUN_LOCK} is locked); "
                "wait for that run to finish, or pass another --run-dir (or none: a new one is made)"
            )
        return out, fd, None
    if found := find_interrupted_run(cfg, flow_run_id):
        out, why, fd = found
        return out, fd, why
    out = new_run_dir(cfg)
    fd = try_lock(out / RUN_LOCK)
    assert fd is not None, "a directory this process just made is locked by another"
    return out, fd, None


def config_sha(cfg: PipelineConfig) -> str:
    """The resolved config's sha256: a run continues only an interrupted run of the same config."""
    return hashlib.sha256(dump_config(cfg).encode()).hexdigest()
