"""Rewrite the report blocks of docs pages from their commands, after a study's results file grew.

    .venv/bin/python experiments/refresh_reports.py docs/utility.md docs/baselines.md

A report block is `<!-- report: python ... --report-only -->`, the command's output, then
`<!-- /report -->`; tests/test_docs.py fails when a block is not what its command prints (issue 60
item 2). This runs each block's command on the pages named; a block its command no longer
prints gets the whole output: its markdown (tables, headings) as printed, each run of plain
`key=value` lines in a code fence. A block still printed is left as the page fitted it (a part of
the output, bold for a heading). A command that fails leaves its block as it was and is named;
the exit status is then 1. Nothing outside the blocks changes. The commands read tracked results
files only.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^(<!-- report: (python [^\n]+) -->\n)(.*?)(^<!-- /report -->)$", re.M | re.S)
KEY_VALUE = re.compile(r"^[a-z][\w.-]*(=| [a-z][\w.]*=)")
"""A plain result line: `table=...`, `synthetic model=...`, `teacher corpus=...`."""


def as_markdown(output: str) -> str:
    """The command's output for a page: markdown as it is, each run of key=value lines fenced."""
    out, fenced = [], False
    for line in output.strip("\n").splitlines():
        plain = bool(KEY_VALUE.match(line))
        if plain != fenced:
            out.append("```")
            fenced = plain
        out.append(line)
    if fenced:
        out.append("```")
    return "\n".join(out) + "\n"


def plain(text: str) -> str:
    """The text with a heading's level or bold left out, and a code fence's lines (a page fits a
    report's headings to its own, and may fence its plain `key=value` lines)."""
    return "\n".join(re.sub(r"^(#+ |\*\*)(.*?)(\*\*)?$", r"\2", line) if line.startswith(("#", "**")) else line
                     for line in text.splitlines() if line != "```")


def tables(text: str) -> list[list[str]]:
    """Each markdown table of `text`, as its lines (a run of lines that start with '|')."""
    out: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.startswith("|"):
            out[-1].append(line)
        elif out[-1]:
            out.append([])
    return [t for t in out if t]


def is_current(block: str, output: str) -> bool:
    """Whether a block is what its command prints: a page may hold part of the output, fit to its
    style, but each table it holds whole (a table that gained a row since is stale)."""
    if not (plain(block).strip() and plain(block).strip() in plain(output)):
        return False
    printed = tables(output)
    return all(any(t == whole for whole in printed if whole[0] == t[0]) for t in tables(block))


def refresh(page: Path) -> list[str]:
    """Rewrite `page`'s stale blocks in place (one its command still prints is left as the page
    fitted it); the commands that failed."""
    failed = []

    def run(m: re.Match) -> str:
        argv = shlex.split(m.group(2))
        done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            failed.append(f"{page}: `{m.group(2)}` exited {done.returncode}: {done.stderr.strip()[-500:]}")
            return m.group(0)
        if is_current(m.group(3), done.stdout):
            return m.group(0)
        return m.group(1) + as_markdown(done.stdout) + m.group(4)

    text = page.read_text(encoding="utf-8")
    page.write_text(BLOCK.sub(run, text), encoding="utf-8")
    return failed


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pages", nargs="+", type=Path)
    failed = [f for page in p.parse_args(argv).pages for f in refresh(page)]
    for f in failed:
        print(f, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
