"""Write the README's "What you get" from a finished run, so that its figures cannot drift.

    make demo
    .venv/bin/python docs/readme_results.py runs/demo-YYYYMMDD-HHMMSS            # rewrites README.md
    .venv/bin/python docs/readme_results.py RUN_DIR --commit 1a2b3c4 --readme X.md

Everything between `<!-- results:start -->` and `<!-- results:end -->` in the README is
replaced; nothing else is touched. The block is made from the run directory alone:

- the demo's last lines, from `run.log` (the students' perplexity lines and the warnings
  after them, as the terminal shows them, a long parenthesis shortened to "(...)");
- perplexity and ε per model, from `metrics.json` (`perplexity`) and `ledger.json`;
- how the student was chosen, from `metrics.json` (`selection`, `downstream`);
- the date, the wall time (`run.json`) and the commit;
- `dpdistill status` (seconds per stage, from `stages.json`) and the main columns of
  `dpdistill ledger show`.

The commit is the checkout's HEAD unless `--commit` names it: a run records none. If HEAD was
committed after the run started, the run was made on an earlier commit and the script refuses
to guess; pass `--commit`. It reads aggregates only (what the report reads), never a record,
and imports neither torch nor Prefect.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

START, END = "<!-- results:start -->", "<!-- results:end -->"
LEDGER_COLUMNS = ("stage", "guarantee", "epsilon", "epsilon_replace_one", "delta", "noise_multiplier",
                  "sample_rate", "steps")
_PAREN = re.compile(r" \((?:[^()]|\([^()]*\))*\)")  # a parenthesis, with parentheses one level inside it
# run.log holds Prefect's console format ("00:26:42.123 | INFO    | logger - message") or, for
# the lines logged before Prefect configures logging, Opacus' basicConfig one
# ("11/26/2026 00:26:42:INFO:message", no logger name).
_LOG_LINE = re.compile(r"^(\d\d:\d\d:\d\d)(?:\.\d+)? \| (\w+)\s*\| (.*?) - (.*)$"
                       r"|^\d\d/\d\d/\d{4} (\d\d:\d\d:\d\d):([A-Z]+):()(.*)$")


class ResultsError(Exception):
    """What is missing or wrong, said in one line."""


def _json(run_dir: Path, name: str):
    path = run_dir / name
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultsError(f"{path} not found: pass the directory of a finished run") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path} is not valid JSON ({e})") from e


def last_lines(run_dir: Path, width: int = 100) -> list[str]:
    """The end of the run as the terminal shows it: each student's perplexity line and every
    warning after the first of them, then the run directory."""
    try:
        text = (run_dir / "run.log").read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise ResultsError(f"{run_dir / 'run.log'} not found") from None
    parsed = [m.groups()[:4] if m.group(1) else m.groups()[4:]
              for m in map(_LOG_LINE.match, text.splitlines()) if m]
    first = next((i for i, (_, _, _, msg) in enumerate(parsed)
                  if re.match(r"evaluation: student\w* perplexity", msg)), None)
    if first is None:
        raise ResultsError(f"{run_dir / 'run.log'} has no student's perplexity line: the run did not finish its evaluation")
    out = []
    for time, level, _, msg in parsed[first:]:
        if re.match(r"evaluation: student\w* perplexity", msg) or level in ("WARNING", "ERROR"):
            msg = _PAREN.sub(lambda m: " (...)" if len(m.group(0)) > 80 else m.group(0), msg)  # per-column detail
            out += textwrap.wrap(f"{time} {level:<5} {msg}", width, subsequent_indent=" " * 9)
    return out + [f"run directory: {_shown(run_dir)}"]


def _shown(run_dir: Path) -> str:
    """The run directory as a reader's checkout would name it: runs/NAME."""
    info = _json(run_dir, "run.json")
    root = Path(info.get("run_root") or run_dir.parent)
    return f"{root.name}/{run_dir.name}"


def _eps(x: float | None) -> str:
    return "-" if x is None else "0" if x == 0 else f"{x:.2f}"


def _settings(selection: dict, name: str) -> str:
    cand = next((c for c in selection.get("candidates", []) if c.get("candidate") == name), {})
    settings = cand.get("settings") or {}
    words = {"alpha": "α", "temperature": "T", "beta": "β"}
    return ", ".join(f"{words.get(k, k)} = {v:g}" if isinstance(v, (int, float)) else f"{k} = {v}"
                     for k, v in settings.items()) or name


def perplexity_table(run_dir: Path) -> tuple[list[str], dict]:
    metrics = _json(run_dir, "metrics.json")
    ledger = _json(run_dir, "ledger.json")
    config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) if (run_dir / "config.yaml").is_file() else {}
    ppl = metrics.get("perplexity") or {}
    if not ppl:
        raise ResultsError(f"{run_dir / 'metrics.json'} has no perplexity: the run did not finish its evaluation")
    entries = {e["stage"]: e for e in ledger.get("entries", [])}
    total = ledger.get("total") or {}
    selection = metrics.get("selection") or {}
    teacher_model = (config.get("teacher") or {}).get("model")
    student_model = (config.get("distill") or {}).get("student_model")
    rows = ["| model | windowed perplexity | per-record mean | ε (add/remove) | ε (replace-one) |",
            "|---|---:|---:|---:|---:|"]
    for key, m in ppl.items():
        if key == "base_student":
            name, eps = f"base student (`{student_model}`)" if student_model else "base student", (0.0, 0.0)
        elif key == "base_teacher":
            name, eps = f"base teacher (`{teacher_model}`)" if teacher_model else "base teacher", (0.0, 0.0)
        elif key == "dp_teacher":
            e = entries.get("teacher", {})
            name, eps = "DP teacher", (e.get("epsilon"), e.get("epsilon_replace_one"))
        else:  # the student of the run's method: it is released with everything the run released
            how = ""
            if selection.get("chosen"):
                rule = "chosen by the rule" if selection.get("select_by") == "teacher_kl" else \
                    f"chosen by {selection.get('select_by')}"
                how = f" ({_settings(selection, selection['chosen'])}, {rule})"
            elif metrics.get("method", "distil") == "distil" and "alpha" in (config.get("distill") or {}):
                how = f" (α = {config['distill']['alpha']:g})"
            method = metrics.get("method", key.removeprefix("student_"))
            label = "distilled student" if method == "distil" else f"student ({method})"
            rows.append(f"| **{label}**{how} | **{m['windowed']:.1f}** | {m['per_record_mean']:.1f} | "
                        f"{_eps(total.get('epsilon'))} (whole run) | {_eps(total.get('epsilon_replace_one'))} (whole run) |")
            continue
        rows.append(f"| {name} | {m['windowed']:.1f} | {m['per_record_mean']:.1f} | {_eps(eps[0])} | {_eps(eps[1])} |")
    return rows, metrics


def verdict(metrics: dict) -> str:
    """How the student was chosen and what distillation gave, in the run's own figures."""
    out = []
    sel = metrics.get("selection") or {}
    cands = sel.get("candidates") or []
    chosen = sel.get("chosen")
    key = sel.get("select_by")
    if chosen and len(cands) > 1 and key:
        others = [c for c in cands if c.get("candidate") != chosen]
        mine = next(c for c in cands if c.get("candidate") == chosen)
        what = {"teacher_kl": f"its KL to the DP teacher on {sel.get('selection_samples')} untruncated teacher samples"}
        figures = ", ".join(f"{c[key]:.2f}" for c in others if c.get(key) is not None)
        out.append(f"The student was chosen over {', '.join(_settings(sel, c['candidate']) for c in others)} by "
                   f"{what.get(key, key)} ({mine[key]:.2f} against {figures}).")
    ppl = metrics.get("perplexity") or {}
    student = next((v for k, v in ppl.items() if k.startswith("student")), None)
    if student and "base_student" in ppl:
        before, after = ppl["base_student"]["windowed"], student["windowed"]
        out.append(f"Trained on the synthetic text alone, the student's windowed perplexity fell by "
                   f"{100 * (before - after) / before:.0f} % ({before:.1f} to {after:.1f}).")
    if (metrics.get("downstream") or {}).get("useful") is False:
        out.append("The warning is the run's honest verdict: a classifier trained on the synthetic text tells the "
                   "control codes apart in real text no better than chance.")
    return " ".join(out)


def _wall(info: dict) -> str:
    try:
        s = (datetime.fromisoformat(info["finished_at"]) - datetime.fromisoformat(info["started_at"])).total_seconds()
    except (KeyError, TypeError, ValueError):
        return "wall time unknown"
    return f"{int(s // 60)} min {int(s % 60)} s wall" if s >= 60 else f"{s:.0f} s wall"


def status_and_ledger(run_dir: Path) -> list[str]:
    """`dpdistill status RUN_DIR` as it prints, and `ledger show`'s table in its main columns."""
    from flows.cli_inspect import print_status
    from pipeline.privacy.ledger import fmt_value, read_ledger, table_rows

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        if print_status(run_dir) != 0:
            raise ResultsError(f"dpdistill status {run_dir} failed")
    shown = _shown(run_dir)
    status = [line.rstrip() for line in
              buf.getvalue().replace(str(run_dir.resolve()), shown).replace(str(run_dir), shown).rstrip().splitlines()]
    rows = [[fmt_value(r.get(c)) for c in LEDGER_COLUMNS] for r in table_rows(read_ledger(run_dir / "ledger.json"))]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(LEDGER_COLUMNS)]
    table = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [list(LEDGER_COLUMNS), *rows]]
    return [f"$ dpdistill status {shown}", *status, f"$ dpdistill ledger show {shown}    # its main columns", *table]


def head_commit(started_at: str | None) -> str:
    """HEAD of this checkout, if it is the commit the run ran on (not committed after it began)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit, when = git("rev-parse", "--short", "HEAD"), git("log", "-1", "--format=%cI")
    except (OSError, subprocess.CalledProcessError) as e:
        raise ResultsError(f"no git checkout at {ROOT} to read the commit from ({e}); pass --commit") from e
    if started_at and datetime.fromisoformat(when) > datetime.fromisoformat(started_at).astimezone():
        raise ResultsError(f"HEAD ({commit}, committed {when}) is newer than the run (started {started_at}): "
                           "pass --commit with the commit the run was made on")
    return commit


def results_block(run_dir: Path, commit: str | None = None) -> str:
    info = _json(run_dir, "run.json")
    if info.get("status") != "completed":
        raise ResultsError(f"{run_dir} is not a finished run (run.json status: {info.get('status')!r})")
    commit = commit or head_commit(info.get("started_at"))
    lines = last_lines(run_dir)
    table, metrics = perplexity_table(run_dir)
    date = (info.get("started_at") or "")[:10]
    n = metrics.get("test_records")
    parts = [
        START,
        "<!-- written by docs/readme_results.py from a run directory: edit the script, not this block -->",
        "",
        "The demo's last lines:",
        "",
        "```",
        *lines,
        "```",
        "",
        f"Perplexity on {n} held-out records (lower is better) and what each model cost in privacy:",
        "",
        *table,
        "",
        *textwrap.wrap(f"{verdict(metrics)} Run on {date} at commit {commit}, {_wall(info)}; the seconds of each "
                       "stage below.", 100),
        "",
        "`dpdistill status RUN_DIR` and `dpdistill ledger show RUN_DIR`:",
        "",
        "```",
        *status_and_ledger(run_dir),
        "```",
        END,
    ]
    return "\n".join(parts)


def rewrite(readme: Path, block: str) -> None:
    text = readme.read_text(encoding="utf-8")
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ResultsError(f"{readme} must hold one {START} line and, after it, one {END} line")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = head + block + tail
    tmp = readme.with_name(f".{readme.name}.tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(readme)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a finished run directory (run.json status completed)")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--commit", help="the commit the run was made on (default: HEAD, if not newer than the run)")
    args = p.parse_args(argv)
    try:
        rewrite(args.readme, results_block(args.run_dir, args.commit))
    except ResultsError as e:
        print(f"readme_results: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.readme}: results of {args.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
