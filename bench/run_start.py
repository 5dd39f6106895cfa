"""What `dpdistill run` costs before and around its stages: the tests' tiny config (bench/faults.py's)
run by the CLI, as a user or a test runs it, from an earlier revision and from this tree,
alternating, in fresh processes.

Each run gets a new PREFECT_HOME (as every test does, and a user's first run): the temporary
Prefect server it starts creates its database (~19 s of that server's CPU; ~7 s on an existing
one). Measured per run: wall seconds from start to exit, and CPU seconds of the run and its
children (the server included). The earlier revision is checked out into a temporary git
worktree and run with this tree's interpreter.

Run from the repository root (its .venv). It needs the ELTeC-eng novels in ../shared/data
beside the checkout (bench/public.py); without them it exits with one line (exit code 2) before any work:

    OMP_NUM_THREADS=1 .venv/bin/python bench/run_start.py --before 4e1e494      # ~6 min

The last line reads `wall_x=W cpu_x=C` (before's medians over now's).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from faults import tiny_config  # noqa: E402  the tests' tiny pipeline
from public import eltec  # noqa: E402  bench/public.py: the corpus in ../shared


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(tree: Path, work: Path, base_cache: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one `dpdistill run` of the tiny config from `tree`."""
    work.mkdir(parents=True)
    cfg = tiny_config(base_cache.parent, work / "runs")
    config = work / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(work / "prefect_home"), "PYTHONPATH": str(tree)}
    where = subprocess.run([sys.executable, "-c", "import flows.cli; print(flows.cli.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True).stdout
    assert where.startswith(str(tree)), f"{tree}'s run would import {where}"  # not the editable install's tree
    cpu, t0 = _children_cpu(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(config)], cwd=tree, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"the run from {tree} failed:\n{done.stderr[-3000:]}")
    return wall, _children_cpu() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the earlier revision (e.g. 4e1e494)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    eltec()  # before any work: one line and exit 2 without ../shared
    with tempfile.TemporaryDirectory(prefix="run-start-") as tmp:
        tmp = Path(tmp)
        subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "before"), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            trees = {"before": tmp / "before", "now": ROOT}
            run_once(ROOT, tmp / "warm", tmp / "shared" / "base_cache")  # builds the base models both reuse
            rows = {name: [] for name in trees}
            print("| round | tree | wall s | CPU s | load |\n|---|---|---:|---:|---:|")
            for r in range(args.rounds):
                for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                    wall, cpu = run_once(tree, tmp / f"{name}-{r}", tmp / "shared" / "base_cache")
                    rows[name].append((wall, cpu))
                    print(f"| {r} | {name} | {wall:.1f} | {cpu:.1f} | {os.getloadavg()[0]:.1f} |", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "before")], cwd=ROOT, capture_output=True)
    med = {name: [statistics.median(x[i] for x in rows[name]) for i in (0, 1)] for name in rows}
    print(f"medians: before {med['before'][0]:.1f} s wall, {med['before'][1]:.1f} s CPU; "
          f"now {med['now'][0]:.1f} s wall, {med['now'][1]:.1f} s CPU")
    print(f"wall_x={med['before'][0] / med['now'][0]:.2f} cpu_x={med['before'][1] / med['now'][1]:.2f}")


if __name__ == "__main__":
    main()
