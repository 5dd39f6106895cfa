"""What a run shows people: the HTML report and the model cards."""

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# What the flow records in stages.json (flows/stage_runner.py StageRunner) as people read it,
# in the report and in `dpdistill status` alike (issue 24: one said "finished", the other "ran").
STAGE_WORDS = {"ran": "finished", "forced": "finished (forced rerun)", "cached": "cached", "failed": "failed",
               "running": "running"}

# The criteria a distillation candidate is scored by (pipeline/stages/selection.py), in the
# order the report and the artifact show them.
SELECTION_CRITERIA = ("teacher_kl", "untruncated_ce", "synthetic_validation_ce", "private_validation")


def table_keys(selection: dict) -> list[str]:
    """The columns of a selection table (report, artifact): the criteria computed, then test_perplexity
    (and test_text_perplexity, where the evaluation gave it)."""
    rows = selection["candidates"]
    text = ["test_text_perplexity"] if any(r.get("test_text_perplexity") is not None for r in rows) else []
    return [k for k in SELECTION_CRITERIA if any(r.get(k) is not None for r in rows)] + ["test_perplexity", *text]


def privacy_sentence(selection: dict) -> str:
    """What the choice cost, in words, for the report and the artifact."""
    private = selection.get("private_validation")
    if not private:
        return "No criterion reads a private record: the choice costs no privacy."
    splits = private.get("splits", "validation")  # selections made before the training split could score
    return (f"private_validation is each student's mean per-token loss on the first {private['units']} units of the "
            f"PRIVATE {splits} split{'s' if ' and ' in splits else ''}, clipped to [0, {private['clip']:g}] nats, plus Gaussian noise of sd "
            f"{private['noise_sd']:.3g} (only these noisy values are published): a DP release of ε = "
            f"{private['epsilon']:.3g} at δ = {private['delta']:.3g}, in the ledger as 'distillation-selection' "
            "and composed into the total. The other criteria read DP outputs only.")


def read_json(path: Path) -> dict | None:
    """The file's JSON, or None when it is missing or unreadable (a stage may still be writing)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("report: %s is unreadable (%s); its part of the report is skipped", path, type(e).__name__)
        return None
