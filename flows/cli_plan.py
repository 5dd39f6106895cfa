"""`dpdistill plan --config C [key=value ...]`: N, q, σ, steps, ε, the records' budget and the
time of a run, before it runs; trains and writes nothing (pipeline/plan.py, pipeline/plan_time.py).

Light at import: torch and Opacus load in `run_plan`, Prefect never.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path


def run_plan(cfg) -> int:
    """`dpdistill plan`: 0 once printed; BudgetExceeded past privacy.max_epsilon and the other user
    errors reach the caller (flows/cli_run.py `run_pipeline` says them in one line)."""
    # The plan prints its own lines: a stage's INFO lines (the data split's, read for the
    # budget) in Opacus's basicConfig format ("11/24/2026 04:44:31:INFO:data: ...") were
    # noise after it. Warnings still show, in our format (set before Opacus's, a no-op then).
    logging.basicConfig(format="dpdistill: %(levelname)s: %(message)s")
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    from pipeline.plan import format_plan, format_times, make_plan  # torch, Opacus; no Prefect
    from pipeline.plan_time import estimate_seconds
    from pipeline.privacy.budget import budget_of
    from pipeline.stages.data import planned_split

    # Progress on stderr while it works, the plan itself on stdout: its privacy numbers and
    # the budget as soon as they are known (seconds), then the time (the steps timed, more).
    started = time.monotonic()

    def say(line: str) -> None:
        print(f"{line} ({time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)
    root = Path(cfg.run_root).resolve()
    # One split, read twice: the plan's sizes and test records, and the training records' budget.
    split, budget = planned_split(cfg.data, root, cfg.control_codes.domain, lambda train: budget_of(root, train))
    plan = make_plan(cfg, say=say, split=split)
    print(format_plan(plan), flush=True)
    print(planned_budget(cfg, plan, budget), flush=True)  # refused past privacy.max_epsilon: a user error, exit code 2
    for warning in plan.warnings:
        print(f"dpdistill: warning: {warning}", file=sys.stderr, flush=True)
    plan.seconds = estimate_seconds(cfg, plan, split, say)
    print(format_times(plan))
    return 0


def planned_budget(cfg, plan, budget) -> str:
    """`plan`'s lines on the training records' `budget` under run_root: spent by earlier runs, and
    with this run; BudgetExceeded past privacy.max_epsilon. Writes nothing."""
    from pipeline.privacy.budget import check_max_epsilon, dataset_total

    delta, accountant, limit = plan.total.accountant_delta(), cfg.teacher.accountant, cfg.privacy.max_epsilon
    spent = dataset_total(budget, accountant, delta)
    total = check_max_epsilon(budget, plan.entries, limit, accountant, delta)
    lines = [f"  budget of these {budget.n_records} training records under {cfg.run_root} (every run, with records "
             "overlapping them): " + ("nothing spent yet" if spent is None else
                                      f"ε = {spent.epsilon:.4f} over {len(budget.releases)} DP releases")]
    if total is not None:
        fixed = "" if total.accountant_delta() == delta else " (the δ the budget's first run fixed)"
        lines.append(f"    with this run: ε = {total.epsilon:.4f}, replace-one ε = {total.epsilon_replace_one:.4f} "
                     f"at δ = {total.delta:.3g}{fixed}"
                     + ("" if limit is None else f", within privacy.max_epsilon={limit:g}")
                     + ("" if spent is None else " (if no stage of it is cached: a cached stage spends nothing)"))
    return "\n".join(lines)
