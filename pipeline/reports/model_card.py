"""Model cards: a README.md beside every saved model's weights stating its privacy guarantee.

    write_model_card(run_dir / "teacher" / "model", ledger, stage="teacher")

The card states what the run's ledger states (ε, δ, the privacy unit, the accountant, σ, q,
steps, the clipping norm C, and the mechanisms the run's total composes) and, as plainly,
what is not protected: the held-out splits, a non-private control-code release, people
with many records under record-level DP, and choices made by looking at the data.
The flow writes the cards once the run's final ledger is known.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.privacy.ledger import LedgerEntry, PrivacyLedger, current_stage_name, fmt_value
from pipeline.manifest import atomic_write_text

CARD = "README.md"

_ROLES = {
    "teacher": "the DP teacher: fine-tuned with DP-SGD on the private training split",
    "dp-student": "the DP student: the student itself fine-tuned with DP-SGD on the private training split",
    "distillation": "the distilled student: trained only on synthetic text sampled from the DP teacher "
    "and on the teacher's outputs, never on a private record (post-processing: no further privacy cost)",
}


# What the model's DP-SGD stage published from the validation split, by its teacher.monitor.
_VALIDATION = {
    "none": "Nothing computed from the private validation split is published (teacher.monitor=none: the "
            "DP-SGD stage reports ε and steps only).",
    "dp": "The DP-SGD stage's validation loss is published only as noisy releases of a Gaussian mechanism "
          "(teacher.monitor=dp), in the ledger as its own entry and composed into the total above: the "
          "validation records are covered.",
    "public": "The DP-SGD stage's validation loss is computed on records the user declared public "
              "(teacher.monitor=public, teacher.monitor_path) and published without noise; the private "
              "validation split is not read. If those records are not in fact public, nothing protects them.",
}


def _held_out(e) -> list[str]:
    """The 'Not protected' item on the held-out splits, true for the stage's teacher.monitor."""
    test = ("- **The held-out test split.** It is read without DP (the evaluation's perplexities); only "
            "aggregate figures are published from it, and no guarantee covers the records in it.")
    validation = _VALIDATION.get(e.validation_monitor)
    if validation is None:  # a ledger written before teacher.monitor existed
        return ["- **The held-out splits.** The private validation split (the DP-SGD stage's validation loss) "
                "and the test split (the evaluation's perplexities) are read without DP; only aggregate "
                "figures are published from them, and no guarantee covers the records in them."]
    return [test, f"- **The validation split.** {validation}"]

def _trained_by(ledger: PrivacyLedger, stage: str) -> LedgerEntry | None:
    """The DP-SGD entry behind a model: its own stage's, or the teacher's for a model
    computed from the teacher only (distillation); None for the ε = 0 control's student."""
    own = [e for e in ledger.entries
           if current_stage_name(e.stage) == current_stage_name(stage) and e.mechanism == "subsampled_gaussian"]
    if own:
        return own[0]
    return next((e for e in ledger.entries if e.mechanism == "subsampled_gaussian"), None)


def _public_card(run_name: str | None) -> str:
    """The card of a student distilled from the base teacher alone (distill.method=public_only)."""
    return "\n".join([
        f"# Model card{f' ({run_name})' if run_name else ''}", "",
        "This model is the ε = 0 control's student: distilled from text that the public base teacher (not "
        "fine-tuned) wrote from prompts drawn uniformly over the declared public control-code domain. No "
        "private record was read to train it: it carries no privacy cost and no guarantee is needed for it.", "",
        "## Not protected", "",
        "- **The held-out test split.** It is read without DP (the evaluation's perplexities); only aggregate "
        "figures are published from it, and no guarantee covers the records in it.",
        "- **The public base model and corpus** are not private and not covered.", ""])


def model_card(ledger: PrivacyLedger, stage: str, run_name: str | None = None) -> str:
    """The card's Markdown for the model made by `stage` ('teacher', 'dp-student' for the
    DP-SGD baselines' student, 'distillation' for the distilled student)."""
    e = _trained_by(ledger, stage)
    if e is None:
        return _public_card(run_name)
    total = ledger.total
    role = _ROLES.get(current_stage_name(stage), stage)
    lines = [
        f"# Model card{f' ({run_name})' if run_name else ''}",
        "",
        f"This model is {role}.",
        "",
        "## Privacy guarantee",
        "",
    ]
    if total is not None:
        lines += [
            f"The run that made it is (ε = {total.epsilon:.4g}, δ = {total.delta:.3g})-differentially private "
            f"per **{e.privacy_unit or 'record'}** for everything it releases through DP mechanisms "
            f"({total.composition}). {total.note[0].upper() + total.note[1:]}.",
            "",
            f"That ε is add/remove-one: it bounds what the model tells about whether a {e.privacy_unit or 'record'} "
            f"is in the data. The number of {e.privacy_unit or 'record'}s is published, so the bound that "
            f"still holds against someone who knows it is the replace-one ε (one {e.privacy_unit or 'record'} "
            f"replaced by another): **ε = {fmt_value(total.epsilon_replace_one)}** at the same δ "
            "(dp-accounting's PLD accountant).",
            "",
        ]
    if stage == "distillation":
        lines += ["The model is post-processing of the DP teacher below: its guarantee is the teacher's "
                  "(and the run's total above), whatever the number of synthetic samples or epochs.", ""]
    lines += [
        f"DP-SGD training stage behind this model (`{e.stage}` in the run's `ledger.json`, "
        "figures reported by the Opacus accountant):",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| ε (this stage, add/remove-one) | {fmt_value(e.epsilon)} |",
        f"| ε (this stage, replace-one; dp-accounting PLD) | {fmt_value(e.epsilon_replace_one)} |",
        f"| δ | {fmt_value(e.delta)} |",
        f"| privacy unit | {e.privacy_unit} |",
        f"| accountant | {e.accountant} (RDP cross-check ε = {fmt_value(e.epsilon_rdp)}) |",
        f"| noise multiplier σ | {fmt_value(e.noise_multiplier)} |",
        f"| sampling rate q (Poisson) | {fmt_value(e.sample_rate)} |",
        f"| steps | {fmt_value(e.steps)} |",
        f"| clipping norm C (max_grad_norm) | {fmt_value(e.max_grad_norm)} |",
        *([f"| lm_head | untied from the input embedding for DP-SGD: +{e.untied_parameters:,} parameters "
           "(a tied weight would get one clipping norm per use) |"] if e.untied_parameters else []),
        "",
        "Mechanisms of the run (its ledger):",
        "",
    ]
    for x in ledger.entries:
        eps = "not DP" if not x.private else f"ε = {fmt_value(x.epsilon)}, replace-one {fmt_value(x.epsilon_replace_one)}"
        lines.append(f"- `{x.stage}` ({eps}{f', {x.mechanism}' if x.mechanism else ''}): {x.note}")
    if total is not None:
        lines.append(f"- **total**: ε = {total.epsilon:.4g} (replace-one {fmt_value(total.epsilon_replace_one)}), "
                     f"δ = {total.delta:.3g}, {total.accountant} accountant; "
                     f"{'complete' if total.complete else 'INCOMPLETE'}")
    lines += ["", "## Not protected", ""]
    lines += _held_out(e)
    for x in ledger.entries:
        if not x.private:
            lines.append(f"- **`{x.stage}` is released without DP**; the ledger says: {x.note}.")
    if e.privacy_unit != "user":
        lines.append(
            "- **People with many records.** The unit is one record (no `data.user_column`): a person with "
            "k records is protected only at group-privacy level, about k·ε, with a δ that grows with k."
        )
    lines += [
        "- **Hyperparameter choices.** The learning rate, epochs, batch size, clipping norm, ε and the other "
        "settings were chosen outside the accounting; if they were tuned by looking at results on this "
        "private data, that tuning leaks something the ledger does not count.",
        "- **The public base model and corpus** are not private and not covered; what the model says about "
        "text it saw in pre-training is outside this guarantee.",
        "",
    ]
    return "\n".join(lines)


def write_model_card(model_dir: Path, ledger: PrivacyLedger, *, stage: str, run_name: str | None = None) -> Path:
    """Write `model_dir/README.md` (atomically) for the model made by `stage`."""
    path = Path(model_dir) / CARD
    atomic_write_text(path, model_card(ledger, stage, run_name))
    return path
