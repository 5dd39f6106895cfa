"""The stage runner: how the flow calls a stage task (flows/tasks.py). Cache hits are verified
against their manifests, forced stages rerun, each stage's status, duration and output is
recorded in `stages.json`, and every DP release is charged to its records' budget across runs
(pipeline/privacy/budget.py)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from prefect import get_run_logger
from prefect.utilities.callables import get_call_parameters

from flows.caching import CACHE_LOCKS, RESULTS_DIR, STAGE_DIRS, deleted_after_evaluation, stage_dir_of, stale_reason
from flows.results import StageResultSerializer, stage_result_storage
from flows.run_info import RUN_INFO, STAGES_INFO, TOOL, RunDirError, read_run_info, stop_reason
from pipeline.config import PipelineConfig
from pipeline.locks import file_lock
from pipeline.manifest import atomic_write_json, manifest_digest
from pipeline.privacy.budget import (dataset_total, read_budget, record_release, records_key, register_records,
                                     split_digests)
from pipeline.privacy.ledger import LedgerEntry
from pipeline.stages.data import DataResult


class StageRunner:
    """Runs stage tasks: cache hits verified against their manifests, forced stages rerun,
    and every stage's status, duration and output directory recorded in `stages.json`.
    Once `use_records` has named the training records, each DP release a stage hands back
    (`charge`) is also charged to their budget across runs (pipeline/privacy/budget.py)."""

    def __init__(self, cfg: PipelineConfig, run_dir: Path, rerun: list[str]):
        self.cfg, self.run_dir, self.rerun = cfg, run_dir, set(rerun)
        self.budget_id: str | None = None
        self.releases: set[str] = set()  # this run's releases (manifest digests)
        # JSON of our result types only, never a pickle (flows/results.py)
        self.storage = stage_result_storage((Path(cfg.run_root) / RESULTS_DIR).resolve())
        info_path = run_dir / STAGES_INFO
        self.stages: dict[str, dict] = json.loads(info_path.read_text()) if info_path.is_file() else {}
        # Stages this run directory already reran by request before it stopped: the same command
        # continues the run, and forcing them again would redo them (a DP stage would train on the
        # private data again and spend a new budget). Their results are reused, their records kept.
        self.forced_before = {s: dict(self.stages[s]) for s in self.rerun
                              if self.stages.get(s, {}).get("status") == "forced"}
        self.rerun -= set(self.forced_before)
        self.log = get_run_logger()

    def use_records(self, data: DataResult) -> str:
        """Name the budget of the training split's records (keyed digests, pipeline/privacy/budget.py)
        and note it in run.json, where `dpdistill ledger show` finds it."""
        root = Path(self.cfg.run_root).resolve()
        self.budget_id = register_records(root, split_digests(data.train, records_key(root)))
        atomic_write_json(self.run_dir / RUN_INFO, read_run_info(self.run_dir) | {"records_id": self.budget_id})
        return self.budget_id

    def _record_release(self, stage: str, result, entry: LedgerEntry, part: str = "") -> None:
        """Add this DP release to the dataset's budget; warn when it raises the total that
        earlier runs had spent on the same data. `part` names a second release of the same
        stage run (its validation loss, teacher.monitor=dp), identified by its manifest too."""
        root, sha = Path(self.cfg.run_root).resolve(), self.budget_id
        release_id = manifest_digest(stage_dir_of(result)) + part
        before = read_budget(root, sha)
        earlier = [r for r in before.releases if r.release_id not in self.releases | {release_id}]
        budget, new = record_release(root, sha, release_id=release_id, stage=stage, run_dir=self.run_dir, entry=entry)
        self.releases.add(release_id)
        # At the δ the budget's first release fixed, whatever this run's (issue 38 item 4)
        if not new or not earlier or (delta := budget.delta) is None:
            return
        accountant = self.cfg.teacher.accountant
        was, now = dataset_total(before, accountant, delta), dataset_total(budget, accountant, delta)
        self.log.warning(
            "%s: a new DP release on records already used by earlier runs: the privacy spent on these records "
            "(budget %s…) over every run rises from ε = %.4f to ε = %.4f at δ = %.3g (replace-one: from %.4f "
            "to %.4f; %d releases); see `dpdistill ledger show %s`", stage, sha[:12], was.epsilon, now.epsilon,
            delta, was.epsilon_replace_one, now.epsilon_replace_one, len(budget.releases), self.run_dir,
        )

    def _record(self, stage: str, **info) -> None:
        self.stages[stage] = {**self.stages.get(stage, {}), **info}
        atomic_write_json(self.run_dir / STAGES_INFO, self.stages)

    def _lock_path(self, task_fn, args, kwargs) -> Path:
        """The lock file of the cache entry this call reads or writes, named by its key
        (the key Prefect computes from the same policy and arguments)."""
        key = task_fn.cache_policy.compute_key(None, get_call_parameters(task_fn.fn, args, kwargs), {})
        return Path(self.cfg.run_root).resolve() / CACHE_LOCKS / f"{key}.lock"

    def _borrowed_private_copies(self, result) -> bool:
        """Whether a cached data stage's splits are another run's, deleted when that run ends."""
        stage_dir = stage_dir_of(result)
        return (not self.cfg.data.keep_private_copies and stage_dir is not None
                and not Path(stage_dir).resolve().is_relative_to(self.run_dir.resolve()))

    def _call(self, task_fn, args, kwargs, refresh: bool):
        configured = task_fn.with_options(result_serializer=StageResultSerializer(), refresh_cache=refresh)
        # Set after construction: `Task.__init__` refuses a block not saved on the server, which
        # would register our storage class there. Prefect itself runs a `Path` storage as an
        # unsaved LocalFileSystem; ours is that, with reads refused unless ours (flows/results.py).
        configured.result_storage = self.storage
        state = configured(*args, **kwargs, return_state=True)
        return state.result(), state.name == "Cached"

    def __call__(self, stage: str, task_fn, *args, **kwargs):
        forced = stage in self.rerun
        if forced and stage in STAGE_DIRS:
            own = self.run_dir / STAGE_DIRS[stage]
            if own.exists():  # only ever this run's copy; other runs' outputs are never touched
                if read_run_info(self.run_dir).get("tool") != TOOL:
                    raise RunDirError(f"not deleting {own}: {self.run_dir} is not a dpdistill run directory")
                if stage in ("teacher", "dp-student"):
                    self.log.warning("%s: forced to rerun: this trains on the private data again and "
                                     "spends a new privacy budget; discard the old model", stage)
                shutil.rmtree(own)
        t0 = time.time()
        self._record(stage, status="running", started_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        try:
            # One process at a time computes a cache entry: a second run of the same stage
            # waits here, then finds the first one's result in the cache instead of computing
            # (and, for a DP stage, spending budget on) it again.
            with file_lock(self._lock_path(task_fn, args, kwargs), on_wait=lambda: self.log.info(
                    "%s: another run is computing this stage with the same cache key; waiting for it "
                    "to reuse its result", stage)):
                result, cached = self._call(task_fn, args, kwargs, refresh=forced)
                if cached and (reason := stale_reason(result)):
                    if deleted_after_evaluation(result):
                        self.log.info("data: the private splits of %s were deleted after its evaluation "
                                      "(data.keep_private_copies=false), as recorded; writing them again",
                                      stage_dir_of(result).parent)
                    else:
                        self.log.warning("%s: the cached result cannot be trusted (%s); running the stage again",
                                         stage, reason)
                    result, cached = self._call(task_fn, args, kwargs, refresh=True)
                elif cached and stage == "data" and self._borrowed_private_copies(result):
                    # Their run deletes them when its evaluation ends, maybe while this run still
                    # reads them (two runs at once): this run writes its own (they are cheap).
                    self.log.info("data: the cached splits belong to %s, which deletes them when it ends; "
                                  "writing this run's own", stage_dir_of(result).parent)
                    result, cached = self._call(task_fn, args, kwargs, refresh=True)
        except BaseException as e:
            self._record(stage, status=stop_reason(e)[0], seconds=round(time.time() - t0, 2))
            raise
        out = stage_dir_of(result)
        reused = cached and stage in self.forced_before
        if reused:
            self.log.info("%s: rerun by request earlier in this run, which finished it before the run stopped: "
                          "reusing that result, not rerunning it (the same command continues a stopped run)", stage)
        elif cached:
            where = f"outputs in {out}" if out else "its result"
            self.log.info("%s: cached (same config, inputs, version and seed): reusing %s", stage, where)
        if reused:
            self._record(stage, **self.forced_before[stage])  # its status, time and ε as it ran
            return result
        self._record(
            stage,
            status="cached" if cached else ("forced" if forced or stage in self.forced_before else "ran"),
            seconds=round(time.time() - t0, 2),
            finished_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
            output=str(out) if out else None,
        )
        return result

    def charge(self, stage: str, result) -> list[LedgerEntry]:
        """The DP releases the stage hands back (its result's `releases()`), each charged to its
        records' budget once `use_records` has named them; returned for the run's ledger."""
        releases = result.releases()
        for part, entry in releases.items():  # part "": the stage's own release; else a second one of it
            if self.budget_id and entry.private and entry.epsilon:
                self._record_release(entry.stage if part else stage, result, entry, part)
        if main := releases.get(""):
            self._record(stage, epsilon=main.epsilon, epsilon_replace_one=main.epsilon_replace_one)
        return list(releases.values())
