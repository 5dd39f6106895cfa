"""Fault injection: SIGKILL a run at a random moment, rerun it, and check what it released.

One uninterrupted reference run of a tiny config first, timed at the moments that matter
(teacher started, its first checkpoint written, generation started, distillation started,
evaluation started). Then each trial, in its own run_root: `dpdistill run` in its own
session, SIGKILL of the whole process group at a moment drawn uniformly inside one of four
windows of the reference timeline (teacher before its first checkpoint, teacher after it,
generation, distillation), then the same command again until it completes (at most 3
times). Each trial checks:

- the ledger is the reference's (stage, ε, σ, steps of every entry): no budget counted twice
  or lost by a resume;
- every synthetic sample id is there exactly once across the generation shards, or counted
  as dropped (empty) in its shard's statistics: lost = ids neither there nor dropped;
- metrics.json is written, and the rerun continued the killed run's directory.

Needs the ELTeC-eng novels in ../shared/data beside the checkout (bench/public.py); without
them it exits with one line (exit code 2) before any work.

All runs set the test noise hook (DPDISTILL_TEST_NOISE_SEED, pipeline/privacy/noise.py), so they are
deterministic and comparable (and NOT private). One line per trial, then as the last line
`trials=N lost=L duplicated=D ledger_mismatch=M` (plus the failed reruns). Run from the
repository root:

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/faults.py --trials 10 --seed 0
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/faults.py --trials 2 --keep   # keep the run dirs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import yaml

from public import eltec  # bench/public.py: the corpus in ../shared
ROOT = Path(__file__).resolve().parents[1]
NOISE_SEED = "0"
WINDOWS = ("teacher-before-checkpoint", "teacher-after-checkpoint", "generation", "distillation")
# The event that opens each window, and the one that closes it, on the reference timeline.
BOUNDS = {
    "teacher-before-checkpoint": ("teacher", "checkpoint"),
    "teacher-after-checkpoint": ("checkpoint", "generation"),
    "generation": ("generation", "distillation"),
    "distillation": ("distillation", "evaluation"),
}


def tiny_config(work: Path, run_root: Path) -> dict:
    """The tests' tiny pipeline (tests/conftest.py), with a teacher long enough to kill on
    either side of a checkpoint and a generation of several shards."""
    data = ROOT / "data"
    domain = {
        "label1": [f"Business Category: {c}" for c in [
            "Restaurants", "Bars", "Shopping", "Beauty & Spas", "Event Planning & Services", "Hotels & Travel",
            "Arts & Entertainment", "Health & Medical", "Home & Garden", "Grocery"]],
        "label2": [f"Review Stars: {s}.0" for s in range(1, 6)],
    }
    return {
        "name": "faults", "seed": 0, "run_root": str(run_root),
        "data": {"path": str(data / "yelp_sample" / "train.csv"), "test_path": str(data / "yelp_sample" / "test.csv"),
                 "max_records": 120, "max_test_records": 20, "validation_fraction": 0.1},
        "control_codes": {"mechanism": "gaussian", "epsilon": 1.0, "domain": domain},
        "base_models": {  # shared by every trial: built once
            "corpus": str(eltec()), "cache_dir": str(work / "base_cache"),
            "max_corpus_chars": 100_000, "vocab_size": 400, "context_length": 96,
            "teacher": {"n_layer": 1, "n_embd": 32, "n_head": 2, "steps": 30, "batch_size": 8},
            "student": {"n_layer": 1, "n_embd": 16, "n_head": 2, "steps": 30, "batch_size": 8},
        },
        "teacher": {"target_epsilon": 8.0, "epochs": 4, "batch_size": 8, "physical_batch_size": 8,
                    "max_length": 96, "learning_rate": 1e-3, "checkpoint_every": 10},
        "generate": {"num_samples": 24, "batch_size": 6, "max_length": 80, "shard_size": 6},
        "distill": {"epochs": 10, "batch_size": 8, "learning_rate": 1e-3},  # a window worth aiming at
        "evaluate": {"window": 96, "batch_size": 8},
    }


def _stage_status(run: Path | None) -> dict[str, str]:
    try:
        return {k: v["status"] for k, v in json.loads((run / "stages.json").read_text()).items()}
    except (OSError, ValueError, TypeError):
        return {}


def _run_dir(run_root: Path) -> Path | None:
    runs = sorted(run_root.glob("faults-*"))
    return runs[-1] if runs else None


def _events(run: Path | None) -> set[str]:
    """Which moments of the timeline a run directory has passed."""
    if run is None:
        return set()
    status, seen = _stage_status(run), set()
    for stage in ("teacher", "generation", "distillation", "evaluation"):
        if stage in status:
            seen.add(stage)
    if (run / "teacher" / "checkpoint" / "state.pt").is_file() or "generation" in seen:
        seen.add("checkpoint")  # the checkpoint is deleted when the teacher finishes
    return seen


def _start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)


def reference_run(command: list[str], env: dict, run_root: Path, log: Path) -> tuple[Path, dict[str, float]]:
    """The uninterrupted run, polled every 20 ms: the time each event was first seen."""
    t0, times = time.perf_counter(), {}
    proc = _start(command, env, log)
    while proc.poll() is None:
        for event in _events(_run_dir(run_root)) - set(times):
            times[event] = time.perf_counter() - t0
        time.sleep(0.02)
    if proc.returncode != 0:
        sys.exit(f"the reference run failed (rc {proc.returncode}); see {log}")
    times["end"] = time.perf_counter() - t0
    missing = {"teacher", "checkpoint", "generation", "distillation", "evaluation"} - set(times)
    if missing:
        sys.exit(f"the reference run went by too fast to see {sorted(missing)}; lengthen the teacher")
    return _run_dir(run_root), times


def kill_in(window: str, delay: float, command: list[str], env: dict, run_root: Path, log: Path) -> str:
    """Start a run, wait for `window` to open, then `delay` seconds, and SIGKILL its
    process group. Returns where the run was when killed (stages.json), or 'finished'."""
    opening = BOUNDS[window][0]
    proc = _start(command, env, log)
    deadline = None
    try:
        while proc.poll() is None:
            if deadline is None and opening in _events(_run_dir(run_root)):
                deadline = time.perf_counter() + delay
            if deadline is not None and time.perf_counter() >= deadline:
                break
            time.sleep(0.02)
        else:
            return "finished before the kill"
    finally:
        alive = proc.poll() is None
        if alive:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if not alive and proc.returncode == 0:
        return "finished before the kill"
    run = _run_dir(run_root)
    running = [s for s, st in _stage_status(run).items() if st == "running"]
    where = running[0] if running else "between stages"
    if where == "teacher":
        where += " (checkpoint on disk)" if (run / "teacher" / "checkpoint" / "state.pt").is_file() else " (no checkpoint)"
    if where == "generation":
        where += f" ({len(list((run / 'synthetic').glob('shard-*.parquet')))} shards on disk)"
    return where


def ledger_rows(run: Path) -> list[tuple]:
    entries = json.loads((run / "ledger.json").read_text())["entries"]
    return [(e["stage"], e["epsilon"], e.get("noise_multiplier"), e.get("steps")) for e in entries]


def synthetic_check(run: Path, num_samples: int) -> tuple[int, int, str]:
    """(lost, duplicated, digest of the samples by id) over every shard of the run."""
    ids, dropped, texts = [], 0, {}
    for shard in sorted((run / "synthetic").glob("shard-*.parquet")):
        table = pq.read_table(shard)
        stats = json.loads(table.schema.metadata[b"dpdistill.shard_stats"])
        dropped += stats["dropped_empty"]
        shard_ids = table.column("sample_id").to_pylist()
        ids += shard_ids
        texts.update(zip(shard_ids, table.column("text").to_pylist()))
    unique = set(ids)
    duplicated = len(ids) - len(unique)
    lost = num_samples - dropped - len(unique & set(range(num_samples)))
    digest = hashlib.sha256(json.dumps(sorted(texts.items())).encode()).hexdigest()[:12]
    return lost, duplicated, digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="draws the kill windows and moments")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (printed) to inspect")
    args = parser.parse_args()
    eltec()  # before any work: one line and exit 2 without ../shared
    rng = np.random.default_rng(args.seed)

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from the test server
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    work = Path(tempfile.mkdtemp(prefix="dpdistill-faults-"))
    t_start = time.perf_counter()
    with prefect_test_harness(server_startup_timeout=300):  # one server for every run (no SQLite contention)
        env = os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "DPDISTILL_TEST_NOISE_SEED": NOISE_SEED,
                            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

        def command_for(run_root: Path) -> list[str]:
            config = run_root.parent / "config.yaml"
            config.write_text(yaml.safe_dump(tiny_config(work, run_root)))
            return [sys.executable, "-m", "flows.cli", "run", "--config", str(config)]

        ref_root = work / "reference" / "runs"
        ref_root.parent.mkdir(parents=True)
        ref, times = reference_run(command_for(ref_root), env, ref_root, work / "reference" / "log.txt")
        num_samples = tiny_config(work, ref_root)["generate"]["num_samples"]
        ref_ledger, (ref_lost, ref_dup, ref_digest) = ledger_rows(ref), synthetic_check(ref, num_samples)
        print(f"reference: {times['end']:.0f} s; teacher at {times['teacher']:.1f} s, first checkpoint "
              f"{times['checkpoint']:.1f} s, generation {times['generation']:.1f} s, distillation "
              f"{times['distillation']:.1f} s, evaluation {times['evaluation']:.1f} s; "
              f"lost={ref_lost} duplicated={ref_dup}", flush=True)

        # Every window equally often, in a random order; a uniform moment inside each.
        windows = [WINDOWS[i % len(WINDOWS)] for i in rng.permutation(args.trials)]
        totals = {"lost": 0, "duplicated": 0, "ledger_mismatch": 0, "rerun_failed": 0}
        for trial, window in enumerate(windows):
            start, end = (times[e] for e in BOUNDS[window])
            delay = float(rng.uniform(0, end - start))
            run_root = work / f"trial-{trial:02d}" / "runs"
            run_root.parent.mkdir(parents=True)
            command, log = command_for(run_root), run_root.parent / "log.txt"
            t0 = time.perf_counter()
            where = kill_in(window, delay, command, env, run_root, log)
            killed_run = _run_dir(run_root)
            reruns = 0
            done = subprocess.CompletedProcess(command, 0)  # the run finished before the kill: nothing to rerun
            while reruns < 3 and where != "finished before the kill":
                reruns += 1
                with log.open("a") as out:
                    done = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
                if done.returncode == 0:
                    break
            run = _run_dir(run_root)
            problems = []
            if done.returncode != 0:
                totals["rerun_failed"] += 1
                print(f"trial {trial}: {window} +{delay:.1f} s, killed in {where}: rerun FAILED {reruns}x "
                      f"(see {log})", flush=True)
                continue
            if len(list(run_root.glob("faults-*"))) != 1 or run != killed_run:
                problems.append("a new run directory instead of continuing the killed one")
            if ledger_rows(run) != ref_ledger:
                totals["ledger_mismatch"] += 1
                problems.append(f"ledger {ledger_rows(run)} != reference")
            lost, duplicated, digest = synthetic_check(run, num_samples)
            totals["lost"] += lost
            totals["duplicated"] += duplicated
            if not (run / "metrics.json").is_file():
                problems.append("no metrics.json")
            log_path = run / "teacher" / "training_log.json"
            resumed = json.loads(log_path.read_text())["resumed_from_step"] if log_path.is_file() else "-"
            print(f"trial {trial}: {window} +{delay:.1f} s, killed in {where}; {reruns} rerun(s), "
                  f"{time.perf_counter() - t0:.0f} s; teacher resumed from step {resumed}; lost={lost} "
                  f"duplicated={duplicated}; synthetic {'same as' if digest == ref_digest else 'DIFFERS from'} "
                  f"the reference; {'; '.join(problems) or 'ok'}", flush=True)

    print(f"wall time {time.perf_counter() - t_start:.0f} s; work directory "
          + (str(work) if args.keep else "deleted (--keep keeps it)"))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"trials={args.trials} lost={totals['lost']} duplicated={totals['duplicated']} "
          f"ledger_mismatch={totals['ledger_mismatch']} rerun_failed={totals['rerun_failed']}")


if __name__ == "__main__":
    main()
