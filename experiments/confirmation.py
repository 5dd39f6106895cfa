"""The confirmation experiment of issue 20 (docs/confirmation.md): rows run several times, each
time with fresh secret DP noise, reported as mean ± sd. Resumable.

    OMP_NUM_THREADS=1 nohup .venv/bin/python experiments/confirmation.py --config configs/airline.yaml \
        > runs/confirmation/experiment.log 2>&1 &
    .venv/bin/python experiments/confirmation.py --config configs/reference.yaml --rows ours,DP-SGD --repeats 3
    .venv/bin/python experiments/confirmation.py --config configs/airline.yaml --report-only

Every run is the Prefect flow with the row's overrides, in its own run directory
(`<name>-<row>-r<k>`). Repeat 1 takes what the stage cache holds; every later repeat reruns
the first stage that draws DP noise and everything after it (pipeline/methods.py `noisy_stage`:
control-codes for the distilled rows, dp-student for DP-SGD, the teacher for DPKD), so that each
repeat is an independent draw of the noise, never a cache hit. Finished runs are appended to
`<run_root>/confirmation.jsonl` (or the file `--results` names: a tracked one outlives the run
root), each line naming its config (two configs may share a run_root); a restart skips them and
continues a killed run in its own directory. The report's table gives
each row's student perplexity windowed, per record (mean, median, token-weighted) and on the text
alone (the control-code header left out of the targets), and ends with the line
`corpus=NAME ours=M±S dpsgd=M±S dpkd=M±S` (windowed test perplexities); with a cached model as
the teacher (docs/real_model.md) also `model=NAME corpus=NAME runs=K ours=... zero_shot=M` and one
`downstream model=NAME corpus=NAME column=COL synthetic_f1=X chance=Y ...` line per code column.

Its data: configs/airline.yaml reads the airline tweets and configs/reference.yaml the Yelp split
in ../shared/data beside the checkout (not shipped; experiments/shared.py). Without them it exits
with one line (exit code 2) before any work; `--report-only` needs no data.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.shared import (  # noqa: E402  the data in ../shared
    RULE_CANDIDATES, add_results_option, finish, mean_sd, read_results, refresh_selections, require_data, run_recorded,
    selection_of, shared_teacher_note)
# label: its overrides. A repeat reruns the method's first noisy stage and all after it
# (pipeline/methods.py `noisy_stage`; DPKD's teacher too since 2026-11-30, before: its dp-student
# alone, so the DPKD rows' repeats in the results files of this harness share one DP teacher).
ROWS = {
    "ours": ("distill.method=distil", RULE_CANDIDATES, "distill.keep_candidates=true"),
    "DP-SGD": ("distill.method=dp_sgd",),
    # DPKD's two DP-SGD trainings together spend teacher.target_epsilon (pipeline/plan.py dp_sgd_budgets)
    "DPKD": ("distill.method=dpkd",),
    "DP-Syn": ("distill.method=dp_syn", "evaluate.adherence_samples=0"),
}
# The order runs are made in: the rows the claim rests on first, one repeat of each at a time.
SCHEDULE = (("ours", 1), ("DP-SGD", 1), ("ours", 2), ("DP-SGD", 2), ("ours", 3), ("DP-SGD", 3),
            ("DPKD", 1), ("DP-Syn", 1), ("DPKD", 2), ("DPKD", 3))


def _result(label: str, repeat: int, run_dir: Path, seconds: float) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    ledger = json.loads((run_dir / "ledger.json").read_text())
    ppl = metrics["perplexity"]
    student = next(m for name, m in ppl.items() if name.startswith("student_"))
    text = student["text_only"]  # the control-code header left out of the targets (issue 37)
    out = {"row": label, "repeat": repeat, "run_dir": str(run_dir), "seconds": round(seconds, 1),
           "student": student["windowed"], "student_per_record_mean": student["per_record_mean"],
           "student_per_record_median": student["per_record_median"],
           "student_per_record_token_weighted": student["per_record_token_weighted"],
           "student_text_windowed": text["windowed"], "student_text_per_record_median": text["per_record_median"],
           "student_text_per_record_token_weighted": text["per_record_token_weighted"],
           "zero_shot": ppl["base_student"]["windowed"], "dp_teacher": ppl.get("dp_teacher", {}).get("windowed"),
           "dp_teacher_text": ppl.get("dp_teacher", {}).get("text_only", {}).get("windowed"),
           "mauve": (metrics.get("mauve") or {}).get("mauve"),
           "epsilon": ledger["total"]["epsilon"], "delta": ledger["total"]["delta"]}
    if sel := metrics.get("selection"):
        out["selection"] = {**selection_of(metrics), "criterion_study": sel.get("criterion_study"),
                            "criterion_study_text": sel.get("criterion_study_text")}
    if ds := metrics.get("downstream"):
        out["downstream"] = {c: {"macro_f1": v["synthetic"]["macro_f1"], "accuracy": v["synthetic"]["accuracy"],
                                 "real_reference_macro_f1": (v["real_reference"] or {}).get("macro_f1"),
                                 "chance_macro_f1": v["chance_macro_f1"]}
                             for c, v in ds["columns"].items() if "synthetic" in v}
    if adh := metrics.get("code_adherence"):  # does the DP teacher recognise its codes in its own text
        out["code_adherence"] = {c: {"share": v["share"], "chance": v["chance"], "n": v["n"]}
                                 for c, v in adh["columns"].items()}
    if props := metrics.get("text_properties"):
        out["mean_tokens"] = {"synthetic": props["synthetic"]["tokens"]["mean"],
                              "real_test_capped": props["real_test"].get("tokens_capped", {}).get("mean")}
    return out


def run_one(config: str, label: str, repeat: int, extra: list[str]) -> dict:
    from flows.pipeline_flow import dp_distill
    from flows.run_info import stages_to_rerun
    from pipeline.config import load_config
    from pipeline.methods import method_spec

    cfg = load_config(config, [*ROWS[label], *extra])
    noisy_stage = method_spec(cfg.distill.method).noisy_stage
    cfg = cfg.model_copy(update={"name": f"{cfg.name}-{label.lower().replace('-', '')}-r{repeat}"})
    t0 = time.monotonic()
    run_dir = Path(dp_distill(cfg, rerun=stages_to_rerun(noisy_stage, None) if repeat > 1 else None))
    return _result(label, repeat, run_dir, time.monotonic() - t0)


# The table's columns after the windowed figure (a result from before issue 37 has only the first):
# per record, then on the text alone, with the control-code header left out of the targets.
STUDENT_FIGURES = ("student_per_record_mean", "student_per_record_median", "student_per_record_token_weighted",
                   "student_text_windowed", "student_text_per_record_median",
                   "student_text_per_record_token_weighted")


def report(results: list[dict], corpus: str, model: str | None = None) -> str:
    by_row: dict[str, list[dict]] = {}
    for r in results:
        by_row.setdefault(r["row"], []).append(r)
    lines = [("| row | runs | test perplexity (mean ± sd) | each run | per-record mean | per-record median "
              "| per-record token-weighted | text alone: windowed | text alone: per-record median "
              "| text alone: per-record token-weighted | ε (total) | wall s |"),
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ours = by_row.get("ours", [])
    extra = {"zero-shot": [r["zero_shot"] for r in ours], "DP teacher": [r["dp_teacher"] for r in ours]}
    for label in ("zero-shot", "DP-SGD", "DPKD", "DP-Syn", "ours", "DP teacher"):
        if label in extra:
            vals = [v for v in extra[label] if v is not None]
            if vals:
                lines.append(f"| {label} | {len(vals)} | {mean_sd(vals)} | {', '.join(f'{v:.1f}' for v in vals)} "
                             "| | | | | | | | |")
            continue
        rows = by_row.get(label, [])
        if rows:
            vals = [r["student"] for r in rows]
            each = ", ".join(f"{v:.1f}" for v in vals)
            epsilons = ", ".join(f"{r['epsilon']:.3f}" for r in rows)
            seconds = ", ".join(f"{r['seconds']:.0f}" for r in rows)
            figures = " | ".join(mean_sd([r[k] for r in rows if r.get(k) is not None]) for k in STUDENT_FIGURES)
            lines.append(f"| {label} | {len(rows)} | {mean_sd(vals)} | {each} | {figures} | {epsilons} | {seconds} |")
    out = "\n".join(lines)
    notes = "".join(shared_teacher_note(label, by_row.get(label, [])) for label in ("DP-SGD", "DPKD", "DP-Syn"))
    out += "\n\n" + notes.rstrip("\n") if notes else ""
    if ours and any("selection" in r for r in ours):
        out += "\n\nSelection in each `ours` run (test perplexity computed after the choice):\n\n"
        out += ("| run | chosen | candidate | teacher_kl | untruncated_ce | synthetic validation CE | test perplexity "
                "| text alone |\n")
        out += "|---|---|---|---:|---:|---:|---:|---:|\n"
        for r in ours:
            for c in r.get("selection", {}).get("candidates", []):
                out += (f"| r{r['repeat']} | {'→' if c['candidate'] == r['selection']['chosen'] else ''} | "
                        f"{c['candidate']} | {_f(c.get('teacher_kl'), 4)} | {_f(c.get('untruncated_ce'), 4)} | "
                        f"{_f(c.get('synthetic_validation_ce'), 4)} | {_f(c['test_perplexity'], 1)} "
                        f"| {_f(c.get('test_text_perplexity'), 1)} |\n")
        for key, what in (("test_perplexity", "test perplexity"), ("test_text_perplexity", "test perplexity on the "
                                                                   "text alone")):
            regrets = [_regret(r["selection"], key) for r in ours if r.get("selection")]
            regrets = [x for x in regrets if x is not None]
            if regrets:
                out += (f"\nRegret of the chosen candidate by {what} (its figure minus the best candidate's): "
                        f"{mean_sd(regrets)} ({', '.join(f'{x:.1f}' for x in regrets)}).\n")
    summary = {k: mean_sd([r["student"] for r in by_row.get(label, [])])
               for k, label in (("ours", "ours"), ("dpsgd", "DP-SGD"), ("dpkd", "DPKD"))}
    out += f"\ncorpus={corpus} ours={summary['ours']} dpsgd={summary['dpsgd']} dpkd={summary['dpkd']}\n"
    if model:
        out += model_lines(by_row, model, corpus, summary)
    return out


def model_lines(by_row: dict[str, list[dict]], model: str, corpus: str, summary: dict[str, str]) -> str:
    """Issue 36's lines: `model=... corpus=... runs=K ours=... dpsgd=... dpkd=... zero_shot=M` (K: the
    fewest runs of the three rows), then per code column the downstream classifier trained on ours'
    synthetic text, its macro-F1 (mean over ours' runs) against chance."""
    ours = by_row.get("ours", [])
    runs = min((len(by_row.get(label, [])) for label in ("ours", "DP-SGD", "DPKD")), default=0)
    zero_shot = [r["zero_shot"] for r in ours if r.get("zero_shot") is not None]
    z = f"{statistics.mean(zero_shot):.1f}" if zero_shot else "–"
    out = (f"model={model} corpus={corpus} runs={runs} ours={summary['ours']} dpsgd={summary['dpsgd']} "
           f"dpkd={summary['dpkd']} zero_shot={z}\n")
    columns = sorted({c for r in ours for c in r.get("downstream", {})})
    for c in columns:
        f1 = [r["downstream"][c]["macro_f1"] for r in ours if c in r.get("downstream", {})]
        first = next(r["downstream"][c] for r in ours if c in r.get("downstream", {}))
        sd = f"{statistics.stdev(f1):.3f}" if len(f1) > 1 else "–"
        ref = first.get("real_reference_macro_f1")
        out += (f"downstream model={model} corpus={corpus} column={c} synthetic_f1={statistics.mean(f1):.3f} "
                f"chance={first['chance_macro_f1']:.3f} sd={sd} runs={len(f1)} real_reference={_f(ref, 3)}\n")
    return out


def _regret(selection: dict, key: str) -> float | None:
    """The chosen candidate's figure minus the best candidate's (None unless every candidate has it)."""
    values = {c["candidate"]: c.get(key) for c in selection.get("candidates", [])}
    if not values or None in values.values() or selection["chosen"] not in values:
        return None
    return values[selection["chosen"]] - min(values.values())


def _f(x, digits: int) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    p.add_argument("--config", default="configs/airline.yaml")
    p.add_argument("--corpus", default=None, help="the corpus name of the last line (default: the config's name)")
    p.add_argument("--model", default=None,
                   help="the model name of issue 36's last lines (default: the teacher's cache name, "
                   "e.g. smollm2-135m; none for a builtin teacher)")
    p.add_argument("--rows", default=",".join(ROWS), help="rows to run, e.g. ours,DP-SGD")
    p.add_argument("--repeats", type=int, default=3, help="runs per row (DP-Syn: 1)")
    add_results_option(p, "confirmation.jsonl")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--refresh", action="store_true",
                   help="first re-derive each finished run's selection figures from its metrics.json "
                   "(figures added to the report after the run was recorded)")
    args = p.parse_args(argv)
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)
    if not args.report_only:
        require_data(cfg, "experiments/confirmation.py", args.config)
    root = Path(cfg.run_root)
    root.mkdir(parents=True, exist_ok=True)
    results_path = args.results or root / "confirmation.jsonl"
    if args.refresh:
        print(f"refreshed the selection figures of {refresh_selections(results_path)} recorded run(s)")
    corpus = args.corpus or cfg.name
    model = args.model or (cfg.teacher.model.removeprefix("cache:") if cfg.teacher.model.startswith("cache:") else None)
    wanted = set(args.rows.split(","))
    schedule = [(label, k) for label, k in SCHEDULE if label in wanted and k <= (1 if label == "DP-Syn" else args.repeats)]
    failed = []
    if not args.report_only:
        for label, k in schedule:
            if any(r["row"] == label and r["repeat"] == k for r in read_results(results_path, cfg.name)):
                continue
            run_recorded(results_path, cfg.name, f"{label} run {k}",
                         lambda label=label, k=k: run_one(args.config, label, k, list(args.overrides)), failed)
    text = report(read_results(results_path, cfg.name), corpus, model)
    return finish(root / f"{cfg.name}-confirmation.md", text, failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
