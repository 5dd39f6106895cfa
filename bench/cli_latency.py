"""How fast the CLI's light commands answer, side by side with a command that imports torch.

Runs, in fresh interpreters and alternating, `dpdistill --help`, `status RUN_DIR`,
`ledger show RUN_DIR` and `report RUN_DIR` on a small hand-made run directory, `ledger show`
on one whose dataset budget holds a release (composing it imports Opacus, so torch), and the
imports every command paid before issue 10 (`flows.pipeline_flow`: Prefect, torch,
transformers, Opacus) plus `--help`. Prints the median wall time of each and the ratio of
the heavy one to each light one. Run from the repository root:

    PYTHONPATH=. .venv/bin/python bench/cli_latency.py              # 3 rounds
    PYTHONPATH=. .venv/bin/python bench/cli_latency.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.privacy.budget import record_release
from pipeline.privacy.ledger import LedgerEntry, LedgerTotal, PrivacyLedger, post_processing, write_ledger

ROOT = Path(__file__).resolve().parents[1]


def _run_dir(root: Path, budget: bool = False) -> Path:
    """A finished run's status, ledger and metrics files, without its models (not read here);
    with `budget`, its teacher release is also in the dataset budget (as every run since
    pipeline/privacy/budget.py), which `ledger show` composes with an Opacus accountant."""
    run = root / ("run-budget" if budget else "run-bench")
    run.mkdir()
    (run / "config.yaml").write_text("name: bench\n")
    info = {"tool": "dpdistill", "status": "completed", "host": "elsewhere", "started_at": "2026-11-21T09:00:00",
            "pid": 1}
    if budget:
        info |= {"run_root": str(root), "dataset_sha256": "0" * 64}
    (run / "run.json").write_text(json.dumps(info))
    (run / "stages.json").write_text(json.dumps({"teacher": {"status": "ran", "seconds": 10.0, "epsilon": 2.0}}))
    teacher = LedgerEntry(stage="teacher", private=True, epsilon=2.0, delta=1e-3, accountant="prv",
                          mechanism="subsampled_gaussian", noise_multiplier=1.4, sample_rate=0.1, steps=12,
                          max_grad_norm=1.0, privacy_unit="record", history=[(1.4, 0.1, 12)], note="DP-SGD")
    total = LedgerTotal(epsilon=2.0, delta=1e-3, accountant="prv", composition="prv accountant",
                        complete=True, note="(ε, δ)-DP per record")
    write_ledger(run / "ledger.json", PrivacyLedger(entries=[teacher, post_processing("evaluation", "e")],
                                                    total=total))
    (run / "metrics.json").write_text(json.dumps({"seconds": {"teacher": 10.0}}))
    if budget:
        record_release(root, "0" * 64, release_id="bench", stage="teacher", run_dir=run, entry=teacher)
    return run


def _seconds(argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run, with_budget = str(_run_dir(Path(tmp))), str(_run_dir(Path(tmp), budget=True))
        commands = {
            "--help": ["-m", "flows.cli", "--help"],
            "status": ["-m", "flows.cli", "status", run],
            "ledger show": ["-m", "flows.cli", "ledger", "show", run],
            "report": ["-m", "flows.cli", "report", run],
            "ledger show + budget": ["-m", "flows.cli", "ledger", "show", with_budget],
            "heavy imports + --help": ["-c", "import sys, flows.pipeline_flow, flows.cli; "
                                              "sys.argv = ['dpdistill', '--help']; flows.cli.main()"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):  # alternating, so machine load falls on every command alike
            for name, argv in commands.items():
                times[name].append(_seconds(argv))
    heavy = statistics.median(times["heavy imports + --help"])
    print(f"{'command':<24}{'median s':>10}{'heavy / this':>14}   ({args.repeats} rounds, {os.cpu_count()} CPUs)")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<24}{m:>10.2f}{heavy / m:>14.1f}")


if __name__ == "__main__":
    main()
