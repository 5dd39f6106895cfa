"""The README's results table (issue 60 item 5): per corpus, the student of ours beside the
baselines a user would run (DP-SGD and DPKD of the same student at the whole ε), the ε = 0 control
and the teachers; windowed test perplexity and on the text alone. Ours and the baselines each run
as a user would: with the learning rate chosen on a public proxy corpus where
experiments/public_proxy.py has run it, the cell marked "ᵖ", else with the config's settings.
Every cell is the mean ± sd of a tracked results file's runs, scored on the corpus's fixed test
split; a cell whose file holds no such figure prints "–".

    .venv/bin/python experiments/results_table.py --report-only   # print the table
    .venv/bin/python experiments/results_table.py                 # and rewrite the README's block

The README's block is checked against `--report-only` by tests/test_docs.py.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.public_proxy import REPEATS, chosen, digests, runs_of  # noqa: E402
from experiments.shared import PINNED, config_path, mean_sd, read_results, share_a_teacher, split_stale  # noqa: E402

RESULTS = ROOT / "docs" / "results"
# corpus, each column's (results file, its config's name or None for every line, the file's row
# label), the config's name in public_proxy.jsonl. A corpus's columns may come from different
# studies' files, each scored on the corpus's fixed test split; the teachers' and the base
# student's cells are those of ours' runs.
SOURCES = (
    ("Yelp, builtin 5.3 M → 1.5 M", {"ours": ("yelp.jsonl", None, "ours"), "dpsgd": ("yelp.jsonl", None, "DP-SGD"),
                                     "dpkd": ("yelp.jsonl", None, "DPKD")}, "reference"),
    # Ours and the ε = 0 control as the config ships them (the utility study's rows with the codes
    # as a prompt and the stars named, `ours-words`; its `ours` row keeps the raw star values the
    # config shipped before); DPKD at the config's settings from issue 36's study (the header form).
    # Where ours' cell is the proxy's choice, the control at that rate (`public_only_proxy`) once it
    # has all its runs: one rate for both.
    ("Yelp, SmolLM2-135M → 4 layers", {"ours": ("utility.jsonl", "smollm2-yelp", "ours-words"),
                                       "dpsgd": ("utility.jsonl", "smollm2-yelp", "dp-sgd"),
                                       "dpkd": ("smollm2_yelp.jsonl", "smollm2-yelp", "DPKD"),
                                       "public_only": ("utility.jsonl", "smollm2-yelp", "public-only-words"),
                                       "public_only_proxy": ("utility.jsonl", "smollm2-yelp", "public-only-words-2x")},
     "smollm2-yelp"),
    ("Tweets, SmolLM2-135M → 4 layers", {"ours": ("utility.jsonl", "smollm2-airline", "ours"),
                                         "dpsgd": ("utility.jsonl", "smollm2-airline", "dp-sgd"),
                                         "public_only": ("utility.jsonl", "smollm2-airline", "public-only")},
     "smollm2-airline"),
)
# The student each corpus's row compares (its label's): the public-proxy study trains its private
# config's as shipped (the tweets' 8 layers since issue 59; the utility study's rows pin 4), and its
# cells join a row only where that is the row's student.
STUDENTS = {"reference": "builtin:student", "smollm2-yelp": "cache:smollm2-135m-4l",
            "smollm2-airline": "cache:smollm2-135m-4l"}
COLUMNS = ("ours", "dpsgd", "dpkd", "public_only")
PROXY = "ᵖ"  # the mark of a cell at the learning rate chosen on the public proxy (public_proxy.jsonl)
SHARED = "ˢ"  # the mark of a cell whose runs share a DP teacher (a DPKD repeat's before 2026-11-30)
# figure: (the student's key, the DP teacher's, the base teacher's, the base student's)
FIGURES = (("windowed", ("student", "dp_teacher", "base_teacher", "zero_shot")),
           ("text alone", ("student_text_windowed", "dp_teacher_text", "base_teacher_text", None)))


def table() -> str:
    lines = ["| corpus | test perplexity | ours | DP-SGD | DPKD | ε = 0 control | DP teacher | base teacher "
             "| base student |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for corpus, sources, proxy_config in SOURCES:
        of = {col: runs_of_row(*sources[col]) if col in sources else [] for col in COLUMNS}
        if not of["ours"]:
            continue
        own_ours = of["ours"]
        proxied = proxy_runs(proxy_config)
        proxied |= control_at_ours_rate(sources, proxied.get("ours", []))
        of |= proxied
        for what, (student, *references) in FIGURES:
            cells = [cell(of[col], student, col in proxied) for col in COLUMNS]
            if cells[0] == "–":
                continue  # an older study that did not record this figure of ours: nothing to compare
            cells += [reference(of["ours"], own_ours, key) for key in references]
            lines.append(f"| {corpus} | {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cell(runs: list[dict], key: str, proxied: bool) -> str:
    """A method's cell: the runs' mean ± sd of `key`, marked where chosen on the public proxy and
    where its runs share a DP teacher (not independent draws of all their noise)."""
    text = mean_sd([r.get(key) for r in runs])
    if text == "–":
        return text
    return text + (PROXY if proxied else "") + (SHARED if share_a_teacher(runs) else "")


def reference(ours: list[dict], own_ours: list[dict], key: str | None) -> str:
    """A reference cell (a teacher's or the base student's) from ours' runs in its cell; a figure
    those runs do not record (the proxy harness has no base teacher) from ours' runs at the
    config's settings, the same model."""
    if key is None:
        return "–"
    return mean_sd([r.get(key) for r in ours if r.get(key) is not None] or [r.get(key) for r in own_ours])


def runs_of_row(name: str, config: str | None, row: str) -> list[dict]:
    """The main runs (not a privacy-utility sweep's) of `row` in results file `name`; of the utility
    study's, those of the config its row resolves to today (a run recorded with another is kept out,
    as its report keeps it: `split_stale`)."""
    results = read_results(RESULTS / name, config)
    if name == "utility.jsonl":
        from experiments.utility import digests

        results, _ = split_stale(results, digests(str(config_path(config)), []))
    return [r for r in results if r.get("target_epsilon") is None and r["row"] == row]


def proxy_runs(config: str) -> dict[str, list[dict]]:
    """The private runs at the learning rate the public proxy chose (experiments/public_proxy.py,
    issue 60 item 3), of each method (ours and the baselines) that has all of them on this config:
    until then its cell stays the config's, not a mean of one or two runs. None where the study
    trains another student than the row's (`STUDENTS`): one row compares one student."""
    if proxy_student(config) != STUDENTS[config]:
        return {}
    digest_of = digests(str(config_path(config)), None, [])
    results, _ = split_stale(read_results(RESULTS / "public_proxy.jsonl", config), digest_of)
    out = {}
    for col in ("ours", "dpsgd", "dpkd"):
        pick = chosen(results, col)
        if pick is not None and len(runs := runs_of(results, col, "private", pick)) >= REPEATS:
            out[col] = runs
    return out


def control_at_ours_rate(sources: dict, ours: list[dict]) -> dict[str, list[dict]]:
    """The ε = 0 control's runs at the distillation rate of ours' runs at the proxy's choice (`ours`),
    where the corpus's sources name such a row (`public_only_proxy`) and all its runs have landed;
    else none, and the control's cell stays the config's."""
    if not ours or "public_only_proxy" not in sources:
        return {}
    from experiments.utility import overrides
    from pipeline.config import load_config

    name, config, row = sources["public_only_proxy"]
    rate = load_config(config_path(config), overrides(row, config, 1)).distill.learning_rate
    control = runs_of_row(name, config, row)
    if len(control) < REPEATS or {r["learning_rate"] for r in ours} != {rate}:
        return {}
    return {"public_only": control}


def proxy_student(config: str) -> str:
    """The student the public-proxy study's private runs of `config` train: its config's, with the
    settings the study pins (experiments/shared.py `PINNED`)."""
    from pipeline.config import load_config

    return load_config(config_path(config), list(PINNED.get(config, ()))).distill.student_model


def rewrite_readme(text: str, readme: Path = ROOT / "README.md") -> None:
    block = re.compile(r"(<!-- report: python experiments/results_table.py --report-only -->\n).*?(<!-- /report -->)", re.S)
    page = readme.read_text(encoding="utf-8")
    if not block.search(page):
        raise SystemExit(f"experiments/results_table.py: {readme} holds no block of this command to rewrite")
    readme.write_text(block.sub(lambda m: m.group(1) + text + m.group(2), page), encoding="utf-8")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report-only", action="store_true", help="print the table; leave the README as it is")
    args = p.parse_args(argv)
    text = table()
    print(text, end="")
    if not args.report_only:
        rewrite_readme(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
