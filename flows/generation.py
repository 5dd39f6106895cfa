"""Generation scaled out: each shard is a Prefect task, mapped over local worker processes.

    from flows.generation import generate_with_workers
    result = generate_with_workers(cfg.generate, teacher_dir=..., control_codes_path=...,
                                   ledger=..., out_dir=run_dir / "synthetic", seed=cfg.seed)

With `generate.workers` > 1 the `generation-shard` task is mapped over a subflow whose task
runner is a DaskTaskRunner on a LocalCluster of that many processes, one thread each (and
one torch thread each, so N workers on N cores do not oversubscribe them). Each worker loads
the teacher once and writes whole shards. With 1 worker the shards run in this process.
The shards are the same either way: shard i depends on (seed, i) alone
(pipeline/generate.py). Only the plan (paths, config, fingerprint, released code counts)
and per-shard aggregates cross Prefect and Dask, never a generated text.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect_dask import DaskTaskRunner

from pipeline.config import GenerateConfig
from pipeline.generate import (
    GenerateResult, GenerationPlan, finish_generation, generate_shard, plan_generation, progress,
)
from pipeline.ledger import LedgerEntry


@task(name="generation-shard", task_run_name="generation-shard-{shard}", cache_policy=NO_CACHE,
      persist_result=False)
def generation_shard_task(plan: GenerationPlan, shard: int, torch_threads: int | None = None) -> dict:
    """Write one shard (or reuse it); returns its aggregate stats."""
    if torch_threads:
        torch.set_num_threads(torch_threads)
    return generate_shard(plan, shard)


@flow(name="generation-workers", persist_result=False, validate_parameters=False)
def generation_workers_flow(plan: GenerationPlan, on_progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Map the shards over this flow's task runner; stats in order of completion."""
    futures = generation_shard_task.map(unmapped(plan), range(plan.n_shards), torch_threads=1)
    stats: list[dict] = []
    for future in as_completed(futures):
        stats.append(future.result())
        if on_progress:
            on_progress(progress(plan, stats))
    return stats


def dask_runner(workers: int) -> DaskTaskRunner:
    """A temporary local cluster: `workers` processes, one thread each, no dashboard."""
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                        "dashboard_address": None},
    )


def generate_with_workers(
    cfg: GenerateConfig,
    *,
    teacher_dir: Path,
    control_codes_path: Path,
    ledger: list[LedgerEntry],
    out_dir: Path,
    seed: int,
    on_progress: Callable[[dict], None] | None = None,
) -> GenerateResult:
    """`generate_synthetic` with the shards spread over `cfg.workers` local processes.

    Call it inside a flow or task. Finished shards are reused, whatever worker count wrote
    them. `tokens_per_second` counts the wall-clock time of all shards, cluster start included.
    """
    plan = plan_generation(cfg, teacher_dir=teacher_dir, control_codes_path=control_codes_path, ledger=ledger,
                           out_dir=out_dir, seed=seed)
    workers = min(cfg.workers, plan.n_shards)
    if cfg.workers > (os.cpu_count() or 1):
        warnings.warn(f"generate.workers={cfg.workers} exceeds the {os.cpu_count()} CPU cores; "
                      "the workers will compete for them (set generate.workers <= the cores)", stacklevel=2)
    t0 = time.perf_counter()
    if workers == 1:
        stats: list[dict] = []
        for shard in range(plan.n_shards):
            stats.append(generation_shard_task(plan, shard))
            if on_progress:
                on_progress(progress(plan, stats))
    else:
        stats = generation_workers_flow.with_options(task_runner=dask_runner(workers))(plan, on_progress)
    return finish_generation(plan, stats, wall_seconds=time.perf_counter() - t0)
