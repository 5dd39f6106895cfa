"""What a run costs beyond its stages: a tiny config (bench/faults.py's) run twice under one
Prefect test server (the first run trains every stage; the second finds them cached, all but
the data stage, whose private splits were deleted after evaluation), each run's wall seconds
beside the sum of its stages' own seconds (stages.json).

The gap is the flow's own work: Prefect's task and artifact calls, the plan, the ledger, the
dataset budget and the report. A profile of it found dp-accounting's PLD taking most of it
(docs/benchmarks.md, "What a run costs around its stages"); `--profile` prints the 25 costliest calls of the last run.
Both PLD settings side by side, alternating: "before" (dp-accounting's default 1e-4 grid, every
ε computed afresh, as before 2026-11-23) and "now" (`pipeline/privacy/pld.py`: 1e-3, cached).

Run from the repository root. It needs the ELTeC-eng novels in ../shared/data beside the checkout
(bench/public.py); without them it exits with one line (exit code 2) before any work:

    OMP_NUM_THREADS=1 .venv/bin/python bench/flow_overhead.py          # ~4 min

The last line reads `first_x=A cached_x=B` (before's seconds over now's, first and later runs).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from public import eltec  # noqa: E402  bench/public.py: the corpus in ../shared
from faults import tiny_config  # noqa: E402  bench/faults.py: the tests' tiny pipeline, a longer teacher
from flows.pipeline_flow import dp_distill  # noqa: E402
from pipeline.config import config_from_dict  # noqa: E402
from pipeline.privacy import pld  # noqa: E402

CACHED = pld._epsilon
SETTINGS = {"before": (1e-4, CACHED.__wrapped__), "now": (pld.VALUE_DISCRETIZATION_INTERVAL, CACHED)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2, help="rounds of before/now")
    p.add_argument("--profile", action="store_true", help="profile the last cached run of 'now'")
    args = p.parse_args()
    eltec()  # before any work: one line and exit 2 without ../shared
    from prefect.testing.utilities import prefect_test_harness

    rows = []
    with prefect_test_harness(server_startup_timeout=120):
        for i in range(args.runs):
            for name, (grid, compute) in SETTINGS.items():
                CACHED.cache_clear()
                pld.VALUE_DISCRETIZATION_INTERVAL, pld._epsilon = grid, compute
                tmp = Path(tempfile.mkdtemp(prefix=f"flow-overhead-{name}-"))
                for j in range(2):  # a run that trains every stage, then one that finds them cached
                    profile = cProfile.Profile() if args.profile and (i, name, j) == (args.runs - 1, "now", 1) else None
                    t0 = time.perf_counter()
                    if profile:
                        profile.enable()
                    run = Path(dp_distill(config_from_dict(tiny_config(tmp, tmp / "runs"))))
                    if profile:
                        profile.disable()
                        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
                    stages = json.loads((run / "stages.json").read_text())
                    rows.append((i, name, "first" if j == 0 else "cached", time.perf_counter() - t0,
                                 sum(s.get("seconds") or 0 for s in stages.values())))
    print("| round | PLD | run | s | stages' own s |\n|---|---|---|---:|---:|")
    for i, name, kind, wall, own in rows:
        print(f"| {i} | {name} | {kind} | {wall:.1f} | {own:.1f} |")

    def total(name: str, kind: str) -> float:
        return sum(r[3] for r in rows if r[1] == name and r[2] == kind)
    print(f"first_x={total('before', 'first') / total('now', 'first'):.2f} "
          f"cached_x={total('before', 'cached') / total('now', 'cached'):.2f}")

if __name__ == "__main__":
    main()
