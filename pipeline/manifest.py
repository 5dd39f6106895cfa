"""Atomic file writes and stage manifests.

A stage is finished when its `manifest.json` exists. The manifest is written last,
atomically (temp name, then rename), and lists the sha256 of the stage's inputs and
outputs, so a crash never leaves a stage that looks finished but is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def private_dir(path: Path) -> Path:
    """Create `path` (and its parents) and make it 0700, whatever the umask: run directories
    hold private splits and DP checkpoints that only their owner may read."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def atomic_write_chunks(path: Path, chunks: Iterable[bytes]) -> None:
    """Write `path` whole or not at all (a temporary file renamed over it), 0600 (mkstemp)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_chunks(path, [text.encode()])


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_paths(paths: dict[str, Path]) -> dict[str, dict[str, str]]:
    """sha256 of each file; a directory is expanded to every file below it."""
    out: dict[str, dict[str, str]] = {}
    for name, p in paths.items():
        p = Path(p)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            key = name if f == p else f"{name}/{f.relative_to(p)}"
            out[key] = {"path": str(f), "sha256": sha256_file(f)}
    return out


def write_manifest(
    stage_dir: Path,
    *,
    stage: str,
    inputs: dict[str, Path],
    outputs: dict[str, Path],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `stage_dir/manifest.json` last: the mark that the stage is done."""
    manifest = {
        "stage": stage,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "inputs": hash_paths(inputs),
        "outputs": hash_paths(outputs),
        **(extra or {}),
    }
    path = Path(stage_dir) / MANIFEST
    atomic_write_json(path, manifest)
    return path


def manifest_problems(stage_dir: Path) -> list[str]:
    """Why `stage_dir` cannot be trusted as finished: no manifest, a damaged one, or an output
    missing or changed since the manifest was written. Empty when every output matches its
    hash. A cached stage with a problem runs again (flows/caching.py `stale_reason`)."""
    return [problem for _, problem in _checked(stage_dir)]


def missing_outputs(stage_dir: Path) -> dict[str, str] | None:
    """The outputs of `stage_dir` that are missing, by name, with the sha256 their manifest
    records, when missing outputs are its only problems; None when it has another (no
    manifest, a damaged one, an output changed)."""
    missing = {}
    for item, _ in _checked(stage_dir):
        if item is None:
            return None
        missing[item[0]] = item[1]
    return missing


def _checked(stage_dir: Path) -> list[tuple[tuple[str, str] | None, str]]:
    """Each problem of `stage_dir` in words, with (output name, recorded sha256) where it is a
    missing output (None for any other problem)."""
    path = Path(stage_dir) / MANIFEST
    if not path.is_file():
        return [(None, f"{path} is missing")]
    try:
        outputs = dict(json.loads(path.read_text())["outputs"])
        items = [(name, Path(item["path"]), item["sha256"]) for name, item in outputs.items()]
    except (ValueError, KeyError, TypeError) as e:  # truncated or edited: JSON, shape or encoding
        return [(None, f"{path} is damaged ({type(e).__name__}), so the stage's outputs cannot be checked")]
    problems = []
    for name, f, sha in items:
        if not f.is_file():
            problems.append(((name, sha), f"{name}: {f} is missing"))
        elif sha256_file(f) != sha:
            problems.append((None, f"{name}: {f} changed since its manifest was written"))
    return problems


def manifest_digest(stage_dir: Path) -> str:
    """One hash of a finished stage's outputs (their sha256s, not their paths or times)."""
    outputs = json.loads((Path(stage_dir) / MANIFEST).read_text())["outputs"]
    digests = sorted((name, item["sha256"]) for name, item in outputs.items())
    return hashlib.sha256(json.dumps(digests).encode()).hexdigest()


def move_stage(src: Path, dst: Path) -> Path:
    """Move a finished stage's outputs from `src` to `dst` (renamed on one file system, copied
    otherwise), then write `dst`'s manifest last: `src`'s, with the outputs' new paths and the
    sha256s it recorded (the same files). A file of `dst` that `src` does not name is left as it is."""
    manifest = json.loads((Path(src) / MANIFEST).read_text())
    (Path(dst) / MANIFEST).unlink(missing_ok=True)  # unfinished until the new one is written
    for item in manifest["outputs"].values():
        f = Path(item["path"])
        target = Path(dst) / f.relative_to(src)
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.move(f, target)
        item["path"] = str(target)
    atomic_write_json(Path(dst) / MANIFEST, manifest)
    return Path(dst) / MANIFEST
