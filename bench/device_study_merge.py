"""Add the lines a device study appended (bench/device_study.sh) to the tracked results files here.

    .venv/bin/python bench/device_study_merge.py /work/.device/.../utility.jsonl [...]

Each file returned is docs/results/<its name> as it was on the device at the end: the lines it
holds that the file here lacks are appended, in their order, under the file's lock (a study here
may be appending to it too); lines the device copy lacks (a study's here since) stay. Prints what
it added per file."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.shared import lock_of  # noqa: E402
from pipeline.locks import file_lock  # noqa: E402


def merge(returned: Path, tracked: Path) -> list[str]:
    """Append to `tracked` the lines of `returned` it does not hold; the lines appended."""
    with file_lock(lock_of(tracked)):
        have = set(tracked.read_text().splitlines()) if tracked.exists() else set()
        new = [line for line in returned.read_text().splitlines() if line.strip() and line not in have]
        if new:
            with tracked.open("a") as f:
                f.write("".join(line + "\n" for line in new))
    return new


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for name in argv:
        returned = Path(name)
        tracked = ROOT / "docs" / "results" / returned.name
        if returned.suffix != ".jsonl" or not tracked.exists():
            print(f"{returned}: not a results file of docs/results/ (no {tracked.relative_to(ROOT)})", file=sys.stderr)
            return 2
        print(f"{tracked.relative_to(ROOT)}: {len(merge(returned, tracked))} lines added")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
