"""Prefect artifacts of a run: the privacy ledger, the metrics and synthetic samples, never a private record.

Each table artifact also carries its table as Markdown in its description. The Prefect 3.8.8
UI's page of an artifact key (`/artifacts/key/privacy-ledger`) shows the description and a
timeline of collapsed artifacts: it expands the latest one only when the collection it reads
has a `latest_id`, and the server's `GET /artifacts/{key}/latest` answers with an `Artifact`,
which has none. So the table itself shows only on the artifact's own page or after a click;
the description is what the key page shows.
"""

from __future__ import annotations

from pathlib import Path

import prefect.main  # noqa: F401  (before pipeline.* imports Opacus: see flows/__init__.py)
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from pipeline.stages.generate import synthetic_head
from pipeline.reports import privacy_sentence, table_keys
from pipeline.privacy.budget import DatasetBudget
from pipeline.privacy.ledger import ADJACENCY_NOTE as _ADJACENCY, LedgerTotal, PrivacyLedger, table_rows, total_guarantee

LEDGER_KEY = "privacy-ledger"
SUMMARY_KEY = "privacy-summary"
METRICS_KEY = "metrics"
SYNTHETIC_KEY = "synthetic-samples"
ADHERENCE_KEY = "code-adherence"
SELECTION_KEY = "student-selection"
DOWNSTREAM_KEY = "downstream-classifier"
REPORT_KEY = "run-report"


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


_MARKDOWN_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_[]<>|~#&"} | {"\n": " ", "\r": " ", "\t": " "})


def markdown_table(rows: list[dict[str, str]], columns: list[str]) -> str:
    """`rows` (string values) as a GitHub Markdown table of `columns`; a cell's Markdown
    characters are escaped, so a synthetic text shows as text and stays in its cell."""
    def line(cells) -> str:
        return "| " + " | ".join(str(c).translate(_MARKDOWN_SPECIAL) for c in cells) + " |"

    return "\n".join([line(columns), "|" + "---|" * len(columns)] + [line(r.get(c, "") for c in columns) for r in rows])


def ledger_summary(
    ledger: PrivacyLedger, budget: DatasetBudget | None = None, dataset_total: LedgerTotal | None = None
) -> str:
    lines = ["# Privacy ledger", ""]
    t = ledger.total
    if t:
        lines += [f"**Total: ε = {t.epsilon:.4f}, δ = {t.delta:.3g}; replace-one ε = {_fmt(t.epsilon_replace_one)}** "
                  f"({t.composition}). {t.note}.", "", _ADJACENCY, ""]
    for e in ledger.entries:
        if e.private and e.epsilon:
            lines.append(
                f"- **{e.stage}**: (ε = {e.epsilon:.4f}, δ = {e.delta:.3g})-DP per {e.privacy_unit}, replace-one "
                f"ε = {_fmt(e.epsilon_replace_one)}, {e.accountant} accountant (cross-checks: RDP ε = "
                f"{_fmt(e.epsilon_rdp)}, dp-accounting PLD ε = {_fmt(e.epsilon_pld)}), "
                f"σ = {_fmt(e.noise_multiplier)}, q = {_fmt(e.sample_rate)}, {e.steps} steps, "
                f"clipping norm {e.max_grad_norm}; noise from {e.noise_source or 'unrecorded'}."
            )
        elif not e.private:
            lines.append(f"- **{e.stage}** (not private): {e.note}")
    lines += [
        "",
        "Generation, distillation and evaluation only post-process the DP teacher (ε = 0).",
    ]
    if budget is not None and dataset_total is not None:
        n = len(budget.releases)
        lines += [
            "", "## All releases on this dataset", "",
            f"**Every run together: ε = {dataset_total.epsilon:.4f}, δ = {dataset_total.delta:.3g}; replace-one "
            f"ε = {_fmt(dataset_total.epsilon_replace_one)}** "
            f"over {n} DP release{'s' * (n != 1)} on these training records or records overlapping them "
            f"(budget `{budget.records_id[:12]}…`, keyed by the records), {dataset_total.composition}. A person in the "
            "data is protected by this total, not by one run's.",
            "",
        ]
        lines += [
            f"- {r.recorded_at}: **{r.stage}**, ε = {r.entry.epsilon:.4f}, replace-one ε = "
            f"{_fmt(r.entry.epsilon_replace_one)} ({r.entry.mechanism}), "
            f"run `{Path(r.run_dir).name}`" for r in budget.releases
        ]
    return "\n".join(lines)


def publish_ledger(
    ledger: PrivacyLedger, budget: DatasetBudget | None = None, dataset_total: LedgerTotal | None = None
) -> None:
    keep = ("stage", "guarantee", "epsilon", "epsilon_replace_one", "delta", "accountant", "mechanism",
            "noise_multiplier", "sample_rate", "steps", "max_grad_norm", "privacy_unit", "epsilon_rdp", "epsilon_pld",
            "noise_source", "note")
    rows = [{k: _fmt(row[k]) for k in keep} for row in table_rows(ledger)[: len(ledger.entries)]]  # the total: below
    if ledger.total:
        t = ledger.total
        rows.append({k: "" for k in keep} | {
            "stage": "TOTAL", "guarantee": total_guarantee(t), "epsilon": _fmt(t.epsilon),
            "epsilon_replace_one": _fmt(t.epsilon_replace_one), "epsilon_pld": _fmt(t.epsilon_pld),
            "delta": _fmt(t.delta), "accountant": t.accountant, "note": f"{t.composition}. {t.note}",
        })
    short = ["stage", "guarantee", "epsilon", "epsilon_replace_one", "delta", "noise_multiplier", "sample_rate",
             "steps", "accountant"]
    description = ("Privacy ledger: one row per stage\n\n" + markdown_table(rows, short)
                   + "\n\nEvery column (mechanism, clipping norm, noise source, notes): the artifact below.")
    create_table_artifact(key=LEDGER_KEY, table=rows, description=description)
    create_markdown_artifact(
        key=SUMMARY_KEY, markdown=ledger_summary(ledger, budget, dataset_total), description="Privacy guarantee"
    )


def publish_metrics(metrics: dict) -> None:
    rows = [
        {
            "model": name,
            "windowed_perplexity": _fmt(m["windowed"]),
            "per_record_mean": _fmt(m["per_record_mean"]),
            "per_record_median": _fmt(m["per_record_median"]),
            "per_record_token_weighted": _fmt(m.get("per_record_token_weighted")),
            # the control-code header left out of the targets (pipeline/stages/evaluate.py)
            "text_alone_windowed": _fmt((m.get("text_only") or {}).get("windowed")),
            "text_alone_per_record_median": _fmt((m.get("text_only") or {}).get("per_record_median")),
            "test_tokens": m["tokens"],
        }
        for name, m in metrics["perplexity"].items()
    ]
    description = (
        f"Perplexity on the held-out test split ({metrics['window']}-token windows), method {metrics['method']}"
        + (f", {metrics['generation']['samples']} synthetic samples" if "generation" in metrics else "")
    )
    description += "\n\n" + markdown_table(rows, list(rows[0]))
    create_table_artifact(key=METRICS_KEY, table=rows, description=description)
    if (metrics.get("code_adherence") or {}).get("columns"):  # a column with 2 or more values was scored
        publish_code_adherence(metrics["code_adherence"])
    if metrics.get("selection"):
        publish_selection(metrics["selection"])
    if metrics.get("downstream"):
        publish_downstream(metrics["downstream"])


def publish_selection(selection: dict) -> None:
    """Every distillation candidate, its criterion values and the chosen one (pipeline/stages/selection.py)."""
    keys = table_keys(selection)
    rows = [{"candidate": r["candidate"], "chosen": "yes" if r["candidate"] == selection["chosen"] else "",
             **{k: _fmt(r.get(k)) for k in keys}} for r in selection["candidates"]]
    description = (
        f"Candidates for the student, kept: {selection['chosen']} (lowest {selection['select_by']}; teacher_kl and "
        f"untruncated_ce on {selection['selection_samples']} texts the DP teacher sampled without truncation). "
        f"{privacy_sentence(selection)} test_perplexity, where shown, was computed after the choice.\n\n"
        + markdown_table(rows, ["candidate", "chosen", *keys])
    )
    create_table_artifact(key=SELECTION_KEY, table=rows, description=description)


def publish_downstream(downstream: dict) -> None:
    """Per code column, a classifier trained on the synthetic text and tested on the real test split."""
    rows = []
    for column, c in downstream["columns"].items():
        if "skipped" in c:
            continue
        rows.append({"column": column, "accuracy": _fmt(c["synthetic"]["accuracy"]),
                     "macro_f1": _fmt(c["synthetic"]["macro_f1"]),
                     "real_reference_macro_f1": _fmt((c["real_reference"] or {}).get("macro_f1")),
                     "majority_accuracy": _fmt(c["majority"]["accuracy"]), "chance_macro_f1": _fmt(c["chance_macro_f1"])})
    if not rows:
        return
    description = (f"Does the synthetic text serve a downstream task? {downstream['classifier']} trained on the synthetic "
                   "texts and their codes, tested on the real test split.\n\n" + markdown_table(rows, list(rows[0])))
    create_table_artifact(key=DOWNSTREAM_KEY, table=rows, description=description)


def publish_code_adherence(adherence: dict) -> None:
    """Per code column and value, how often the DP teacher scores the requested value highest
    (pipeline/stages/adherence.py): post-processing of the teacher and the synthetic data."""
    rows = []
    for c, col in adherence["columns"].items():
        rows.append({"column": c, "value": "(all)", "share": _fmt(col["share"]), "chance": _fmt(col["chance"]),
                     "samples": str(col["n"])})
        rows += [{"column": c, "value": v, "share": _fmt(x["share"]), "chance": _fmt(col["chance"]),
                  "samples": str(x["n"])} for v, x in col["values"].items()]
    description = (
        "Does the DP teacher, which wrote the text, recognise the code it was prompted with? (The downstream "
        f"classifier asks whether the text carries it for a reader.) Over {adherence['samples']} synthetic samples, "
        "the share "
        "where the DP teacher scores the requested value of a column highest among its declared values "
        f"(chance: 1/values). Every column: {_fmt(adherence['overall'])} of (sample, column) pairs; all columns of a "
        f"sample at once: {_fmt(adherence['all_columns'])}.\n\n"
        + markdown_table(rows, ["column", "value", "share", "chance", "samples"])
    )
    create_table_artifact(key=ADHERENCE_KEY, table=rows, description=description)


def publish_synthetic_sample(synthetic_dir: Path, n: int = 10, max_chars: int = 300) -> None:
    """A few synthetic texts: samples of the DP teacher (post-processing, safe to show),
    never private records."""
    table = synthetic_head(synthetic_dir, n, "train")  # reads the first shard, not the set
    rows = [
        {"control_code": code.replace("\t", " | "), "text": text[:max_chars] + ("…" if len(text) > max_chars else "")}
        for code, text in zip(table["control_code"].to_pylist(), table["text"].to_pylist())
    ]
    description = (f"The first {len(rows)} synthetic samples written by the DP teacher (not private records)\n\n"
                   + markdown_table(rows, ["control_code", "text"]))
    create_table_artifact(key=SYNTHETIC_KEY, table=rows, description=description)


def publish_report(report: Path, run_dir: Path) -> None:
    create_markdown_artifact(
        key=REPORT_KEY,
        markdown=f"# Run report\n\n[{report.name}]({report.resolve().as_uri()}): loss and ε curves, perplexity "
        f"per model, code adherence of the synthetic text, generation lengths (self-contained HTML).\n\n"
        f"Run directory: `{run_dir}`",
        description="Link to the run's report.html",
    )
