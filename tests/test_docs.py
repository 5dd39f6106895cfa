"""The docs' cross-references resolve: every relative Markdown link in the README and the docs
points to a file that exists, every `#anchor` to a heading of that file, every section named in
quotes after a page's name (`README "Results"`) begins a heading of that page, and every path
that docs/pipeline.md names (in backticks, and in its Layout block) exists, and its Layout block
names every module of pipeline/ and flows/. The pages have no dated journal headings. Pure text:
no torch, no Prefect."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.refresh_reports import as_markdown, is_current

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), ROOT / "pipeline/privacy/README.md",
                ROOT / "data/README.md", ROOT / "pipeline/models/builtin/README.md"})
# The repository's top-level folders whose paths docs/pipeline.md may name.
PATH_ROOTS = ("pipeline/", "flows/", "bench/", "experiments/", "configs/", "docs/", "tests/", "data/", "docker/")

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (code, emphasis and link markup gone),
    lowercased, everything but word characters, hyphens and spaces removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](target) -> text
    text = re.sub(r"[`*]", "", text)
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # _emphasis_, not snake_case
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _headings(path.read_text(encoding="utf-8")):
        base = slug(line)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _headings(text: str) -> list[tuple[int, str]]:
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            out.append((n, m.group(2)))
    return out


def broken_links(page: Path) -> list[str]:
    problems = []
    for n, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}:{n}: ({target})"
            if not dest.exists():
                problems.append(f"{where} no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return problems


def layout_paths(text: str) -> list[str]:
    """The paths docs/pipeline.md's Layout block names: each line's first word, joined to the
    folders above it by indentation (`  privacy/` under `pipeline/` is pipeline/privacy/), and the
    file names its description lists (`recipe.py` beside `teacher/` is pipeline/stages/teacher/recipe.py;
    a name with a '/' is from the repository root). A line whose first word is not a path (a wrapped
    description) continues the entry above it."""
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/pipeline.md has no '## Layout' section with a code block"
    stack: list[tuple[int, str]] = []  # (indent, folder) of the folders open above this line
    paths, here = [], ""  # here: the folder the current entry's description speaks of
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        indent, first = len(line) - len(line.lstrip()), line.split()[0]
        rest = line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else ""
        if re.fullmatch(r"(?:[\w.-]+/)*[\w.-]+/?", first) and ("/" in first or "." in first[1:]):
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = "".join(folder for _, folder in stack) + first
            paths.append(path)
            if first.endswith("/"):
                stack.append((indent, first))
            here = path if path.endswith("/") else path.rpartition("/")[0] + "/" * ("/" in path)
        else:
            rest = line
        for name in re.findall(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|yaml))(?![\w/])", rest):
            paths.append(name if "/" in name else here + name)
    return paths


_SECTION_REF = re.compile(r"\b(README(?:\.md)?|(?:docs/)?[\w-]+\.md)\)?,?\s+[\"“]([^\"”]+)[\"”]")


def broken_section_references(page: Path) -> list[str]:
    """Prose that names a section of another page in quotes (`docs/operations.md, "Speed"`,
    `README "Choosing α"`): the quoted words must begin a heading of that page."""
    problems = []
    for n, line in prose_lines(page.read_text(encoding="utf-8")):
        for name, quoted in _SECTION_REF.findall(line):
            name = "README.md" if name.startswith("README") else name
            candidates = [ROOT / name, page.parent / name, ROOT / "docs" / name]
            dest = next((c for c in candidates if c.is_file()), None)
            where = f"{page.relative_to(ROOT)}:{n}: {name} \"{quoted}\""
            if dest is None:
                problems.append(f"{where}: no such file")
            elif not any(a.startswith(slug(quoted)) for a in anchors(dest)):
                problems.append(f"{where}: no heading of {dest.relative_to(ROOT)} begins so")
    return problems


def test_the_slug_rule_is_githubs():
    assert slug("Two runs at once, and kills at random moments (measured)") == \
        "two-runs-at-once-and-kills-at-random-moments-measured"
    assert slug("2026-11-24: the plan's estimate against runs of two configs") == \
        "2026-11-24-the-plans-estimate-against-runs-of-two-configs"
    assert slug("Kills at random moments: `bench/faults.py`") == "kills-at-random-moments-benchfaultspy"
    assert slug("The whole line: `bench/pipeline_speed.py`") == "the-whole-line-benchpipeline_speedpy"
    assert slug("Choosing α: a rule") == "choosing-α-a-rule"


def test_layout_paths_follow_the_indentation():
    text = ("## Layout\n\n```\npipeline/   the library\n  stages/   stages\n    data.py   the data\n"
            "            stage, wrapped\n    teacher/  recipe.py, and\n              ddp.py\n  records.py  records\n"
            "flows/      Prefect, see docs/x.md\nprefect.yaml  deployments\n```\n")
    assert layout_paths(text) == ["pipeline/", "pipeline/stages/", "pipeline/stages/data.py", "pipeline/stages/teacher/",
                                  "pipeline/stages/teacher/recipe.py", "pipeline/stages/teacher/ddp.py",
                                  "pipeline/records.py", "flows/", "docs/x.md", "prefect.yaml"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.is_file(), f"{page} is listed here but does not exist"
    problems = broken_links(page) + broken_section_references(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(p.name for p in ROOT.glob("docs/*.md")))
def test_pages_have_no_dated_headings(name):
    """Every page says how things are now (CONVENTIONS rule 16): a heading that holds a date is a
    journal entry ("Airline, as of 2026-11-23 08:28"); the date of a measurement goes in its text,
    and history lives in git (issue 61)."""
    dated = [f"docs/{name}:{n}: {h}" for n, h in _headings((ROOT / "docs" / name).read_text(encoding="utf-8"))
             if re.search(r"\d{4}-\d{2}-\d{2}", h)]
    assert not dated, "\n".join(dated)


def test_operations_stays_a_reference_a_reader_can_hold():
    """docs/operations.md says how to operate, not what happened (issue 39: ≤ 700 lines; the
    measurements go to docs/benchmarks.md with their commands)."""
    n = len((ROOT / "docs" / "operations.md").read_text(encoding="utf-8").splitlines())
    assert n <= 700, f"docs/operations.md has {n} lines: move measurements to docs/benchmarks.md"


def test_the_readmes_results_are_one_table_one_figure_and_a_few_lines():
    """Issue 60 item 5: the README's Results section is one report table and one figure with at
    most 25 lines of text around them; the rest lives on the pages it links."""
    section = re.search(r"^## Results\n(.*?)^## ", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)
    assert section, "README.md has no Results section followed by another section"
    lines = [x for x in section.group(1).splitlines() if x.strip()]
    tables = sum(1 for x in lines if x.startswith("<!-- report:"))
    figures = [x for x in lines if x.startswith("![")]
    text = [x for x in lines if not x.startswith(("|", "<!--", "![", "```"))]
    assert (tables, len(figures)) == (1, 1), f"README Results: {tables} report tables, {len(figures)} figures"
    assert len(text) <= 25, f"README Results has {len(text)} lines of text around its table: move detail to docs/"


def test_every_path_docs_pipeline_names_exists():
    page = ROOT / "docs" / "pipeline.md"
    text = page.read_text(encoding="utf-8")
    missing = []
    for n, line in enumerate(text.splitlines(), 1):
        for span in re.findall(r"`([^`]+)`", line):
            token = span.split()[0].split("::")[0].rstrip(".,:;)")
            if token.startswith(PATH_ROOTS) and not (ROOT / token).exists():
                missing.append(f"docs/pipeline.md:{n}: `{span}`")
    missing += [f"docs/pipeline.md Layout: {path}" for path in layout_paths(text) if not (ROOT / path).exists()]
    assert not missing, "paths named that do not exist:\n" + "\n".join(missing)


def test_the_layout_names_every_module():
    """A module a reader cannot find in the Layout block of docs/pipeline.md is one whose place in
    the design nobody wrote down (issue 61): each .py of pipeline/ and flows/ but __init__.py."""
    named = set(layout_paths((ROOT / "docs" / "pipeline.md").read_text(encoding="utf-8")))
    modules = [str(p.relative_to(ROOT)) for pkg in ("pipeline", "flows") for p in sorted((ROOT / pkg).rglob("*.py"))
               if p.name != "__init__.py"]
    missing = [m for m in modules if m not in named]
    assert not missing, "modules docs/pipeline.md's Layout block does not name:\n" + "\n".join(missing)


REPORT_BLOCK = re.compile(r"^<!-- report: (python [^\n]+) -->\n(.*?)^<!-- /report -->$", re.M | re.S)


def _report_blocks() -> list[tuple[str, str, str]]:
    return [(str(page.relative_to(ROOT)), cmd, text) for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            for cmd, text in REPORT_BLOCK.findall(page.read_text(encoding="utf-8"))]


def test_the_docs_hold_report_blocks():
    assert len(_report_blocks()) >= 2  # the confirmation's two studies at least (issue 60 item 2)


@pytest.mark.parametrize("page, command, text", _report_blocks(), ids=lambda x: x if isinstance(x, str) and x.endswith(".md") else "")
def test_every_report_block_is_what_its_command_prints(page, command, text, tmp_path):
    """Issue 60 item 2: a results table in the docs is the output of a documented --report-only
    command on a tracked results file, verbatim; it fails when either drifts."""
    argv = shlex.split(command)
    assert "--report-only" in argv and argv[0] == "python", command
    run_root = [f"run_root={tmp_path}"] if "--config" in argv else []  # a config's runs stay out of the checkout
    done = subprocess.run([sys.executable, *argv[1:], *run_root], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert is_current(text, done.stdout), (f"{page}: the block under `{command}` is not what it prints now; "
                                           f"experiments/refresh_reports.py {page} rewrites it")


def test_a_refreshed_block_fences_its_result_lines_and_is_current():
    output = "| row | runs |\n|---|---:|\n| ours | 3 |\n\nsynthetic model=m corpus=c f1=0.5\ntable=oracle corpus=c ours=1\n"
    block = as_markdown(output)
    assert block == ("| row | runs |\n|---|---:|\n| ours | 3 |\n\n```\nsynthetic model=m corpus=c f1=0.5\n"
                     "table=oracle corpus=c ours=1\n```\n")
    assert is_current(block, output) and is_current("**Wall time**\n", "## Wall time\n")
    assert not is_current(block, output.replace("f1=0.5", "f1=0.6")) and not is_current("\n", output)
    table = "| row | runs |\n|---|---:|\n| ours | 3 |\n"  # the table alone: part of the output
    assert is_current(table, output)
    grown = output.replace("| ours | 3 |\n", "| ours | 3 |\n| dp-sgd | 3 |\n")
    assert not is_current(table, grown)  # a table that gained a row is stale, though its old rows are still printed
