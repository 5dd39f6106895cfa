"""Prefect artifacts of a run: the privacy ledger and the metrics, never a private record."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from pipeline.generate import GenerateResult
from pipeline.ledger import LedgerEntry

LEDGER_KEY = "privacy-ledger"
SUMMARY_KEY = "privacy-summary"
METRICS_KEY = "metrics"


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def ledger_summary(ledger: list[LedgerEntry]) -> str:
    dp = [e for e in ledger if e.private and e.epsilon]
    lines = ["# Privacy ledger", ""]
    for e in dp:
        lines.append(
            f"- **{e.stage}**: (ε = {e.epsilon:.4f}, δ = {e.delta:.3g})-DP at the level of one "
            f"{e.privacy_unit}, {e.accountant} accountant, σ = {e.noise_multiplier:.4f}, "
            f"q = {e.sample_rate:.4g}, {e.steps} steps, clipping norm {e.max_grad_norm}."
        )
    for e in ledger:
        if not e.private:
            lines.append(f"- **{e.stage}** (not private): {e.note}")
    lines.append("")
    lines.append(
        "Generation, distillation and evaluation only post-process the DP teacher (ε = 0). "
        "Every model released by this run is covered by the teacher's guarantee, apart from "
        "what the non-private entries above release."
    )
    return "\n".join(lines)


def publish_ledger(ledger: list[LedgerEntry]) -> None:
    rows = [{k: _fmt(v) for k, v in e.model_dump().items()} for e in ledger]
    create_table_artifact(key=LEDGER_KEY, table=rows, description="Privacy ledger: one row per stage")
    create_markdown_artifact(key=SUMMARY_KEY, markdown=ledger_summary(ledger), description="Privacy guarantee")


def publish_metrics(metrics: dict, synthetic: GenerateResult) -> None:
    rows = [
        {
            "model": name,
            "windowed_perplexity": _fmt(m["windowed"]),
            "per_record_mean": _fmt(m["per_record_mean"]),
            "per_record_median": _fmt(m["per_record_median"]),
            "test_tokens": m["tokens"],
        }
        for name, m in metrics["perplexity"].items()
    ]
    create_table_artifact(
        key=METRICS_KEY,
        table=rows,
        description=f"Perplexity on the held-out test split ({metrics['window']}-token windows); "
        f"{synthetic.n_samples} synthetic samples",
    )
