"""The data stage's split made ahead of a run, for its plan, then moved into the run by the data stage.

    with split_ahead(cfg.data, root, cfg.control_codes.domain, sources) as ahead:  # root: prepare_run_root's
        plan = make_plan(cfg, split=ahead.planned)
        ...  # the data stage: adopt(ahead.path, run_dir / "data", ...), or its own split if None

A run needs its split before anything starts: the plan takes N, the validation units and the test
records' lengths from it, and reading every row first makes a bad record one line before any
server starts (issue 10). The data stage then writes the same split into the run directory. Made
here, once (issue 61: a split took 183 s at 10 M records, and a run made three), in a private
directory under the run root with the run root's split key, it is what the data stage would
write; the stage moves it into place (`adopt`) when it was made from the same data config,
control-code domain, input files (sha256) and key, and otherwise splits as before. Where it was
made enters no cache key.

The directory holds private records. It is deleted on every way out of the `with` (an error, a
signal's exception); one left by a process killed outright (SIGKILL: no way out runs) is deleted
by the next `split_ahead` under the run root, which finds its lock free (the kernel drops a flock
when its process dies, pipeline/locks.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import DataConfig
from pipeline.manifest import atomic_write_json, move_stage, sha256_file
from pipeline.records import split_key
from pipeline.stages.data import DELETED, DataResult, PlannedSplit, prepare_data, read_planned

log = logging.getLogger(__name__)

PREFIX = "split-ahead-"  # under run_root/.cache
MADE = "made.json"  # in the directory: what the split was made from


@dataclass(frozen=True)
class SplitAhead:
    path: Path
    """The private directory: data/ as the data stage writes it (manifest last) and made.json."""
    planned: PlannedSplit


def input_hashes(cfg: DataConfig) -> dict[str, str]:
    """sha256 of the private input files: a changed file is another split, and reruns the data
    stage (its cache key holds these, flows/tasks.py)."""
    paths = {"path": cfg.path, "test_path": cfg.test_path}
    return {name: sha256_file(Path(p)) for name, p in paths.items() if p is not None and Path(p).is_file()}


def _made_from(cfg: DataConfig, code_domain: dict | None, sources: dict[str, str], key: bytes) -> dict:
    """What decides the split, as JSON values (made.json's); the key by its sha256 only."""
    return json.loads(json.dumps({
        "data": cfg.model_dump(mode="json", exclude={"keep_private_copies"}), "domain": code_domain,
        "sources": sources, "key_sha256": hashlib.sha256(key).hexdigest(),
    }))


@contextmanager
def split_ahead(cfg: DataConfig, run_root: Path, code_domain: dict[str, list[str]] | None,
                sources: dict[str, str]) -> Iterator[SplitAhead]:
    """The data stage's split, made now in `run_root/.cache` with the run root's split key (made
    here by the first run under the root, as its data stage would) from the input files whose
    sha256 are `sources` (hashed before the split reads them); deleted on the way out."""
    key = split_key(Path(run_root))
    cache = Path(run_root) / ".cache"
    _delete_abandoned(cache)
    path, fd = _locked_dir(cache)
    try:
        result = prepare_data(cfg, path / "data", code_domain, key)
        atomic_write_json(path / MADE, _made_from(cfg, code_domain, sources, key))
        yield SplitAhead(path, read_planned(result))
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def adopt(ahead: Path, out_dir: Path, cfg: DataConfig, code_domain: dict[str, list[str]] | None,
          sources: dict[str, str], key: bytes) -> DataResult | None:
    """The split made ahead in `ahead`, moved to `out_dir` (the data stage's directory) with its
    manifest, when it was made from this config, domain, input files (`sources`) and key; None
    otherwise, and the stage splits as before."""
    made = Path(ahead) / MADE
    try:
        if json.loads(made.read_text()) != _made_from(cfg, code_domain, sources, key):
            return None
    except FileNotFoundError:  # not made (an error) or moved already
        return None
    made.unlink()
    (Path(out_dir) / DELETED).unlink(missing_ok=True)  # as prepare_data: the splits are here again
    manifest = json.loads(move_stage(Path(ahead) / "data", Path(out_dir)).read_text())
    train, validation, test = (Path(manifest["outputs"][name]["path"]) for name in ("train", "validation", "test"))
    result = DataResult(train=train, validation=validation, test=test, n_train=manifest["n_train"],
                        n_validation=manifest["n_validation"], n_test=manifest["n_test"],
                        n_dropped=manifest["n_dropped"])
    log.info("data: %d train, %d validation, %d test records, %d dropped (the split made for the run's plan, "
             "moved here)", result.n_train, result.n_validation, result.n_test, result.n_dropped)
    return result


def _locked_dir(cache: Path) -> tuple[Path, int]:
    """A new private directory `cache/split-ahead-*` and the descriptor of its flock, taken before
    the directory bears that name: `_delete_abandoned` never finds it unlocked while in use."""
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix="." + PREFIX, dir=cache))  # 0700
    fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # its name is ours alone yet: never waits
        path = cache / new.name.removeprefix(".")
        os.rename(new, path)
    except BaseException:
        os.close(fd)
        shutil.rmtree(new, ignore_errors=True)
        raise
    return path, fd


def _delete_abandoned(cache: Path) -> None:
    """Delete the split-ahead directories whose process died holding them (their lock is free)."""
    for path in cache.glob(PREFIX + "*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live run's
        else:
            shutil.rmtree(path, ignore_errors=True)
            log.info("data: deleted %s, a split left by a run that was killed", path)
        finally:
            os.close(fd)
