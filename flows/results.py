"""Stage results persisted by Prefect as plain JSON, and refused in any other form.

Prefect keeps each stage's result under its cache key in `run_root/.cache/prefect-results`
and reads it back on the next run with the same key. By default that file is a cloudpickle,
and `ResultRecord.deserialize` decodes a record with the serializer named *in the file
itself*: whoever can write one file there gets code run by the next run (a `__reduce__`
payload), and so would a record naming Prefect's JSON serializer, which imports any class
or function named in the file (`jsonlib`, `object_decoder`, `__class__` fields).

So both ends are closed here:
- `StageResultSerializer` writes and reads only the result types listed in `RESULT_TYPES`
  (dataclasses and dicts of paths and numbers), through pydantic, never importing a name
  taken from the file;
- `StageResultStorage.read_path` parses the record with the standard `json` module and
  refuses one whose metadata names another serializer, before Prefect decodes anything.
  Prefect treats a refused read as "no cached result": the stage runs again and writes a
  fresh record over the planted one.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import prefect.main  # noqa: F401  (before pipeline.* imports Opacus: see flows/__init__.py)
from prefect.filesystems import LocalFileSystem
from prefect.serializers import Serializer
from pydantic import Field, TypeAdapter

from pipeline.privacy.control_codes import CodesResult
from pipeline.stages.data import DataResult
from pipeline.stages.distill import DistillResult
from pipeline.stages.generate import GenerateResult
from pipeline.models.base import BaseModels
from pipeline.stages.teacher.state import TeacherResult

# Under "prefect." so the warning reaches the console the way Prefect's own messages do.
log = logging.getLogger("prefect.dpdistill.results")

SERIALIZER_TYPE = "dpdistill-stage-json"
# The only types a stage result may have; `dict` is the evaluation's metrics (JSON values).
RESULT_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (BaseModels, DataResult, CodesResult, TeacherResult, GenerateResult, DistillResult)
}


class UntrustedResultError(ValueError):
    """A file in the result cache is not a stage result written by dpdistill."""


def encode_result(obj: Any) -> bytes:
    if obj is None:
        spec = {"type": "none", "value": None}
    elif type(obj) is dict:
        spec = {"type": "dict", "value": obj}
    elif type(obj).__name__ in RESULT_TYPES and type(obj) is RESULT_TYPES[type(obj).__name__]:
        spec = {"type": type(obj).__name__, "value": TypeAdapter(type(obj)).dump_python(obj, mode="json")}
    else:
        raise TypeError(f"{type(obj).__name__} is not a stage result type; add it to flows.results.RESULT_TYPES")
    return json.dumps(spec).encode()  # NaN stays NaN (a teacher without validation split)


def decode_result(blob: bytes) -> Any:
    try:
        spec = json.loads(blob)
        kind, value = spec["type"], spec["value"]
    except (ValueError, TypeError, KeyError) as e:
        raise UntrustedResultError("not a dpdistill stage result (expected JSON {type, value})") from e
    if kind == "none" and value is None:
        return None
    if kind == "dict" and isinstance(value, dict):
        return value
    if kind in RESULT_TYPES:
        return TypeAdapter(RESULT_TYPES[kind]).validate_python(value)
    raise UntrustedResultError(f"stage result of unknown type {kind!r}")


class StageResultSerializer(Serializer):
    """JSON of the stage result types only; nothing in the file chooses code to run."""

    type: str = Field(default=SERIALIZER_TYPE, frozen=True)

    def dumps(self, obj: Any) -> bytes:
        return encode_result(obj)

    def loads(self, blob: bytes) -> Any:
        return decode_result(blob)


def check_record(content: bytes) -> None:
    """Raise unless `content` is a Prefect result record written by `StageResultSerializer`."""
    try:
        record = json.loads(content)
    except ValueError as e:
        raise UntrustedResultError("not a JSON result record") from e
    # `ResultRecord.coerce_old_format` would take a top-level "serializer" over the metadata's.
    if not isinstance(record, dict) or set(record) != {"metadata", "result"}:
        raise UntrustedResultError("not a result record of this version")
    metadata = record["metadata"]
    serializer = metadata.get("serializer") if isinstance(metadata, dict) else None
    if serializer != {"type": SERIALIZER_TYPE}:
        named = serializer.get("type") if isinstance(serializer, dict) else serializer
        raise UntrustedResultError(f"the record names serializer {named!r}, not {SERIALIZER_TYPE!r}")


class StageResultStorage(LocalFileSystem):
    """Local result storage that only hands Prefect records `check_record` accepts, and
    writes them readable by their owner only."""

    _block_type_name = "dpdistill stage results"

    def _checked(self, path: str, content: bytes) -> bytes:
        try:
            check_record(content)
        except UntrustedResultError as e:
            log.warning("refusing the cached stage result %s (%s): the stage runs again", path, e)
            raise
        return content

    def read_path(self, path: str, **_: Any) -> bytes:  # `_sync` from Prefect's sync call
        with open(self._resolve_path(path), "rb") as f:
            return self._checked(path, f.read())

    async def aread_path(self, path: str) -> bytes:
        return self.read_path(path)

    def write_path(self, path: str, content: bytes, **_: Any) -> str:
        target = self._resolve_path(path)
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A temp file (mkstemp: new, 0600) renamed over the record: a run killed mid-write, or
        # a reader in another process, never sees half a record. The rename replaces a planted
        # symlink itself, never the file it points to.
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return str(target)

    async def awrite_path(self, path: str, content: bytes) -> str:
        return self.write_path(path, content)


def stage_result_storage(path: Path) -> StageResultStorage:
    return StageResultStorage(basepath=str(path))
