"""The privacy-utility figure of issue 59 item 6: the student's test perplexity against the run's
total ε, for ours, DP-SGD of the student and the ε = 0 control, with the base and DP teachers as
reference lines, drawn from the tracked results of experiments/utility.py (never from a run root).

    .venv/bin/python experiments/privacy_utility.py --results docs/results/utility.jsonl \
        --config-name smollm2-airline --out docs/img/privacy_utility.png
    .venv/bin/python experiments/privacy_utility.py --report-only   # the figure's points as a table

The sweep's runs: `experiments/utility.py --epsilon E` for E in 0.5, 1, 2, 4, 8 (the main rows,
at the config's own ε, count as theirs). x is each run's ledger total ε (add/remove), y its
student's test perplexity: on the text alone (left) and windowed (right); mean ± sd over runs.

The windowed figure of a prompted row also scores the chat prompt's tokens, which no loss trains
(pipeline/prompts.py). Both figures come from the same forward passes, so the prompt's tokens alone
have a perplexity too: exp((N·ln W − Nₜ·ln Wₜ) / (N − Nₜ)), W and Wₜ the windowed figures, N and Nₜ
their predicted tokens (pipeline/prompts.py `codes_windowed`). The counts are in each run's
metrics.json, not in the results line: experiments/utility.py copies them into
docs/results/utility_tokens.jsonl after each run (one line per run, keyed by its run directory;
`--record-tokens` does it for runs made before), and the table gains that row (for a header row: the
header's tokens, which every loss trains).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.shared import config_path, lock_of, mean_sd, read_results, split_stale, stale_note  # noqa: E402
from pipeline.prompts import codes_windowed  # noqa: E402

FIGURES = (("student_text_windowed", "dp_teacher_text", "base_teacher_text", "on the text alone"),
           ("student", "dp_teacher", "base_teacher", "windowed"))
SWEEP = (0.5, 1, 2, 4, 8)  # the target ε of the sweep (docs/utility.md)
LINES = (("ours", "ours (distilled from the DP teacher)", "tab:blue"),
         ("dp-sgd", "DP-SGD of the student", "tab:red"))
CODES = "codes"  # the key of the student's perplexity on the codes' tokens alone (from the counts)


def tokens_path(results: Path) -> Path:
    """Where the token counts of the runs in `results` are kept: docs/results/utility_tokens.jsonl."""
    return results.with_name(f"{results.stem}_tokens.jsonl")


def token_counts(run_dir: Path) -> dict:
    """The student's windowed predicted tokens, all and on the text alone, from its run's metrics."""
    import json

    ppl = json.loads((Path(run_dir) / "metrics.json").read_text())["perplexity"]
    student = [v for k, v in ppl.items() if k.startswith("student")]
    if len(student) != 1:
        raise ValueError(f"{run_dir}/metrics.json: expected one student's perplexity, found {len(student)}")
    return {"tokens": student[0]["tokens"], "text_tokens": student[0]["text_only"]["tokens"]}


def record_tokens(results: Path, tokens: Path) -> list[str]:
    """Append each results line's counts not yet in `tokens`; the run directories it could not read.
    Under the file's lock: two studies that finish a run together append each run once."""
    import json

    from pipeline.locks import file_lock

    missing = []
    with file_lock(lock_of(tokens)):
        done = {t["run_dir"] for t in read_results(tokens)}
        for r in read_results(results):
            if r["run_dir"] in done:
                continue
            try:
                line = {"run_dir": r["run_dir"], **token_counts(r["run_dir"])}
            except (OSError, ValueError, KeyError) as e:
                missing.append(f"{r['run_dir']}: {type(e).__name__}: {e}")
                continue
            with tokens.open("a") as f:
                f.write(json.dumps(line) + "\n")
            done.add(r["run_dir"])
    return missing


def with_codes(results: list[dict], counts: list[dict]) -> list[dict]:
    """Each run with its student's perplexity on the codes' tokens alone (the prompt or the
    header) where its counts are recorded."""
    by_dir = {c["run_dir"]: c for c in counts}
    out = []
    for r in results:
        c = by_dir.get(r["run_dir"])
        if c and r.get("student") and r.get("student_text_windowed"):
            codes = codes_windowed(r["student"], c["tokens"], r["student_text_windowed"], c["text_tokens"])
            r = r if codes is None else {**r, CODES: codes}
        out.append(r)
    return out


def by_target(results: list[dict], key: str, row: str) -> dict[float | None, list[dict]]:
    """`row`'s runs that have `key`, by their target ε (None: the config's own, about 2)."""
    groups: dict[float | None, list[dict]] = {}
    for r in results:
        if r["row"] == row and r.get(key) is not None:
            groups.setdefault(r.get("target_epsilon"), []).append(r)
    return groups


def series(results: list[dict], key: str, row: str) -> list[tuple[float, float, float]]:
    """(mean ledger ε, mean, sd) of `key` for `row`'s runs at each target ε, by ε."""
    out = []
    for runs in by_target(results, key, row).values():
        ys = [r[key] for r in runs]
        out.append((statistics.mean(r["epsilon"] for r in runs), statistics.mean(ys),
                    statistics.stdev(ys) if len(ys) > 1 else 0.0))
    return sorted(out)


def _mean(results: list[dict], row: str, key: str) -> float | None:
    values = [r[key] for r in results if r["row"] == row and r.get(key) is not None]
    return statistics.mean(values) if values else None


def table(results: list[dict]) -> str:
    """The figure's points: each row's student at each target ε (the main rows, at the config's own
    ε of about 2, count as 2), mean ± sd (runs), windowed and on the text alone."""
    lines = ["| row | test perplexity | " + " | ".join(f"ε {e:g}" for e in SWEEP) + " |",
             "|---|---|" + "---:|" * len(SWEEP)]
    figures = [(f[0], f[3]) for f in reversed(FIGURES)] + [(CODES, "the codes' tokens alone")]
    for row, _, _ in LINES:
        for key, what in figures:
            groups = by_target(results, key, row)
            if not groups:
                continue
            groups[2] = groups.pop(None, []) + groups.get(2, [])  # the main rows count as ε 2
            cells = [f"{mean_sd([r[key] for r in groups[e]])} ({len(groups[e])})" if groups.get(e) else "–"
                     for e in SWEEP]
            lines.append(f"| {row} | {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def draw(results: list[dict], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig = Figure(figsize=(10, 4.6))
    axes = fig.subplots(1, 2)
    for ax, (key, teacher_key, base_key, what) in zip(axes, FIGURES):
        for row, label, color in LINES:
            points = series(results, key, row)
            if points:
                ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], marker="o",
                            capsize=3, label=label, color=color)
        teacher = series(results, teacher_key, "ours")
        if teacher:
            ax.plot([p[0] for p in teacher], [p[1] for p in teacher], ls=":", marker=".", color="tab:gray",
                    label="DP teacher")
        for value, label, style in ((_mean(results, "public-only", key), "ε = 0 control (base teacher)", "--"),
                                    (_mean(results, "ours", base_key), "base teacher (no private record)", "-.")):
            if value is not None:
                ax.axhline(value, ls=style, color="tab:green" if style == "--" else "black", label=label)
        ax.set(xscale="log", yscale="log", xlabel="total ε of the run (ledger, add/remove)",
               ylabel=f"test perplexity, {what}", title=f"{title}: student, {what}")
        ax.set_xticks(SWEEP, [f"{e:g}" for e in SWEEP], minor=False)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(ScalarFormatter())  # plain numbers, not powers of ten
        ax.yaxis.set_minor_locator(LogLocator(subs=(2, 3, 5)))
        ax.yaxis.set_minor_formatter(ScalarFormatter())
    # one legend for both panels, below them, clear of the points
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results" / "utility.jsonl")
    p.add_argument("--config-name", default="smollm2-airline", help="the config whose runs are drawn")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "privacy_utility.png")
    p.add_argument("--report-only", action="store_true", help="print the figure's points as a table; draw nothing")
    p.add_argument("--tokens", type=Path, help="the runs' token counts (default: beside --results, *_tokens.jsonl)")
    p.add_argument("--record-tokens", action="store_true",
                   help="copy each run's token counts from its run directory into --tokens, then report")
    args = p.parse_args(argv)
    args.tokens = args.tokens or tokens_path(args.results)
    if args.record_tokens:
        for line in record_tokens(args.results, args.tokens):
            print(f"experiments/privacy_utility.py: counts not recorded, {line}", file=sys.stderr)
    from experiments.utility import digests  # here: that module imports this one

    digest_of = digests(str(config_path(args.config_name)), [])
    results, stale = split_stale(read_results(args.results, args.config_name), digest_of)
    print(stale_note(stale, lambda r: f"{r['row']} run {r['repeat']} at ε {r.get('target_epsilon') or 2:g}"),
          end="", file=sys.stderr)  # the utility study's rule: a run of a config since changed is not drawn
    if not results:
        print(f"experiments/privacy_utility.py: no run of {args.config_name} in {args.results}", file=sys.stderr)
        return 2
    if args.report_only or args.record_tokens:
        print(table(with_codes(results, read_results(args.tokens))), end="")
    else:
        print(draw(results, args.out, args.config_name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
