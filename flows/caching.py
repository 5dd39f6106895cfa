"""Cache keys for the stage tasks, and the checks that make a cache hit trustworthy.

A stage's key hashes what its output depends on and nothing else: the stage name, the
config it reads (resolved, so defaults count), the manifests of the stages it reads from
(the sha256 of their outputs, not their paths), the package version and the seed. The run
directory is not part of it, so a second run with the same config reuses the stages an
earlier run finished, wherever they live, and a changed config reruns only the stages whose
key changed: their own, or one upstream of them.

Prefect stores each stage's small result (paths and summaries, never a record) under its
key in `run_root/.cache/prefect-results`, as JSON of our result types only: a record in any
other form (a planted pickle) is refused unread and the stage runs again (flows/results.py).
A hit is only trusted after the files its manifest names are found unchanged
(`stale_reason`); otherwise the stage runs again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, is_dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import prefect.main  # noqa: F401  (before pipeline.* imports Opacus: see flows/__init__.py)
from prefect.cache_policies import CachePolicy
from pydantic import BaseModel

from flows.run_info import STAGES, stages_to_rerun  # noqa: F401 (re-exported)
from pipeline.privacy.control_codes import CodesResult
from pipeline.config import PipelineConfig
from pipeline.stages.data import DataResult, deleted_as_recorded
from pipeline.stages.distill import DistillResult
from pipeline.stages.generate import GenerateResult
from pipeline.manifest import manifest_digest, manifest_problems
from pipeline.models.base import BaseModels
from pipeline.stages.teacher.state import TeacherResult

# Where each stage writes inside a run directory (base models live in their own cache).
STAGE_DIRS = {
    "base-models": "base_models",  # only a pair with a DP vocabulary is built in the run directory
    "data": "data", "control-codes": "control_codes", "teacher": "teacher", "dp-student": "student",
    "generation": "synthetic", "distillation": "student", "evaluation": "evaluation",
}
RESULTS_DIR = Path(".cache") / "prefect-results"
# One flock file per cache key, held while a run computes that entry (pipeline/locks.py).
# Not Prefect's SERIALIZABLE isolation: its FileSystemLockManager marks a lock by a file's
# existence, with no expiry unless a hold timeout is set (the task engine sets none), so a
# run killed mid-stage would leave every later run waiting forever; flock dies with it.
CACHE_LOCKS = Path(".cache") / "locks"
PERPLEXITY_DIR = Path(".cache") / "perplexity"  # models' test perplexities (pipeline/stages/evaluate.py)

try:
    VERSION = version("dpdistill")
except PackageNotFoundError:  # running from a checkout that is not installed
    VERSION = "unknown"




def stage_dir_of(result: Any) -> Path | None:
    """The directory holding a stage result's manifest (None for results without files)."""
    if isinstance(result, BaseModels):
        return Path(result.teacher).parent
    if isinstance(result, DataResult):
        return Path(result.train).parent
    if isinstance(result, CodesResult):
        return Path(result.path).parent
    if isinstance(result, (TeacherResult, DistillResult)):
        return Path(result.checkpoint).parent
    if isinstance(result, GenerateResult):
        return Path(result.path)
    if isinstance(result, dict) and "evaluation_dir" in result:
        return Path(result["evaluation_dir"])
    return None


def stale_reason(result: Any) -> str | None:
    """Why a cached result cannot be reused (its files are gone or changed), else None."""
    stage_dir = stage_dir_of(result)
    if stage_dir is None:
        return None
    problems = manifest_problems(stage_dir)
    return "; ".join(problems[:3]) if problems else None


def deleted_after_evaluation(result: Any) -> bool:
    """Whether a cached data stage is stale only because its run deleted its private splits after
    evaluation, as it recorded (data.keep_private_copies=false, the default): the expected event
    of every rerun, not damage. Any other missing or changed file is not this."""
    return isinstance(result, DataResult) and deleted_as_recorded(Path(result.train).parent)


def _describe(value: Any) -> Any:
    """A stable, hashable description of one task input."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    stage_dir = stage_dir_of(value)
    if stage_dir is not None:
        return {"manifest": manifest_digest(stage_dir)}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if is_dataclass(value):
        raise TypeError(f"no cache description for {type(value).__name__}: add it to flows.caching.stage_dir_of")
    raise TypeError(f"cannot describe a {type(value).__name__} for a cache key")


def stage_key(stage: str, config: dict, inputs: dict[str, Any], seed: int) -> str:
    spec = {
        "stage": stage,
        "version": VERSION,
        "seed": seed,
        "config": _describe(config),
        "inputs": {name: _describe(v) for name, v in sorted(inputs.items())},
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    return f"{stage}-{digest[:32]}"


@dataclass
class StageCache(CachePolicy):
    """Prefect cache policy of one stage: `config_of(cfg)` names the config the stage reads;
    every task argument but `cfg`, `run_dir`, `plan` and `ahead` (where the data stage's split was
    made ahead, pipeline/split_ahead.py) is an input (results count by manifest).
    `optional` inputs count only when not None: an input added after results were cached
    leaves their keys unchanged where it is unused.

    The run's plan (pipeline/plan.py, an argument `plan`) follows from the config and the data,
    both in the key already; `planned(plan)` names the inputs a stage's key keeps of it: a DP-SGD
    stage's share of the budget, as "epsilon", the argument that carried it before the plan did,
    so that results cached then stay hits."""

    stage: str = ""
    config_of: Callable[[PipelineConfig], dict] | None = None
    optional: tuple[str, ...] = ()
    planned: Callable[[Any], dict] | None = None

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs) -> str:
        cfg: PipelineConfig = inputs["cfg"]
        others = {k: v for k, v in inputs.items()
                  if k not in ("cfg", "run_dir", "plan", "ahead") and not (k in self.optional and v is None)}
        if self.planned is not None:
            others |= self.planned(inputs["plan"])
        return stage_key(self.stage, self.config_of(cfg) if self.config_of else {}, others, cfg.seed)
