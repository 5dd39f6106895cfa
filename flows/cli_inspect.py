"""`dpdistill status`, `report` and `ledger show`: the commands that read a run directory.

    dpdistill status runs/demo-...        # stages done, durations, ε
    dpdistill report runs/demo-...        # (re)write its report.html
    dpdistill ledger show runs/demo-...   # a run's privacy ledger, and the budget of its records

Light at import, like flows/cli.py: they answer without torch, transformers, Opacus or Prefect
(issue 10). A damaged file of the run directory is one error line that names the fix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flows.run_info import RUN_INFO, STAGES, STAGES_INFO, TOOL, read_run_info, run_alive
from pipeline.reports import STAGE_WORDS
from pipeline.privacy.ledger import LEDGER, format_table, read_ledger


class DamagedFileError(Exception):
    """A run directory's JSON file that cannot be read; the message names it and the fix."""


# What to do about each damaged file, as the flow treats it on a rerun: a run directory with
# an unreadable run.json is refused (not provably ours), an unreadable stages.json stops the
# resume, while ledger.json and metrics.json are rewritten from the finished stages.
_REWRITE = {
    RUN_INFO: "run the same config again without --run-dir (finished stages are reused from the cache)",
    STAGES_INFO: "it holds only the table `dpdistill status` prints: delete it and run the same command "
                 "with --run-dir {run_dir} to rebuild it",
    LEDGER: "run the same command with --run-dir {run_dir} (finished stages are reused) to rewrite it",
    "metrics.json": "run the same command with --run-dir {run_dir} --from evaluation to rewrite it",
}


def _damaged(path: Path, err: Exception) -> DamagedFileError:
    fix = _REWRITE.get(path.name, "run the same command again").format(run_dir=path.parent)
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return DamagedFileError(f"{path} is damaged ({reason}); {fix}")


def read_json_file(path: Path):
    """A run directory's JSON file; a truncated or garbled one raises DamagedFileError."""
    try:
        return json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise _damaged(Path(path), e) from e


def read_ledger_file(path: Path):
    try:
        return read_ledger(path)
    except (ValueError, UnicodeDecodeError) as e:  # bad JSON, or JSON that is not a ledger (pydantic)
        raise _damaged(Path(path), e) from e


def print_status(run_dir: Path) -> int:
    info_path, stages_path = run_dir / RUN_INFO, run_dir / STAGES_INFO
    if not info_path.is_file():
        print(f"dpdistill: error: {info_path} not found; pass a run directory", file=sys.stderr)
        return 2
    # Every file is read before the first line prints: a damaged one gives one error line.
    info = read_json_file(info_path)
    if not isinstance(info, dict) or "status" not in info:
        raise _damaged(info_path, ValueError("no status field"))
    stages = read_json_file(stages_path) if stages_path.is_file() else {}
    ledger = read_ledger_file(run_dir / LEDGER) if (run_dir / LEDGER).is_file() else None
    state = info["status"]
    if state == "running" and not run_alive(info):
        state = "interrupted (its process is gone): run the same command again to continue it"
    elif state in ("failed", "interrupted"):
        why = f" ({info['reason']})" if info.get("reason") else ""
        state = f"{state}{why}: run the same command again to continue it (log: {run_dir / 'run.log'})"
    print(f"run {run_dir}\nstatus: {state}; started {info.get('started_at')}"
          + (f", finished {info['finished_at']}" if info.get("finished_at") else ""))
    rows = [("stage", "status", "seconds", "epsilon", "replace-one", "output")]
    entries = {e.stage: e for e in ledger.entries} if ledger is not None else {}  # for an older stages.json
    for name in STAGES:
        if name not in stages:
            continue
        s = stages[name]
        out = s.get("output") or ""
        if out and Path(out).is_relative_to(run_dir.resolve()):
            out = str(Path(out).relative_to(run_dir.resolve()))
        elif out and s["status"] == "cached":
            out = f"reused from {out}"
        eps = s.get("epsilon")
        replace_one = s.get("epsilon_replace_one", getattr(entries.get(name), "epsilon_replace_one", None))
        rows.append((name, STAGE_WORDS.get(s["status"], s["status"]),
                     f"{s['seconds']:.1f}" if s.get("seconds") is not None else "",
                     f"{eps:.4f}" if eps else "", f"{replace_one:.4f}" if eps and replace_one else "", out))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
    if ledger is not None:
        total = ledger.total
        if total:
            replace_one = "" if total.epsilon_replace_one is None else f", replace-one ε = {total.epsilon_replace_one:.4f}"
            print(f"total: ε = {total.epsilon:.4f}{replace_one}, δ = {total.delta:.3g} ({total.accountant})"
                  + ("" if total.complete else "; incomplete: " + total.note))
    return 0


def write_run_report(run_dir: Path) -> int:
    """`dpdistill report`: check the files it reads, then (re)write report.html."""
    if not run_dir.is_dir():
        print(f"dpdistill: error: run directory {run_dir} does not exist; pass the directory a run wrote "
              "(`dpdistill status` lists its stages)", file=sys.stderr)
        return 2
    for name in (RUN_INFO, STAGES_INFO, "metrics.json"):
        if (run_dir / name).is_file():
            read_json_file(run_dir / name)
    if (run_dir / LEDGER).is_file():
        read_ledger_file(run_dir / LEDGER)
    from pipeline.reports.report import write_report  # matplotlib and pyarrow, not torch

    # A stage that stages.json records as running is running only while the run's process is.
    info = read_run_info(run_dir)
    print(write_report(run_dir, writer_alive=info.get("status") == "running" and run_alive(info)))
    return 0


def show_ledger(run_dir: Path) -> int:
    path = run_dir / LEDGER
    if not path.is_file():
        info = read_run_info(run_dir)
        if info.get("tool") != TOOL:
            why = f"{run_dir} is not a run directory (no {RUN_INFO} written by dpdistill); pass the directory a run wrote"
        else:  # a run of ours that has not written its ledger (yet)
            state = "is still running" if info.get("status") == "running" and run_alive(info) else \
                f"stopped ({info.get('status', 'unknown')})"
            why = (f"{run_dir} has no {LEDGER} yet: the run {state} before writing it, so it has released "
                   "nothing a ledger would list; `dpdistill status` shows how far its stages got")
        print(f"dpdistill: error: {why}", file=sys.stderr)
        return 2
    ledger = read_ledger_file(path)
    print(format_table(ledger))
    print_dataset_budget(run_dir, ledger)
    return 0


def print_dataset_budget(run_dir: Path, ledger) -> None:
    """Every DP release charged to the budget of the run's training records (made on them or on
    records overlapping them, by any run), composed at the δ its first release fixed (pipeline/privacy/budget.py)."""
    from pipeline.privacy.budget import dataset_total, format_budget, read_budget, stored_total

    info = read_run_info(run_dir)
    budget_id = info.get("records_id") or info.get("dataset_sha256")  # keyed by the file's bytes before issue 21
    if not (budget_id and info.get("run_root")):
        return  # a run from before the dataset budget was kept
    budget = read_budget(Path(info["run_root"]), budget_id)
    total = None
    if ledger.total and budget.releases:
        delta = budget.delta or ledger.total.accountant_delta()  # the first release's, fixed (a run's only if none is Gaussian)
        # The total the run's accountant composed at its end, if the releases are still those;
        # else compose now (dataset_total imports Opacus and torch then: seconds).
        total = (stored_total(budget, ledger.total.accountant, delta)
                 or dataset_total(budget, ledger.total.accountant, delta))
    print(f"\nAll releases on this dataset (on these training records or records overlapping them, every run "
          f"under {info['run_root']}; budget {budget_id[:12]}…):")
    print(format_budget(budget, total))
