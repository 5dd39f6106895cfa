"""Which method wins on the user's own data (issue 37 item 5): a run's test perplexity beside the
finished runs of the other methods (`distill.method`) that sit in the same run root and were
scored on the same test split (its sha256 in data/manifest.json), with the same student model and
evaluation window. The report and the comparison page say in words which is ahead, and when
DP-SGD of the student is, that training the student directly is the better choice for this
data and model pair.

It reads aggregates only (metrics.json, data/manifest.json's hashes, config.yaml, ledger.json's
total), as the report does. Choosing a method by these test figures is a choice made by looking
at the test split (README, "Not protected"), and every run spent its own ε on the same records
(the dataset budget counts them all): the sentence says both.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.methods import METHODS, words
from pipeline.reports import read_json

DIRECT = "train the student directly"
"""The words of the verdict's advice; the report shows a verdict holding them as a warning."""
EPSILON_TOLERANCE = 0.05
"""Runs whose ledger totals differ by more than this share are compared, but said to be at different ε."""


TRAINING = ("learning_rate", "epochs", "batch_size", "max_grad_norm", "weight_decay", "mode")
"""The `teacher` settings a DP-SGD or DPKD student trains with (its ε is set apart: a study may
give each row its own, to match totals)."""


@dataclass(frozen=True)
class Scored:
    run: str
    method: str
    perplexity: float
    epsilon: float | None
    settings: str = ""  # the run's teacher and distill sections: runs that share them are repeats
    text_perplexity: float | None = None  # the same with the control-code header left out of the targets
    key: tuple | None = None  # what two runs must share to be compared: test split's sha256, student, window
    training: str = ""  # the teacher section's TRAINING settings, which a DP-SGD or DPKD student trains with


def scored(run_dir: Path) -> Scored | None:
    """The run's student figures (windowed test perplexity, and on the text alone), read once
    from its files; None before its evaluation."""
    run_dir = Path(run_dir)
    metrics = read_json(run_dir / "metrics.json") or {}
    method = metrics.get("method")
    student = (metrics.get("perplexity") or {}).get(f"student_{method}") or {}
    if method is None or student.get("windowed") is None:
        return None
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        cfg = None
    cfg = cfg if isinstance(cfg, dict) else {}
    outputs = (read_json(run_dir / "data" / "manifest.json") or {}).get("outputs") or {}
    test = (outputs.get("test") or {}).get("sha256")
    student_model = (cfg.get("distill") or {}).get("student_model")
    key = (test, str(student_model), metrics.get("window")) if test and student_model is not None else None
    teacher = cfg.get("teacher") if isinstance(cfg.get("teacher"), dict) else {}
    return Scored(run_dir.name, method, float(student["windowed"]),
                  ((read_json(run_dir / "ledger.json") or {}).get("total") or {}).get("epsilon"),
                  json.dumps({k: cfg.get(k) for k in ("teacher", "distill")}, sort_keys=True, default=str),
                  (student.get("text_only") or {}).get("windowed"), key,
                  json.dumps({k: teacher.get(k) for k in TRAINING}, sort_keys=True, default=str))


def peers(run_dir: Path) -> list[Scored]:
    """The finished runs beside `run_dir` (itself first) that can be compared with it."""
    run_dir = Path(run_dir)
    this = scored(run_dir)
    if this is None or this.key is None:
        return []
    others = [s for p in sorted(run_dir.parent.iterdir())
              if p.is_dir() and p != run_dir and (s := scored(p)) is not None and s.key == this.key]
    return [this, *others]


def _same_epsilon(a: float | None, b: float | None) -> bool:
    return a is None or b is None or abs(a - b) <= EPSILON_TOLERANCE * max(a, b)


def _words(method: str) -> str:
    return words(method)


def _ours(method: str) -> bool:
    return method in METHODS and METHODS[method].ours


def _direct(method: str) -> bool:
    """A baseline that trains the student itself on the private records (DP-SGD, DPKD)."""
    return method in METHODS and METHODS[method].dp_student


def _untuned_baselines(by_method: dict[str, list[Scored]], anchor: str, means: dict[str, float]) -> list[str]:
    """The DP-SGD and DPKD rows behind ours whose every run used ours' teacher section as it
    stands: their student trained at settings chosen for the teacher, not tuned for itself."""
    if not _ours(anchor):
        return []
    ours = {r.training for r in by_method[anchor]}
    return [m for m in METHODS if m in by_method and _direct(m) and means[m] > means[anchor]
            and {r.training for r in by_method[m]} <= ours]


def verdict(runs: list[Scored]) -> str | None:
    """In words: each method's mean over its runs at the first run's ε, which is ahead, and whether
    to train the student directly; None when fewer than two methods can be compared."""
    if not runs:
        return None
    same = [r for r in runs if _same_epsilon(r.epsilon, runs[0].epsilon)]
    by_method: dict[str, list[Scored]] = {}
    for r in same:
        by_method.setdefault(r.method, []).append(r)
    if len(by_method) < 2:
        return None
    means = {m: statistics.mean(r.perplexity for r in rs) for m, rs in by_method.items()}
    sds = {m: statistics.stdev(r.perplexity for r in rs) if len(rs) > 1 else None for m, rs in by_method.items()}
    ranked = sorted(means, key=means.get)  # best first

    def figure(m: str) -> str:
        n = len(by_method[m])
        return f"{_words(m)} {means[m]:.1f}" + (f" ± {sds[m]:.1f} ({n} runs)" if n > 1 else " (1 run)")

    text = ("Students' windowed test perplexity on this test split, with this student, at this run's ε: "
            + "; ".join(figure(m) for m in ranked) + ".")
    anchor = next((m for m in means if _ours(m)), ranked[0])
    clauses, direct = [], []
    for m in (m for m in ranked if m != anchor):
        gap = means[m] - means[anchor]  # > 0: the anchor is ahead
        ahead, behind = (anchor, m) if gap > 0 else (m, anchor)
        clause = f"{_words(ahead)} is ahead of {_words(behind)} by {100 * abs(gap) / means[behind]:.0f} %"
        if sds[m] is None or sds[anchor] is None:
            clause += " (one run of one of them: DP noise alone moves a figure by several per cent; repeat it)"
        elif abs(gap) <= sds[m] + sds[anchor]:
            clause += " (inside the runs' spread, the sum of the two sds: a tie)"
        else:
            clause += " (more than the runs' spread)"
            if _ours(anchor) and gap < 0 and _direct(m):
                direct.append(m)
        clauses.append(clause)
    sentence = "; ".join(clauses)
    text += " " + sentence[0].upper() + sentence[1:] + "."
    if direct:
        text += (f" For this data and model pair, {DIRECT}: distill.method={direct[0]} "
                 "(docs/pipeline.md, \"When to distil\").")
    if untuned := _untuned_baselines(by_method, anchor, means):
        text += (" " + " and ".join(_words(m) for m in untuned) + " trained the student with ours' `teacher` "
                 "settings unchanged (learning rate, epochs, batch), which were chosen for the teacher; a small "
                 "student often needs others (on the real pair's Yelp reviews of docs/real_model.md, four times the "
                 "learning rate cut DP-SGD's perplexity by a quarter, 371 to 283): try a few before reading this as a win.")
    if mixed := [m for m, rs in by_method.items() if len({r.settings for r in rs}) > 1]:
        text += (" The runs of " + ", ".join(_words(m) for m in mixed) + " differ in their settings: each mean "
                 "mixes them.")
    if left := len(runs) - len(same):
        text += f" Left out: {left} run(s) at another total ε."
    return text + (" Each run spent its own ε on the same records (the dataset's budget counts them all), and a "
                   "method chosen by these test figures is chosen by looking at the test split.")
