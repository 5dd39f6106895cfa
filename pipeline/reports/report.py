"""The run report: one self-contained `report.html` per run directory, built from what the run wrote.

It reads aggregates and logs only (metrics.json, ledger.json, the training logs, the stage
manifests, run.json and stages.json, config.yaml and the numeric columns of the synthetic
shards) and never opens `data/`, so it cannot show a private record. Plots are matplotlib
figures inlined as SVG: no network, no external script or style. A stage that did not run,
or has not finished, is skipped with a short note, so a report can be written for a partly
finished run.

    from pipeline.reports.report import write_report, write_comparison_report
    write_report(Path("runs/demo-20261121-064807"))          # -> .../report.html
    write_comparison_report({"ours": run_a, "DP-SGD": run_b}, Path("runs/reference/report.html"))
"""

from __future__ import annotations

import html
import io
import logging
import os
from collections.abc import Callable
from pathlib import Path

import matplotlib
import pyarrow.parquet as pq
import yaml
from matplotlib.figure import Figure

from pipeline.prompts import codes_windowed
from pipeline.privacy.ledger import ADJACENCY_NOTE, LEDGER, fmt_value, read_ledger, table_rows
from pipeline.manifest import MANIFEST, atomic_write_text
from pipeline.methods import METHODS
from pipeline.reports import STAGE_WORDS, privacy_sentence, read_json, table_keys
from pipeline.reports.methods import DIRECT, peers, scored, verdict

log = logging.getLogger(__name__)

REPORT = "report.html"
STAGES = ("data", "control_codes", "teacher", "synthetic", "student", "evaluation")
MAX_CODES_PLOTTED = 40  # a bar per code value stays readable up to about this many
_SYNTHETIC_COLUMNS = ("n_tokens", "n_prompt_tokens", "finished")  # numeric only: never the text
_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
/* A wide table (the ledger has 12 columns) scrolls inside its own box instead of widening the
   page. Headers and numbers stay whole ('anywhere' broke them: "finishe|d", "epsil|on"); a text
   cell breaks between words, and inside a word only when the word alone is wider than the box
   (a long path). */
.table-wrap { max-width: 100%; overflow-x: auto; }
th, td.num { white-space: nowrap; } td { overflow-wrap: break-word; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } th { background: #f4f4f4; }
.note { color: #666; font-style: italic; } .warn { color: #a40000; font-weight: bold; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
figure { margin: 0.8em 0; } svg { max-width: 100%; height: auto; }
"""


# ---------------------------------------------------------------- small HTML helpers

def _esc(x) -> str:
    return html.escape(str(x))


def _note(text: str, cls: str = "note") -> str:
    return f'<p class="{cls}">{_esc(text)}</p>'


def _table(header: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        num = isinstance(v, (int, float)) and not isinstance(v, bool)
        return f'<td class="num">{_esc(fmt_value(v))}</td>' if num else f"<td>{_esc(fmt_value(v))}</td>"

    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in r) + "</tr>" for r in rows)
    return f'<div class="table-wrap"><table><tr>{head}</tr>{body}</table></div>'


def _page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_esc(title)}</title><style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def _svg(fig: Figure, name: str) -> str:
    """The figure as inline SVG; `name` salts its ids so that figures in one page never share one."""
    buf = io.StringIO()
    # Text stays text (small, searchable); no date or creator, so the same run gives the same report.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        fig.savefig(buf, format="svg", bbox_inches="tight",
                    metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    return f"<figure>{svg[svg.index('<svg'):]}</figure>"  # no XML declaration or DOCTYPE inside HTML


# ---------------------------------------------------------------- the sections of a run report

def _flow_stages(run_dir: Path, writer_alive: bool) -> str | None:
    """The stage table from stages.json, the flow's own record of each stage (None: no such file,
    e.g. a directory made by hand). A failed, interrupted or cached stage often has no manifest in
    this directory, so the manifests alone would call it "not run"."""
    stages = read_json(run_dir / "stages.json")
    if not isinstance(stages, dict):
        return None
    running = (read_json(run_dir / "run.json") or {}).get("status") == "running" and writer_alive
    rows, warnings = [], []
    for name, s in stages.items():
        status = s.get("status")
        if status == "running" and not running:
            status = "interrupted"
            warnings.append(f"The run was interrupted during stage {name} (its process is gone): "
                            "run the same command again to continue it.")
        elif status == "failed":
            warnings.append(f"Stage {name} failed: the run's log says why.")
        out = s.get("output")
        if out and Path(out).resolve().is_relative_to(run_dir.resolve()):
            out = str(Path(out).resolve().relative_to(run_dir.resolve()))
        elif out:
            out = f"reused from {out}"
        rows.append([name, STAGE_WORDS.get(status, status), s.get("seconds"), s.get("finished_at"), out])
    table = _table(["stage", "status", "seconds", "finished at", "output"], rows)
    notes = "".join(_note(w, "warn") for w in warnings)
    return notes + table + _note("A stage not listed has not started (or this method has no such stage).")


def _overview(run_dir: Path, metrics: dict | None, writer_alive: bool) -> str:
    method = (metrics or {}).get("method")
    if method:
        head = f"<p>Method: <b>{_esc(method)}</b></p>"
    else:
        head = _note("metrics.json is missing: the run has not finished.")
    if (table := _flow_stages(run_dir, writer_alive)) is not None:
        return head + table
    rows = []
    for stage in STAGES:
        manifest = read_json(run_dir / stage / MANIFEST)
        if manifest is not None:
            rows.append([stage, "finished", manifest.get("finished_at")])
        elif (run_dir / stage).is_dir():
            rows.append([stage, "started, not finished (no manifest)", None])
        else:
            rows.append([stage, "not run", None])
    return head + _table(["stage", "status", "finished at"], rows)


def _privacy(run_dir: Path) -> str:
    if not (run_dir / LEDGER).exists():
        return _note("No ledger.json yet (it is written once the first DP stage finishes).")
    ledger = read_ledger(run_dir / LEDGER)
    cols = ["stage", "guarantee", "epsilon", "epsilon_replace_one", "delta", "accountant", "mechanism",
            "noise_multiplier", "sample_rate", "steps", "max_grad_norm", "privacy_unit", "epsilon_rdp", "epsilon_pld"]
    rows = [[row.get(c) for c in cols] for row in table_rows(ledger)]
    out = ""
    t = ledger.total
    if t is not None:
        replace_one = "" if t.epsilon_replace_one is None else f"; replace-one ε = {t.epsilon_replace_one:.4f}"
        out += f"<p><b>Total: ε = {t.epsilon:.4f}, δ = {t.delta:.3g}{replace_one}</b> ({_esc(t.composition)}).</p>"
        out += _note(t.note, "note" if t.complete else "warn")
    out += _note(ADJACENCY_NOTE)
    out += _table(cols, rows)
    notes = "".join(f"<li><b>{_esc(e.stage)}</b>: {_esc(e.note)}</li>" for e in ledger.entries)
    return out + f"<ul>{notes}</ul>"


def _is_dp_log(train_log: dict) -> bool:
    """A DP-SGD log (teacher, or a dp_sgd/dpkd student) rather than a distillation log."""
    return not any("ce" in h for h in train_log.get("history", []))


_MONITOR_SAYS = {
    "dp": "Validation loss: the noisy DP releases (teacher.monitor=dp, its own ledger entry).",
    "public": "Validation loss: on records the user declared public (teacher.monitor=public).",
}
_NOT_MONITORED = (
    "The validation loss is not monitored (teacher.monitor=none, the default): nothing computed from the "
    "private validation split is published. To chart it, set teacher.monitor=dp (a Gaussian release with "
    "its own ε, teacher.monitor_epsilon, composed into the total) or teacher.monitor=public with "
    "teacher.monitor_path (records you declare public)."
)


def _dp_training(run_dir: Path) -> str:
    logs = {}
    for stage in ("teacher", "student"):
        train_log = read_json(run_dir / stage / "training_log.json")
        if train_log is not None and train_log.get("history") and _is_dp_log(train_log):
            logs[stage] = train_log
    if not logs:
        return _note("No finished DP-SGD training log (teacher/ or a DP student) in this run.")
    # The validation loss as the stage published it (teacher.monitor), never a private batch's loss.
    curves = {s: [h for h in log["history"] if h.get("validation_loss") is not None] for s, log in logs.items()}
    monitored = any(curves.values())
    fig = Figure(figsize=(10, 3.6) if monitored else (5.5, 3.6))
    axes = fig.subplots(1, 2) if monitored else [fig.subplots()]
    eps_ax, rows = axes[-1], []
    for stage, train_log in logs.items():
        hist, val = train_log["history"], curves[stage]
        label = "teacher" if stage == "teacher" else "DP student"
        if val:
            axes[0].plot([h["step"] for h in val], [h["validation_loss"] for h in val], marker="o", label=label)
        # ε as recorded every log_every steps (Opacus' accountant; replace-one: dp-accounting's
        # PLD, in logs written since issue 38): never recomputed here.
        eps = [h for h in hist if h.get("epsilon") is not None]
        line, = eps_ax.plot([h["step"] for h in eps], [h["epsilon"] for h in eps], marker="o", label=label)
        replace_one = [h for h in eps if h.get("epsilon_replace_one") is not None]
        if replace_one:
            eps_ax.plot([h["step"] for h in replace_one], [h["epsilon_replace_one"] for h in replace_one],
                        linestyle="--", color=line.get_color(), label=f"{label}, replace-one")
        rows.append([label, len(hist), train_log.get("monitor", "-"), val[-1]["validation_loss"] if val else None,
                     eps[-1]["epsilon"] if eps else None, eps[-1].get("epsilon_replace_one") if eps else None])
    if monitored:
        axes[0].set(title="Validation loss during DP-SGD", xlabel="step", ylabel="mean token loss")
    eps_ax.set(title="ε spent (add/remove; dashed: replace-one)", xlabel="step", ylabel="ε", ylim=(0, None))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    table = _table(["model", "steps", "teacher.monitor", "final validation loss", "ε at the end",
                    "replace-one ε at the end"], rows)
    modes = {log.get("monitor") for log in logs.values()}
    says = [_MONITOR_SAYS[m] for m in sorted(modes - {None}) if m in _MONITOR_SAYS]
    notes = "".join(_note(s) for s in says) + (_note(_NOT_MONITORED) if not monitored else "")
    return _svg(fig, "dp-training") + table + notes


def _distillation(run_dir: Path) -> str:
    train_log = read_json(run_dir / "student" / "training_log.json")
    if train_log is None or not train_log.get("history"):
        return _note("No finished distillation log (student/training_log.json) in this run.")
    if _is_dp_log(train_log):
        return _note("The student was trained with DP-SGD on the private data (see DP-SGD training): no distillation.")
    hist = train_log["history"]
    steps = [h["step"] for h in hist]
    fig = Figure(figsize=(8, 3.8))
    ax = fig.subplots()
    ax.plot(steps, [h["loss"] for h in hist], label="total loss")
    ax.plot(steps, [h["ce"] for h in hist], label="CE", alpha=0.8)
    ax.plot(steps, [h["kl"] for h in hist], label="KL", alpha=0.8)
    if any(h.get("mse") for h in hist):
        ax.plot(steps, [h["mse"] for h in hist], label="MSE (hidden)", alpha=0.8)
    val = train_log.get("validation") or []
    if val:
        ax.plot([v["step"] for v in val], [v["validation_loss"] for v in val], "ko--",
                label="validation loss (synthetic)")
    ax.set(title="Distillation", xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    out = _svg(fig, "distillation")
    if train_log.get("stopped_early"):
        out += _note("Stopped early on the synthetic validation split (distill.patience).")
    return out


def _selection(metrics: dict | None) -> str:
    """The distillation candidates, each criterion's value, the chosen one (pipeline/stages/selection.py)."""
    sel = (metrics or {}).get("selection")
    if not sel:
        return ""
    keys = table_keys(sel)
    rows = [[("→ " if r["candidate"] == sel["chosen"] else "") + r["candidate"]] + [r.get(k) for k in keys]
            for r in sel["candidates"]]
    out = "<h3>Choosing the student</h3>" + _table(["candidate"] + keys, rows)
    out += _note(
        f"Kept: {sel['chosen']}, the lowest {sel['select_by']}. Each candidate's student was scored on "
        f"{sel['selection_samples']} texts the DP teacher sampled without top-k/top-p truncation (its whole "
        "distribution): teacher_kl is the mean per-token KL(teacher ‖ student) there, untruncated_ce the student's "
        "cross-entropy there; synthetic_validation_ce is the CE on the truncated synthetic validation split. "
        f"{privacy_sentence(sel)} test_perplexity (where shown) was computed after "
        "the choice, for the study below, and never used to choose.")
    study, text = sel.get("criterion_study") or {}, sel.get("criterion_study_text") or {}
    if study:
        header = ["criterion", "Spearman ρ with test perplexity", "would choose", "regret (perplexity)"]
        rows = [[c, v["spearman"], v["chooses"], v["regret"]] for c, v in study.items()]
        if text:
            header += ["ρ, text alone", "would choose, text alone", "regret, text alone"]
            rows = [r + [text.get(r[0], {}).get(k) for k in ("spearman", "chooses", "regret")] for r in rows]
        out += _table(header, rows)
        if text:
            out += _note("Text alone: the same test perplexity with the control-code header left out of the "
                         "targets. On the header the KL fits the DP teacher's prediction of the codes and the "
                         "cross-entropy part, (1 - α), the codes each sample was prompted with: a candidate with "
                         "α < 1 can win on the windowed figure by the header alone, a large share of a short record.")
    return out


def _downstream(metrics: dict | None) -> str:
    """A classifier trained on the synthetic text, tested on the real test split (pipeline/stages/downstream.py)."""
    ds = (metrics or {}).get("downstream")
    mauve = (metrics or {}).get("mauve")
    mauve_note = "" if not mauve else _note(
        f"MAUVE of the synthetic against the real test texts: {mauve['mauve']:.3f} ({mauve['texts']} texts a side, "
        f"features: {mauve['features']}; 1 = indistinguishable).")
    if not ds:
        return mauve_note
    rows = []
    for column, c in ds["columns"].items():
        if "skipped" in c:
            rows.append([column, None, None, None, None, None, c["skipped"]])
            continue
        ref = c["real_reference"] or {}
        rows.append([column, c["synthetic"]["accuracy"], c["synthetic"]["macro_f1"], ref.get("macro_f1"),
                     c["majority"]["accuracy"], c["chance_macro_f1"], "at chance" if c["at_chance"] else ""])
    return ("<h3>Does the synthetic text serve a downstream task?</h3>"
            + _table(["code column", "accuracy (trained on synthetic)", "macro-F1 (trained on synthetic)",
                      "macro-F1, real reference", "majority-class accuracy", "chance macro-F1", ""], rows)
            + _note(f"{ds['classifier']}: trained on synthetic texts with the codes they were prompted with, tested on "
                    "the real test split; the real reference is the same classifier cross-validated on the test split "
                    "(5 folds). Chance: the better macro-F1 of the majority class and of random labels (1/values)."
                    + (f" What it measures: {ds['measures']}." if ds.get("measures") else ""))
            + mauve_note)


def _perplexity(metrics: dict | None) -> str:
    ppl = (metrics or {}).get("perplexity")
    if not ppl:
        return _note("No evaluation results (metrics.json has no perplexity yet).")
    names = list(ppl)
    values = [ppl[n]["windowed"] for n in names]
    fig = Figure(figsize=(max(5, 1.3 * len(names)), 3.6))
    ax = fig.subplots()
    bars = ax.bar(names, values, color=["#999" if n.startswith("base_") else "#3465a4" for n in names])
    ax.bar_label(bars, fmt="%.1f")
    ax.set(title=f"Test perplexity, {metrics.get('window', '?')}-token windows (lower is better)",
           ylabel="perplexity")
    ax.tick_params(axis="x", labelrotation=15)
    keys = ["windowed", "per_record_mean", "per_record_median", "per_record_token_weighted", "tokens", "records"]
    rows = []
    for n in names:
        rows.append([n, "every token"] + [ppl[n].get(k) for k in keys])
        if text := ppl[n].get("text_only"):  # absent from a run from before it
            rows.append([n, "text alone"] + [text.get(k) for k in keys])
            codes = codes_windowed(ppl[n]["windowed"], ppl[n]["tokens"], text["windowed"], text["tokens"])
            if codes is not None:
                rows.append([n, "the codes alone", codes] + [None] * 3 + [ppl[n]["tokens"] - text["tokens"], None])
    header = ["model", "targets"] + keys
    note = _note("Windowed: non-overlapping windows of the joined test records. Per record: each record scored "
                 "alone; the mean and median of the records' perplexities, and token-weighted (the records' total "
                 "NLL over their total tokens). Text alone: the same passes without the codes' tokens (header or "
                 "prompt) as targets; the codes alone: those only. A header is trained like the text; no loss "
                 "trains a prompt's tokens. Either way they weigh on a short record: the text alone measures the text.")
    warnings = "".join(_note("Warning: " + line, "warn") for line in metrics.get("diagnostics", []))
    return warnings + _svg(fig, "perplexity") + _table(header, rows) + note + _selection(metrics)


def _code_adherence(metrics: dict | None) -> str:
    """Per code column, the share of synthetic samples whose requested value the DP teacher
    scores highest (pipeline/stages/adherence.py), per requested value, against chance (1/|values|)."""
    adh = (metrics or {}).get("code_adherence")
    if not adh:
        return _note("No code adherence in metrics.json (evaluate.adherence_samples=0, or a run from before it).")
    columns = {c: col for c, col in adh["columns"].items() if col["n"]}
    if not columns:
        return _note("Code adherence scored no sample (no code column has two or more declared values).")
    shown = {c: list(col["values"])[:MAX_CODES_PLOTTED] for c, col in columns.items()}
    fig = Figure(figsize=(9, 1.0 + sum(0.9 + 0.26 * len(v) for v in shown.values())))
    axes = fig.subplots(len(columns), 1, squeeze=False,
                        gridspec_kw={"height_ratios": [1 + len(v) for v in shown.values()]})[:, 0]
    for ax, (c, col) in zip(axes, columns.items()):
        values = shown[c]
        shares = [col["values"][v]["share"] or 0.0 for v in values]
        bars = ax.barh(range(len(values)), shares, color="#3465a4")
        ax.bar_label(bars, labels=[f"n={col['values'][v]['n']}" for v in values], fontsize=7, padding=2)
        ax.axvline(col["chance"], color="#a40000", linestyle="--", label=f"chance ({col['chance']:.2f})")
        ax.set_yticks(list(range(len(values))), values, fontsize=8)
        ax.invert_yaxis()
        ax.set(xlim=(0, 1.1), title=f"{c}: requested value scored highest in {col['share']:.0%} of "
               f"{col['n']} samples", xlabel="share of samples that requested the value")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Does the DP teacher recognise the code it was prompted with? (its choice among the values)")
    fig.tight_layout()
    out = _svg(fig, "code-adherence")
    rows = [[c, col["share"], col["chance"], col["n"]] for c, col in columns.items()]
    rows.append(["(every scored column, pairs)", adh.get("overall"), None, adh.get("samples")])
    rows.append(["(all columns of a sample at once)", adh.get("all_columns"), None, adh.get("samples")])
    out += _table(["column", "share requested value wins", "chance", "samples"], rows)
    per_value = [[c, v, x["share"], x["n"], x["n"] / col["n"]] for c, col in columns.items()
                 for v, x in col["values"].items()]
    out += _table(["column", "value", "share requested value wins", "samples that requested it",
                   "requested share"], per_value)
    out += _note(
        f"The first {adh.get('samples')} synthetic training samples: for each code column, the DP teacher scores the "
        "sample's text under the prompt with that column set to each declared value, the others as requested; "
        "a sample counts when the requested value scores strictly highest (n=0: no sample requested the value). "
        f"{adh.get('truncated', 0)} sample(s) had their text cut to fit the teacher's context (the same cut for every "
        f"value), {adh.get('skipped', 0)} were skipped (no text left to score)."
        + (f" What it measures: {adh['measures']}." if adh.get("measures") else "")
    )
    hidden = sum(len(col["values"]) - len(shown[c]) for c, col in columns.items())
    if hidden:
        out += _note(f"{hidden} further values are not plotted (more than {MAX_CODES_PLOTTED} in a column).")
    return out


def _synthetic_lengths(run_dir: Path) -> tuple[list[int], int]:
    """Generated tokens per kept sample (without prompt and EOS), and how many samples ended with
    EOS, from the numeric columns of the shards only."""
    files = sorted(p for p in (run_dir / "synthetic").glob("*.parquet") if not p.name.startswith("."))
    lengths: list[int] = []
    finished = 0
    for f in files:
        names = pq.ParquetFile(f).schema_arrow.names
        if "n_tokens" not in names:
            continue
        cols = pq.read_table(f, columns=[c for c in _SYNTHETIC_COLUMNS if c in names]).to_pydict()
        prompt = cols.get("n_prompt_tokens") or [0] * len(cols["n_tokens"])
        eos = cols.get("finished") or [False] * len(cols["n_tokens"])
        lengths += [n - p - int(e) for n, p, e in zip(cols["n_tokens"], prompt, eos)]
        finished += sum(eos)
    return lengths, finished


def _lengths(run_dir: Path, metrics: dict | None) -> str:
    props = (metrics or {}).get("text_properties") or {}
    lengths, finished = _synthetic_lengths(run_dir)
    out = ""
    if lengths:
        real = (props.get("real_test") or {}).get("tokens") or {}
        fig = Figure(figsize=(8, 3.6))
        ax = fig.subplots()
        ax.hist(lengths, bins=min(40, max(5, len(set(lengths)))), color="#3465a4", alpha=0.8,
                label=f"synthetic ({len(lengths)} samples)")
        # The real test texts appear only as the summaries evaluation already published.
        for stat, style in (("mean", ":"), ("median", "--"), ("p90", "-.")):
            if stat in real:
                ax.axvline(real[stat], color="#a40000", linestyle=style, label=f"real test {stat} ({real[stat]:.0f})")
        ax.set(title="Generation length", xlabel="generated tokens per sample", ylabel="samples")
        ax.legend(fontsize=8)
        out += _svg(fig, "lengths")
        out += _note(f"{finished} of {len(lengths)} samples ended with EOS; the others stopped at the "
                     "generation length limit (generate.max_length / max_new_tokens).")
    else:
        out += _note("No synthetic shards with token counts in synthetic/.")
    if props:
        rows = [[name, p.get("texts"), p.get("distinct_1"), p.get("distinct_2"),
                 *((p.get("tokens") or {}).get(k) for k in ("mean", "median", "p90"))] for name, p in props.items()]
        out += _table(["texts", "count", "distinct-1", "distinct-2", "tokens mean", "median", "p90"], rows)
    return out


def _generation(run_dir: Path, metrics: dict | None) -> str:
    gen = (metrics or {}).get("generation")
    out = ""
    if gen:
        keys = ["samples", "validation_samples", "dropped_empty", "new_tokens_per_second", "shards", "resumed_shards"]
        out += _table(keys, [[gen.get(k) for k in keys]]) + _code_adherence(metrics) + _downstream(metrics)
    elif (method := _method(run_dir, metrics)) in METHODS and not METHODS[method].generates:
        return _note("This run has no generation stage (its method trains the student on the private data).")
    else:
        out += _note("The generation stage has not finished (no generation summary in metrics.json yet).")
    return out + _lengths(run_dir, metrics)


def _method(run_dir: Path, metrics: dict | None) -> str | None:
    """distill.method, from metrics.json or, before the run has finished, from config.yaml."""
    if (metrics or {}).get("method"):
        return metrics["method"]
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        return cfg["distill"]["method"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


def _methods(run_dir: Path) -> str:
    """This run's student beside the other methods' runs on the same test split (pipeline/reports/methods.py)."""
    runs = peers(run_dir)
    text = verdict(runs)
    if text is None:
        return _note("No finished run of another distill.method on the same test split, student and window beside "
                     "this one in its run root. To see whether distillation pays on this data, run the same config "
                     "with distill.method=dp_sgd (minutes, no teacher or generation; it spends its own ε on the "
                     "same records); this section then compares them.")
    rows = [[r.run + (" (this run)" if r.run == run_dir.name else ""), r.method, r.perplexity, r.text_perplexity,
             r.epsilon] for r in runs]
    cls = "warn" if DIRECT in text else "note"
    header = ["run", "method", "student windowed test perplexity", "on the text alone", "ε (ledger total)"]
    return _note(text, cls) + _table(header, rows) + _note(
        "On the text alone: the control-code header left out of the targets. The two figures can rank the methods "
        "differently: DP-SGD trains on whole records, header included, the distillation learns the header from the "
        "DP teacher's prediction of it, and the windowed figure also scores tokens across record boundaries "
        "(docs/pipeline.md, \"When to distil\").")


def _timings(metrics: dict | None) -> str:
    seconds = (metrics or {}).get("seconds")
    if not seconds:
        return _note("No stage timings (metrics.json has no seconds yet).")
    rows = [[stage, s] for stage, s in seconds.items()] + [["total", round(sum(seconds.values()), 2)]]
    per_record = (metrics or {}).get("seconds_per_training_record") or {}
    note = "".join(_note(f"{stage}: {s:g} s per training record (the stage's wall time over the training split's "
                         "size, this run; a cached stage has none).") for stage, s in per_record.items())
    return _table(["stage", "seconds"], rows) + note


def _config(run_dir: Path) -> str:
    path = run_dir / "config.yaml"
    if not path.exists():
        return _note("No config.yaml in this run directory.")
    return f"<pre>{_esc(path.read_text())}</pre>"


def _render(title: str, build: Callable[[], str]) -> str:
    """One section; a part that cannot be drawn becomes a note instead of failing the report."""
    try:
        body = build()
    except Exception as e:  # noqa: BLE001  (the report must never fail a finished run)
        log.warning("report: section %r could not be drawn", title, exc_info=True)
        body = _note(f"This section could not be drawn ({type(e).__name__}); see the run's log.", "warn")
    return f"<section><h2>{_esc(title)}</h2>\n{body}\n</section>\n"


def write_report(run_dir: Path, writer_alive: bool = False) -> Path:
    """Write `run_dir/report.html` from what the run directory holds, atomically; returns its path.

    `writer_alive`: whether the process that runs this run directory still runs
    (flows/run_info.py `run_alive`); without it a stage that stages.json records as running
    is reported as interrupted. The flow writes its report once its stages have ended."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist; pass the directory a run wrote")
    metrics = read_json(run_dir / "metrics.json")
    sections = [
        ("Run", lambda: _overview(run_dir, metrics, writer_alive)),
        ("Privacy ledger", lambda: _privacy(run_dir)),
        ("DP-SGD training", lambda: _dp_training(run_dir)),
        ("Distillation", lambda: _distillation(run_dir)),
        ("Perplexity per model", lambda: _perplexity(metrics)),
        ("Which method wins on this data", lambda: _methods(run_dir)),
        ("Generation", lambda: _generation(run_dir, metrics)),
        ("Stage timings", lambda: _timings(metrics)),
        ("Config", lambda: _config(run_dir)),
    ]
    body = f"<h1>dpdistill run {_esc(run_dir.name)}</h1>\n" + "".join(_render(t, b) for t, b in sections)
    path = run_dir / REPORT
    atomic_write_text(path, _page(f"dpdistill {run_dir.name}", body))
    log.info("report: %s", path)
    return path


# ---------------------------------------------------------------- several runs side by side

def _run_row(label: str, run: Path, out_dir: Path) -> dict:
    metrics = read_json(run / "metrics.json") or {}
    ppl = metrics.get("perplexity") or {}
    method = metrics.get("method")
    total = read_ledger(run / LEDGER).total if (run / LEDGER).exists() else None
    report = run / REPORT
    return {
        "label": label,
        "method": method,
        "student": (ppl.get(f"student_{method}") or {}).get("windowed"),
        "dp_teacher": (ppl.get("dp_teacher") or {}).get("windowed"),
        "zero_shot": (ppl.get("base_student") or {}).get("windowed"),
        "epsilon": total.epsilon if total else None,
        "epsilon_replace_one": total.epsilon_replace_one if total else None,
        "complete": total.complete if total else None,
        "seconds": round(sum((metrics.get("seconds") or {}).values()), 1) if metrics.get("seconds") else None,
        "report": os.path.relpath(report, out_dir) if report.exists() else None,
    }


def write_comparison_report(run_dirs: dict[str, Path], out: Path) -> Path:
    """One page comparing runs (e.g. one per `distill.method`): student perplexity per method and a table."""
    out = Path(out)
    rows = [_run_row(label, Path(run), out.parent) for label, run in run_dirs.items()]
    done = [r for r in rows if r["student"] is not None]
    body = "<h1>dpdistill: perplexity per method</h1>\n"
    if done:
        fig = Figure(figsize=(max(5, 1.3 * len(done)), 3.6))
        ax = fig.subplots()
        bars = ax.bar([r["label"] for r in done], [r["student"] for r in done], color="#3465a4")
        ax.bar_label(bars, fmt="%.1f")
        zero = next((r["zero_shot"] for r in done if r["zero_shot"] is not None), None)
        if zero is not None:
            ax.axhline(zero, color="#999", linestyle="--", label=f"zero-shot base student ({zero:.1f})")
            ax.legend()
        ax.set(title="Student test perplexity per method (windowed, lower is better)", ylabel="perplexity")
        ax.tick_params(axis="x", labelrotation=15)
        body += _svg(fig, "comparison")
    else:
        body += _note("None of these runs has finished its evaluation yet.")
    header = ["run", "method", "student ppl", "DP teacher ppl", "zero-shot ppl", "ε (ledger total)",
              "ε replace-one", "ε complete", "seconds"]
    table_rows = "".join(
        "<tr>" + "".join(f"<td>{_esc(fmt_value(r[k]))}</td>" for k in
                         ("label", "method", "student", "dp_teacher", "zero_shot", "epsilon", "epsilon_replace_one",
                          "complete", "seconds"))
        + (f'<td><a href="{_esc(r["report"])}">report</a></td>' if r["report"] else "<td>–</td>") + "</tr>"
        for r in rows
    )
    body += ('<div class="table-wrap"><table><tr>' + "".join(f"<th>{_esc(h)}</th>" for h in header + ["report"])
             + f"</tr>{table_rows}</table></div>")
    if text := verdict([s for run in run_dirs.values() if (s := scored(Path(run))) is not None]):
        body += _note(text, "warn" if DIRECT in text else "note")
    body += _note("ε complete = NO: the run released something not differentially private (the exact control-code "
                  "counts); its ε covers the DP stages only.")
    atomic_write_text(out, _page("dpdistill: perplexity per method", body))
    return out
