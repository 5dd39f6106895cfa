"""Generation scaled out: each shard is a Prefect task, mapped over local worker processes.

    from flows.generation import generate_with_workers
    result = generate_with_workers(cfg.generate, teacher_dir=..., control_codes_path=...,
                                   ledger=..., out_dir=run_dir / "synthetic", seed=cfg.seed)

With `generate.workers` > 1 the `generation-shard` task is mapped over a subflow whose task
runner is a DaskTaskRunner on a LocalCluster of that many processes, one thread each (and
the run's `threads` torch threads each, by default the cores shared out, so N workers on N
cores do not oversubscribe them). Every worker samples on the run's device and precision
(the plan's `runtime`); on one GPU, workers > 1 share it. Each worker loads
the teacher once and writes whole shards. With 1 worker the shards run in this process.
The shards are the same either way: shard i depends on (seed, i) alone
(pipeline/stages/generate.py).

With `generate.dask_address` (or $DASK_SCHEDULER_ADDRESS) the same subflow runs on
DaskTaskRunner(address=...): the shards go to a running `distributed` scheduler and its
workers, whatever `workers` says. Workers load the teacher and write shards by path, so
`check_cluster_storage` first asks each of them (Client.run) whether it can, and refuses
with the workers that cannot. A worker lost mid-shard has its task rescheduled by
distributed on another; the shard's file is only ever renamed into place whole.

Only the plan (paths, config, fingerprint, released code counts) and per-shard aggregates
cross Prefect and Dask, never a generated text.

Progress is per generated batch either way. A Dask worker writes its shard's counts so far
(samples, new tokens) to `synthetic/.progress-<shard>.json` after each batch; this process
polls those files while it waits for the shards (simpler than a Dask queue, and it works
with any task runner), and removes them when the shard is done.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect_dask import DaskTaskRunner

from pipeline.config import GenerateConfig
from pipeline.stages.generate import (
    GenerateError, GenerateResult, GenerationPlan, GenerationProgress, finish_generation, generate_shard,
    plan_generation, shard_access_problems, teacher_files,
)
from pipeline.devices import CPU_FP32, Runtime
from pipeline.privacy.ledger import LedgerEntry
from pipeline.prompts import HEADER, PromptFormat
from pipeline.manifest import atomic_write_json
from pipeline.progress import DEFAULT_EVERY

POLL_SECONDS = 1.0  # how often the parent reads the workers' progress files
CONNECT_SECONDS = 30  # to reach a cluster's scheduler and see its first worker


def _progress_file(plan: GenerationPlan, shard: int) -> Path:
    return plan.out_dir / f".progress-{shard:05d}.json"


def _write_shard_progress(plan: GenerationPlan, shard: int, samples: int, new_tokens: int) -> None:
    # which process runs the shard, for whoever watches a cluster (and the worker-kill test)
    atomic_write_json(_progress_file(plan, shard), {"samples": samples, "new_tokens": new_tokens,
                                                    "host": socket.gethostname(), "pid": os.getpid()})


def _read_shard_progress(plan: GenerationPlan, shard: int) -> tuple[int, int] | None:
    try:
        counts = json.loads(_progress_file(plan, shard).read_text())
    except (OSError, ValueError):  # not written yet (atomic writes: never half a file)
        return None
    return counts["samples"], counts["new_tokens"]


@task(name="generation-shard", task_run_name="generation-shard-{shard}", cache_policy=NO_CACHE,
      persist_result=False)
def generation_shard_task(plan: GenerationPlan, shard: int, torch_threads: int | None = None,
                          on_batch: Callable[[int, int], None] | None = None) -> dict:
    """Write one shard (or reuse it); returns its aggregate stats. Without `on_batch` (on a
    worker process) the counts so far go to the shard's progress file after each batch.
    `torch_threads`: this process's torch threads (a Dask worker's share of the cores)."""
    if torch_threads:
        torch.set_num_threads(torch_threads)
    return generate_shard(plan, shard, on_batch or functools.partial(_write_shard_progress, plan, shard))


@flow(name="generation-workers", persist_result=False, validate_parameters=False)
def generation_workers_flow(plan: GenerationPlan, on_progress: Callable[[dict], None] | None = None,
                            progress_every: float = DEFAULT_EVERY, external: bool = False) -> list[dict]:
    """Map the shards over this flow's task runner and report the workers' batches while
    they run; stats in order of completion."""
    tracker = GenerationProgress(plan, on_progress, progress_every)
    for shard in range(plan.n_shards):  # left by an interrupted run: not this run's progress
        _progress_file(plan, shard).unlink(missing_ok=True)
    # per worker process: local ones share this machine's cores; a cluster's workers know their own
    # node, so they take the run's `threads` if set, else what their environment says
    threads = plan.runtime.threads if external else plan.runtime.threads_for(min(plan.cfg.workers, plan.n_shards))
    futures = generation_shard_task.map(unmapped(plan), range(plan.n_shards), torch_threads=threads)
    finished: queue.Queue = queue.Queue()  # each future puts itself here when done (a Dask thread)
    for future in futures:
        future.add_done_callback(finished.put)
    pending, stats = dict(enumerate(futures)), []
    while pending:
        try:
            future = finished.get(timeout=POLL_SECONDS)
        except queue.Empty:
            pass
        else:
            stats.append(future.result())  # raises if the shard failed
            pending.pop(stats[-1]["shard"])
            _progress_file(plan, stats[-1]["shard"]).unlink(missing_ok=True)
            tracker.shard_done(stats[-1])
        for shard in pending:
            if (counts := _read_shard_progress(plan, shard)) is not None:
                tracker.batch(shard, *counts)
    return stats


def _run_workers_flow(runner: DaskTaskRunner, plan: GenerationPlan, on_progress: Callable[[dict], None] | None,
                      progress_every: float, external: bool = False) -> list[dict]:
    """`generation_workers_flow` on `runner`, its list of stats never persisted.

    Called inside the generation stage's task (persist_result=True, serializer
    dpdistill-stage-json), the subflow's own persist_result=False is not what Prefect 3.8.8
    reads: `prefect.results.should_persist_result` asks the innermost TaskRunContext first, the
    stage task's, and the subflow's result store is that task's too. So the subflow wrote its
    list through the stage serializer, which refuses it ("Failed to serialize object of type
    'list'"; issue 35). Prefect's #19450 made `get_run_context` prefer a subflow's own context,
    not this. The stage task persists the GenerateResult; nothing under it should."""
    task_ctx = TaskRunContext.get()
    quiet = (task_ctx.model_copy(update={"persist_result": False})  # for this call only
             if task_ctx is not None and task_ctx.persist_result else contextlib.nullcontext())
    with quiet:
        return generation_workers_flow.with_options(task_runner=runner)(plan, on_progress, progress_every,
                                                                        external=external)


def dask_runner(workers: int) -> DaskTaskRunner:
    """A temporary local cluster: `workers` processes, one thread each, no dashboard."""
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                        "dashboard_address": None},
    )


def scheduler_address(cfg: GenerateConfig) -> str | None:
    """The Dask scheduler to generate on: `generate.dask_address`, else $DASK_SCHEDULER_ADDRESS
    (what `dask` itself reads), else None: local processes."""
    return cfg.dask_address or os.environ.get("DASK_SCHEDULER_ADDRESS") or None


def _where(cfg: GenerateConfig) -> str:
    return "generate.dask_address" if cfg.dask_address else "$DASK_SCHEDULER_ADDRESS"


def check_cluster_storage(plan: GenerationPlan, address: str) -> None:
    """Refuse, before any shard, a cluster whose workers cannot read the teacher or write the
    output directory at the plan's paths: they would fail one shard at a time, or (a node-local
    directory at the same path) write shards the flow never sees."""
    from distributed import Client  # here: only a cluster run needs it

    marker = f".dask-check-{os.getpid()}.json"
    atomic_write_json(plan.out_dir / marker, teacher_files(plan.teacher_dir))
    try:
        with Client(address, timeout=CONNECT_SECONDS) as client:
            client.wait_for_workers(1, timeout=CONNECT_SECONDS)
            answers = client.run(shard_access_problems, plan.teacher_dir, plan.out_dir, marker)
    except (OSError, TimeoutError) as e:
        raise GenerateError(
            f"{_where(plan.cfg)}={address}: no Dask scheduler with a worker answered within {CONNECT_SECONDS} s "
            f"({e}); start `dask scheduler` and `dask worker {address}` (docs/operations.md, 'Running generation "
            "on a Dask cluster'), or unset it to generate on this machine"
        ) from e
    finally:
        (plan.out_dir / marker).unlink(missing_ok=True)
    refused = {worker: problems for worker, problems in sorted(answers.items()) if problems}
    if refused:
        lines = "\n".join(f"  {worker}: {'; '.join(problems)}" for worker, problems in refused.items())
        raise GenerateError(
            f"{len(refused)} of the {len(answers)} Dask workers at {_where(plan.cfg)}={address} cannot generate "
            f"shards:\n{lines}\nMount the storage holding the run directory at the same path on every worker "
            "node (and use an absolute run_root), or stop those workers; docs/operations.md, 'Running generation "
            "on a Dask cluster'"
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
    progress_every: float = DEFAULT_EVERY,
    runtime: Runtime = CPU_FP32,
    prompt: PromptFormat = HEADER,
) -> GenerateResult:
    """`generate_synthetic` with the shards spread over `cfg.workers` local processes, or over
    the workers of a running Dask cluster (`scheduler_address`), after checking that each of
    them reads the teacher and writes `out_dir` at these paths.

    Call it inside a flow or task. Finished shards are reused, whatever worker count wrote
    them. `tokens_per_second` counts the wall-clock time of all shards, cluster start included.
    `on_progress` and the progress lines (every `progress_every` s) follow each generated batch.
    """
    plan = plan_generation(cfg, teacher_dir=teacher_dir, control_codes_path=control_codes_path, ledger=ledger,
                           out_dir=out_dir, seed=seed, runtime=runtime, prompt=prompt)
    workers = min(cfg.workers, plan.n_shards)
    address = scheduler_address(cfg)
    if not address and cfg.workers > (os.cpu_count() or 1):
        warnings.warn(f"generate.workers={cfg.workers} exceeds the {os.cpu_count()} CPU cores; "
                      "the workers will compete for them (set generate.workers <= the cores)", stacklevel=2)
    t0 = time.perf_counter()
    if address:
        check_cluster_storage(plan, address)
        runner = DaskTaskRunner(address=address)  # the cluster outlives the flow: only the client closes
        stats = _run_workers_flow(runner, plan, on_progress, progress_every, external=True)
    elif workers == 1:
        runtime.apply_threads()
        tracker = GenerationProgress(plan, on_progress, progress_every)
        stats: list[dict] = []
        for shard in range(plan.n_shards):
            stats.append(generation_shard_task(plan, shard, on_batch=functools.partial(tracker.batch, shard)))
            tracker.shard_done(stats[-1])
    else:
        stats = _run_workers_flow(dask_runner(workers), plan, on_progress, progress_every)
    return finish_generation(plan, stats, wall_seconds=time.perf_counter() - t0)
