"""The reference experiment: the structure of DistilDP's Table 2 at a size that runs here.

Rows: zero-shot (the base student), DP-SGD, DPKD, DP-Syn, ours, ours+MSE and the DP teacher,
each with its perplexity on the held-out test reviews, its wall time and its ε from the
ledger, all at the same ε and δ = 1/N. Every row is a real run of the Prefect flow with one
config switch (`distill.method`, `distill.beta`); DP-Syn and ours+MSE reuse the teacher,
the control codes and the synthetic shards of the `ours` run from the flow's stage cache
(same config sections, same inputs), so the teacher is not trained three times.

    .venv/bin/python bench/reference.py                       # configs/reference.yaml, CPU
    .venv/bin/python bench/reference.py generate.num_samples=20000 ...   # scale up by overrides

Prints a Markdown table and writes it, with the run directories, to runs/reference/table.md,
and a comparison page with a bar chart to runs/reference/report.html.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import flows  # noqa: F401  (log routing before Prefect and Opacus are imported)
from flows.cli import quiet_libraries
from flows.pipeline_flow import dp_distill, new_run_dir
from pipeline.config import load_config
from pipeline.ledger import read_ledger
from pipeline.report import write_comparison_report

# (row label, overrides); the last two reuse the `ours` run's cached stages
ROWS = [
    ("DP-SGD", ["distill.method=dp_sgd"]),
    ("DPKD", ["distill.method=dpkd"]),
    ("ours", ["distill.method=distil"]),
    ("DP-Syn", ["distill.method=dp_syn"]),
    ("ours+MSE", ["distill.method=distil", "distill.beta=1.0"]),
]


def run_row(config: str, overrides: list[str]) -> tuple[Path, float]:
    cfg = load_config(config, overrides)
    t0 = time.time()
    out = Path(dp_distill(cfg, run_dir=str(new_run_dir(cfg))))
    return out, time.time() - t0


def main(argv: list[str]) -> int:
    quiet_libraries()
    config = "configs/reference.yaml"
    results = []
    for label, overrides in ROWS:
        run, seconds = run_row(config, overrides + argv)
        metrics = json.loads((run / "metrics.json").read_text())
        ledger = read_ledger(run / "ledger.json")
        method = next(o.split("=")[1] for o in overrides if o.startswith("distill.method"))
        results.append((label, metrics["perplexity"][f"student_{method}"]["windowed"], seconds, ledger.total, run))
        if label == "ours":
            zero = metrics["perplexity"]["base_student"]["windowed"]
            teacher = metrics["perplexity"]["dp_teacher"]["windowed"]
            t_eps = ledger.entry("teacher").epsilon
    lines = [
        "| method | student perplexity | wall time (s) | ε (ledger total) | complete |",
        "|---|---:|---:|---:|---|",
        f"| zero-shot (base student) | {zero:.1f} | – | 0 | – |",
    ]
    for label, ppl, seconds, total, _ in results:
        lines.append(f"| {label} | {ppl:.1f} | {seconds:.0f} | {total.epsilon:.3f} | {'yes' if total.complete else 'no (exact codes)'} |")
    lines.append(f"| DP teacher (of `ours`) | {teacher:.1f} | – | {t_eps:.3f} | – |")
    table = "\n".join(lines)
    runs = "\n".join(f"- {label}: `{run}`" for label, *_, run in results)
    command = "`.venv/bin/python bench/reference.py" + "".join(f" {a}" for a in argv) + "`"
    report = f"{table}\n\nCommand: {command}\n\nRuns:\n{runs}\n"
    print("\n" + report)
    out = Path(load_config(config, argv).run_root) / "table.md"
    out.write_text(report)
    print(write_comparison_report({label: run for label, *_, run in results}, out.with_name("report.html")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
