"""The reference experiment of issue 12: DistilDP's Table 2, Figure 3 and ε sweep, resumable.

Every row is a real run of the Prefect flow with a few config overrides, run one after the
other; the flow's stage cache computes shared stages once (base models, data, teacher,
generation), so DP-Syn, ours+MSE and every Figure 3 size reuse the `ours` run's teacher and
synthetic shards, and only their students train.

    .venv/bin/python experiments/reference.py                          # all three experiments
    nohup .venv/bin/python experiments/reference.py generate.num_samples=20000 > reference.log 2>&1 &
    .venv/bin/python experiments/reference.py --only fig3 --fig3-sizes 500,1000,2000
    .venv/bin/python experiments/reference.py --report-only --docs     # tables and plots of what finished

Its data: configs/reference.yaml reads the Yelp split in ../shared/data beside the checkout (not
shipped; experiments/shared.py). Without it the driver exits with one line (exit code 2) before
any work; `--report-only` needs no data.

Experiments (`--only table,fig3,epsilon`, default all):
- table: zero-shot, DP-SGD, DPKD, DP-Syn, ours (the shipped defaults: the student chosen among
  α = 0.4 and α = 1 by the selection rule), ours (α=0.4), ours+MSE and the DP teacher (zero-shot and
  the DP teacher are read from the `ours` run's metrics).
- fig3: ours on the first n synthetic samples (`distill.num_synthetic`, `--fig3-sizes`,
  default 1,000, 2,500 and 5,000) of one generation, plus the whole generation (the `ours`
  row itself when the overrides are the same). Every size must be below
  `generate.num_samples`: the driver checks every row's config before it starts and names
  each row that fails.
- epsilon: ours at teacher ε in `--epsilons` with `generate.num_samples=--epsilon-samples` (2,500):
  each ε trains its own teacher and generates its own data.

`key=value` arguments override the config for every row; `--set EXPERIMENT key=value` for
one experiment's rows. Each finished row is appended to `<run_root>/results.jsonl`; a
restart skips the rows found there (same experiment, label and overrides, run directory
still present) and the flow continues a killed row in its own run directory (finished
stages cached, the teacher from its last checkpoint). At the end (or with `--report-only`,
which runs nothing) `<run_root>/table.md`, `fig3_samples.png`, `fig_epsilon.png` and the
table rows' `report.html` are written. Pass the same flags and overrides to `--report-only` as
to the run: rows match exactly. A row that fails is named and the others go on; the exit
status is then 1, and a restart retries it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.shared import RULE_CANDIDATES, require_data  # noqa: E402  the data in ../shared

EXPERIMENTS = ("table", "fig3", "epsilon")
# `ours` also scores the code adherence of 500 synthetic samples with its DP teacher (the other
# rows skip it: DP-Syn, ours+MSE and the Figure 3 sizes share that teacher and generation).
OURS = ("distill.method=distil", RULE_CANDIDATES, "evaluate.adherence_samples=500")
NO_ADHERENCE = "evaluate.adherence_samples=0"
# Table 2's trained rows, `ours` first: DP-Syn and ours+MSE then find its teacher and data cached.
TABLE_ROWS = {
    "ours": OURS,
    "DP-Syn": ("distill.method=dp_syn", NO_ADHERENCE),
    "ours+MSE": (*OURS, "distill.beta=1.0", NO_ADHERENCE),
    # The paper's loss alone, the shipped default before the selection rule (issue 20).
    "ours (α=0.4)": (*OURS, "distill.candidates=[]", "distill.alpha=0.4", "distill.kl_skip_tokens=null",
                     NO_ADHERENCE),
    "DP-SGD": ("distill.method=dp_sgd",),
    # DPKD's two DP-SGD trainings together spend teacher.target_epsilon, as the other rows' one
    # (pipeline/plan.py dp_sgd_budgets; until 2026-11-29 they split it and this row set 2.9).
    "DPKD": ("distill.method=dpkd",),
}
TABLE_ORDER = ("zero-shot", "DP-SGD", "DPKD", "DP-Syn", "ours", "ours (α=0.4)", "ours+MSE", "DP teacher")
# DistilDP (Table 2), Yelp, ε = 2: test perplexity. The paper has no separate ours+MSE row.
PAPER = {"zero-shot": 65.46, "DP-SGD": 48.12, "DPKD": 46.16, "DP-Syn": 61.84, "ours": 44.15, "DP teacher": 26.84}
FULL = "full"  # the fig3 row that trains on the whole generation
DASH = "–"


@dataclass(frozen=True)
class Row:
    experiment: str
    label: str
    overrides: tuple[str, ...]
    """Every override of the run, global ones first (a row's own come last and win)."""

    @property
    def key(self) -> tuple:
        return (self.experiment, self.label, tuple(self.overrides))

    @property
    def slug(self) -> str:
        """The label as a run name part (run names allow [A-Za-z0-9._-])."""
        return re.sub(r"[^A-Za-z0-9.]+", "-", f"{self.experiment}-{self.label}").strip("-")


def build_rows(only=EXPERIMENTS, fig3_sizes=(1000, 2500, 5000), epsilons=(1, 2, 4, 8), epsilon_samples=2500,
               extra=(), per_experiment=None) -> list[Row]:
    """The rows to run, in order. `extra`: overrides of every row; `per_experiment`: of one's rows."""
    per = per_experiment or {}

    def row(experiment: str, label: str, own) -> Row:
        return Row(experiment, label, (*extra, *per.get(experiment, ()), *own))

    rows = []
    if "table" in only:
        rows += [row("table", label, own) for label, own in TABLE_ROWS.items()]
    if "fig3" in only:
        rows.append(row("fig3", FULL, OURS))
        rows += [row("fig3", f"n={n}", (*OURS, f"distill.num_synthetic={n}", NO_ADHERENCE))
                 for n in sorted(fig3_sizes)]
    if "epsilon" in only:
        rows += [row("epsilon", f"ε={e:g}", (*OURS, f"teacher.target_epsilon={e:g}",
                                              f"generate.num_samples={epsilon_samples}")) for e in epsilons]
    return rows


# --- results.jsonl ---------------------------------------------------------------------

def read_results(path: Path) -> list[dict]:
    """The finished rows, oldest first. A line cut short (the driver killed mid-write) is skipped."""
    if not path.is_file():
        return []
    results = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            results.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"{path}: line {n} is not JSON (cut short by a kill?); its row runs again", flush=True)
    return results


def result_key(result: dict) -> tuple:
    return (result["experiment"], result["label"], tuple(result["overrides"]))


def finished(rows: list[Row], results: list[dict]) -> dict[tuple, dict]:
    """Row key → its newest result whose run directory still exists (a deleted run is redone)."""
    done = {}
    for result in results:
        if Path(result["run_dir"]).is_dir():
            done[result_key(result)] = result
    return {row.key: done[row.key] for row in rows if row.key in done}


def append_result(path: Path, result: dict) -> None:
    """One line per finished row, flushed to disk: a kill right after loses nothing."""
    with open(path, "a") as f:
        f.write(json.dumps(result, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def result_of(row: Row, run_dir: Path, seconds: float) -> dict:
    """What the report needs from a finished run: aggregates from metrics.json and the ledger."""
    from pipeline.privacy.ledger import read_ledger

    metrics = json.loads((run_dir / "metrics.json").read_text())
    ledger = read_ledger(run_dir / "ledger.json")
    ppl = {name: m["windowed"] for name, m in metrics["perplexity"].items()}
    stages = json.loads((run_dir / "stages.json").read_text())
    teacher = next((e for e in ledger.entries if e.stage == "teacher"), None)
    return {
        "experiment": row.experiment, "label": row.label, "overrides": list(row.overrides),
        "run_dir": str(run_dir), "seconds": round(seconds, 1), "method": metrics["method"],
        "perplexity": {"student": ppl[f"student_{metrics['method']}"], "base_student": ppl.get("base_student"),
                       "dp_teacher": ppl.get("dp_teacher"), "base_teacher": ppl.get("base_teacher")},
        "epsilon": ledger.total.epsilon, "delta": ledger.total.delta, "complete": ledger.total.complete,
        "teacher_epsilon": teacher.epsilon if teacher else None,
        "train_samples": metrics.get("distillation", {}).get("train_samples"),
        "code_adherence": (metrics.get("code_adherence") or {}).get("overall"),
        "code_adherence_columns": {c: col["share"] for c, col in
                                   ((metrics.get("code_adherence") or {}).get("columns") or {}).items()},
        "stages": {name: s.get("status") for name, s in stages.items()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


# --- report ----------------------------------------------------------------------------

def _num(value, fmt: str = ".1f") -> str:
    return DASH if value is None else format(value, fmt)


def _by_label(done: dict[tuple, dict], experiment: str) -> dict[str, dict]:
    return {key[1]: result for key, result in done.items() if key[0] == experiment}


def _ours(done: dict[tuple, dict]) -> dict | None:
    """The run zero-shot and the DP teacher come from: the table's `ours`, else fig3's full row."""
    return _by_label(done, "table").get("ours") or _by_label(done, "fig3").get(FULL)


def table2(done: dict[tuple, dict]) -> str:
    """Table 2, rows in the paper's order; perplexity is the first numeric column."""
    table, ours = _by_label(done, "table"), _ours(done)
    lines = ["| method | perplexity | wall time (s) | ε (ledger total) | code adherence | paper (Yelp, ε = 2) |",
             "|---|---:|---:|---:|---:|---:|"]
    for label in TABLE_ORDER:
        paper = _num(PAPER.get(label), ".2f")
        if label == "zero-shot":
            cells = [_num(ours and ours["perplexity"]["base_student"]), DASH, "0", DASH]
        elif label == "DP teacher":
            cells = [_num(ours and ours["perplexity"]["dp_teacher"]), DASH,
                     _num(ours and ours["teacher_epsilon"], ".3f"), DASH]
        elif (r := table.get(label)) is None:
            cells = [DASH, DASH, DASH, DASH]  # not run (yet)
        else:
            cells = [_num(r["perplexity"]["student"]), _num(r["seconds"], ".0f"),
                     _num(r["epsilon"], ".3f") + ("" if r["complete"] else " (incomplete)"),
                     _num(r.get("code_adherence"), ".3f")]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {paper} |")
    student, teacher = ours and ours["perplexity"]["student"], ours and ours["perplexity"]["dp_teacher"]
    ratio = f"{student / teacher:.2f}" if student and teacher else DASH
    lines += ["", f"Student / teacher perplexity (ours / DP teacher): {ratio} "
                  f"(paper: {PAPER['ours']} / {PAPER['DP teacher']} = {PAPER['ours'] / PAPER['DP teacher']:.2f})"]
    if ours and ours["perplexity"].get("base_teacher"):  # the gap distillation has to work with
        lines.append(f"Zero-shot perplexity of the base teacher: {ours['perplexity']['base_teacher']:.1f} "
                     f"(base student: {_num(ours['perplexity']['base_student'])})")
    return "\n".join(lines)


def fig3_points(done: dict[tuple, dict]) -> list[tuple[int, dict]]:
    """(synthetic train samples, result) of the fig3 rows, fewest first."""
    points = []
    for label, r in _by_label(done, "fig3").items():
        n = r.get("train_samples") or (int(label[2:]) if label.startswith("n=") else None)
        if n is not None:
            points.append((n, r))
    return sorted(points, key=lambda p: p[0])


def epsilon_points(done: dict[tuple, dict]) -> list[tuple[float, dict]]:
    """(teacher's target ε, result) of the epsilon rows, smallest first."""
    return sorted(((float(label[2:]), r) for label, r in _by_label(done, "epsilon").items()), key=lambda p: p[0])


def fig3_table(done: dict[tuple, dict]) -> str:
    lines = ["| synthetic train samples | student perplexity | wall time (s) |", "|---:|---:|---:|"]
    for n, r in fig3_points(done):
        full = " (all)" if r["label"] == FULL else ""
        lines.append(f"| {n:,}{full} | {_num(r['perplexity']['student'])} | {_num(r['seconds'], '.0f')} |")
    return "\n".join(lines)


def epsilon_table(done: dict[tuple, dict]) -> str:
    lines = ["| teacher ε (target) | student perplexity | DP teacher perplexity | ε (ledger total) | code adherence "
             "| wall time (s) |", "|---:|---:|---:|---:|---:|---:|"]
    for eps, r in epsilon_points(done):
        lines.append(f"| {eps:g} | {_num(r['perplexity']['student'])} | {_num(r['perplexity']['dp_teacher'])} | "
                     f"{_num(r['epsilon'], '.3f')} | {_num(r.get('code_adherence'), '.3f')} | {_num(r['seconds'], '.0f')} |")
    return "\n".join(lines)


def format_report(done: dict[tuple, dict], command: str = "") -> str:
    runs = "\n".join(f"- {exp} / {label}: `{r['run_dir']}`" for (exp, label, _), r in done.items())
    return (f"## Table 2\n\n{table2(done)}\n\n## Figure 3: student perplexity against synthetic samples\n\n"
            f"{fig3_table(done)}\n\n## Student perplexity against ε\n\n{epsilon_table(done)}\n\n"
            f"Perplexity: windowed, on the held-out test split. Command: `{command}`\n\nRuns:\n{runs}\n")


def write_plots(done: dict[tuple, dict], out_dir: Path) -> list[Path]:
    """fig3_samples.png and fig_epsilon.png, each when it has a point to draw. A bare `Figure`
    saves through matplotlib's Agg canvas, with no pyplot state (as pipeline/reports/report.py does)."""
    from matplotlib.figure import Figure

    written = []
    if points := fig3_points(done):
        fig = Figure(figsize=(5.5, 4))
        ax = fig.subplots()
        ax.plot([n for n, _ in points], [r["perplexity"]["student"] for _, r in points], "o-", label="ours (student)")
        dp_sgd, ours = _by_label(done, "table").get("DP-SGD"), _ours(done)
        if dp_sgd:
            ax.axhline(dp_sgd["perplexity"]["student"], color="tab:red", ls="--", label="DP-SGD (student)")
        if ours and ours["perplexity"]["dp_teacher"]:
            ax.axhline(ours["perplexity"]["dp_teacher"], color="tab:green", ls=":", label="DP teacher")
        ax.set(xscale="log", xlabel="synthetic train samples", ylabel="test perplexity",
               title="Student perplexity against synthetic data size")
        written.append(_save(fig, ax, out_dir / "fig3_samples.png", [n for n, _ in points]))
    if points := epsilon_points(done):
        fig = Figure(figsize=(5.5, 4))
        ax = fig.subplots()
        eps = [e for e, _ in points]
        ax.plot(eps, [r["perplexity"]["student"] for _, r in points], "o-", label="ours (student)")
        ax.plot(eps, [r["perplexity"]["dp_teacher"] for _, r in points], "s--", label="DP teacher")
        ax.set(xscale="log", xlabel="teacher ε", ylabel="test perplexity", title="Perplexity against ε")
        written.append(_save(fig, ax, out_dir / "fig_epsilon.png", eps))
    return written


def _save(fig, ax, path: Path, ticks: list[float]) -> Path:
    # The measured x values as plain tick labels: a log axis labels 2×10^1 otherwise.
    ax.set_xticks(ticks, [f"{x:,g}" for x in ticks])
    ax.set_xticks([], minor=True)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def write_report(done: dict[tuple, dict], run_root: Path, command: str, docs: bool = False) -> Path:
    out = run_root / "table.md"
    out.write_text(format_report(done, command))
    plots = write_plots(done, run_root)
    if table := _by_label(done, "table"):  # the bar chart page of the table's runs, as before
        from pipeline.reports.report import write_comparison_report

        write_comparison_report({label: Path(r["run_dir"]) for label, r in table.items()}, run_root / "report.html")
    if docs:  # the figures docs/reference.md shows
        names = {"fig3_samples.png": "reference_fig3.png", "fig_epsilon.png": "reference_epsilon.png"}
        for plot in plots:
            shutil.copyfile(plot, ROOT / "docs" / "img" / names[plot.name])
    print(f"wrote {out}" + "".join(f", {p}" for p in plots), flush=True)
    return out


# --- the driver ------------------------------------------------------------------------

def _stage_summary(result: dict) -> str:
    by = {}
    for stage, status in result["stages"].items():
        by.setdefault(status, []).append(stage)
    return "; ".join(f"{status}: {', '.join(stages)}" for status, stages in sorted(by.items()))


def _resumed_teacher(run_dir: Path) -> int:
    log = run_dir / "teacher" / "training_log.json"
    return json.loads(log.read_text()).get("resumed_from_step", 0) if log.is_file() else 0


def run_row(row: Row, config: str, name: str) -> dict:
    """One flow run. No run directory is passed: the flow continues this row's killed run, if any."""
    from flows.pipeline_flow import dp_distill
    from pipeline.config import load_config

    cfg = load_config(config, [*row.overrides, f"name={name}-{row.slug}"])
    t0 = time.monotonic()
    run_dir = Path(dp_distill(cfg))
    return result_of(row, run_dir, time.monotonic() - t0)


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. 1,2,4") from None
    return parse


def run_rows(rows: list[Row], done: dict[tuple, dict], results_path: Path, config: str, name: str) -> list[str]:
    """Run the rows not done yet, appending each to results.jsonl; returns the rows that failed.
    A failed row does not stop the others (hours of them); Ctrl-C does."""
    failed = []
    for i, row in enumerate(rows, 1):
        where = f"[{i}/{len(rows)}] {row.experiment} / {row.label}"
        if row.key in done:
            print(f"{where}: done before ({done[row.key]['run_dir']}), skipped", flush=True)
            continue
        # The same run under another experiment's name (fig3's full row is table's ours).
        twin = next((r for k, r in done.items() if k[2] == row.key[2]), None)
        if twin is not None:
            result = {**twin, "experiment": row.experiment, "label": row.label}
            print(f"{where}: the same run as {twin['experiment']} / {twin['label']}, reused", flush=True)
        else:
            print(f"{where}: running with {' '.join(row.overrides)}", flush=True)
            try:
                result = run_row(row, config, name)
            except Exception as e:  # the flow logged the traceback and marked its run directory
                print(f"{where}: FAILED ({type(e).__name__}: {e}); going on with the next row", flush=True)
                failed.append(f"{row.experiment} / {row.label}")
                continue
            resumed = _resumed_teacher(Path(result["run_dir"]))
            print(f"{where}: done in {result['seconds']:.0f} s, perplexity "
                  f"{result['perplexity']['student']:.1f}; stages {_stage_summary(result)}"
                  + (f"; teacher resumed at step {resumed}" if resumed else ""), flush=True)
        append_result(results_path, result)
        done[row.key] = result
    return failed


def _run_rows_stoppably(*args) -> list[str]:
    """run_rows, stopped by Ctrl-C or `kill` as `dpdistill run` is (flows/interrupts.py): the row's
    run directory marked interrupted and the temporary Prefect server stopped, not left running."""
    from prefect.exceptions import TerminationSignal

    from flows.interrupts import Interrupts

    with Interrupts() as interrupts:
        try:
            return run_rows(*args)
        except (KeyboardInterrupt, TerminationSignal) as e:
            interrupts.finish(getattr(e, "signal", None))  # does not return
            raise


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every row")
    p.add_argument("--config", default="configs/reference.yaml")
    p.add_argument("--only", default=",".join(EXPERIMENTS), help="experiments to run: table,fig3,epsilon")
    p.add_argument("--rows", default=None, help="run only the rows with these labels, e.g. DP-SGD,ours")
    p.add_argument("--fig3-sizes", type=_numbers(int), default=[1000, 2500, 5000], help="distill.num_synthetic of the fig3 rows")
    p.add_argument("--epsilons", type=_numbers(float), default=[1.0, 2.0, 4.0, 8.0], help="teacher.target_epsilon of the epsilon rows")
    p.add_argument("--epsilon-samples", type=int, default=2500, help="generate.num_samples of the epsilon rows")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("EXPERIMENT", "KEY=VALUE"),
                   help="an override of one experiment's rows (repeatable)")
    p.add_argument("--report-only", action="store_true", help="write the report from results.jsonl, run nothing")
    p.add_argument("--docs", action="store_true", help="copy the plots to docs/img/reference_*.png")
    args = p.parse_args(argv)
    only = args.only.split(",")
    if bad := [e for e in only + [e for e, _ in args.set] if e not in EXPERIMENTS]:
        p.error(f"unknown experiment(s) {bad}; choose among {', '.join(EXPERIMENTS)}")
    args.only = only
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
    import flows  # noqa: F401  (log routing before Prefect and Opacus are imported)
    from flows.cli_run import quiet_libraries
    from pipeline.config import ConfigError, load_config
    from pipeline.manifest import private_dir

    quiet_libraries()
    per = {}
    for experiment, override in args.set:
        per.setdefault(experiment, []).append(override)
    rows = build_rows(args.only, args.fig3_sizes, args.epsilons, args.epsilon_samples, args.overrides, per)
    if args.rows:
        rows = [r for r in rows if r.label in args.rows.split(",")]
    try:  # every row's config checked before hours of training, every problem in one message
        base = load_config(args.config, args.overrides)
        problems = []
        for row in rows:
            try:
                load_config(args.config, list(row.overrides))
            except ConfigError as e:
                problems.append(f"row {row.experiment} / {row.label}: {e}")
        if problems:
            raise ConfigError("\n".join(problems))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.report_only:
        require_data(base, "experiments/reference.py", args.config)
    run_root = Path(base.run_root)
    if not run_root.exists():  # made 0700 as the flow makes it (never chmod an existing, maybe shared, one)
        private_dir(run_root)
    results_path = run_root / "results.jsonl"
    command = " ".join(["experiments/reference.py", *argv])
    t0 = time.monotonic()
    done = finished(rows, read_results(results_path))
    failed = [] if args.report_only else _run_rows_stoppably(rows, done, results_path, args.config, base.name)
    write_report({row.key: done[row.key] for row in rows if row.key in done}, run_root, command, docs=args.docs)
    seconds = time.monotonic() - t0
    print(f"total wall time {seconds:.0f} s ({seconds / 3600:.2f} h)", flush=True)
    if failed:
        print(f"{len(failed)} row(s) failed (see above; start again to retry them): {', '.join(failed)}",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
