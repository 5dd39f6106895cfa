"""The report of experiments/baselines.py (issue 37): the oracle and deployable tables, the
selection rules' Spearman ρ and regret, the wall times and the summary lines, computed from the
harness's jsonl rows alone (no data, no model: tests/test_baselines_harness.py feeds it
fabricated rows).

A row of the jsonl is one finished run (`"kind": "run"`) or one private choice among a
deployable row's candidate runs (`"kind": "selection"`):

    {"kind": "run", "row": "dpsgd", "candidate": "lr=0.003,epochs=2", "repeat": 1, "student": 183.0,
     "epsilon": 1.987, "seconds": 420.0, ...}
    {"kind": "run", "row": "ours", "candidate": null, "repeat": 1, "student": 160.2, "selection":
     {"select_by": "teacher_kl", "chosen": "alpha=1.0", "candidates": [{"candidate": "alpha=0.0",
      "teacher_kl": 0.61, "test_perplexity": 190.3, ...}, ...]}, ...}
    {"kind": "selection", "row": "dpsgddep", "repeat": 1, "chosen": "lr=0.009,epochs=6",
     "scores": {"lr=0.003,epochs=2": 4.71, ...}, "selection_epsilon": 0.2, "epsilon": 1.987, ...}
"""

from __future__ import annotations

import math
import statistics

from experiments.shared import mean_sd

K = 4
"""Candidate settings per method (experiments/baselines.py's default grid; --grid k2: 2)."""
METHODS = ("ours", "dpsgd", "dpkd")
LABELS = {"ours": "ours", "dpsgd": "DP-SGD", "dpkd": "DPKD"}
ORACLE_ROW = {"ours": "ours", "dpsgd": "dpsgd", "dpkd": "dpkd"}
"""The runs whose candidates are trained at the full ε (ours: the zero-cost rule's run)."""
PRIVATE_ROW = {"ours": "ourspriv", "dpsgd": "dpsgddep", "dpkd": "dpkddep"}
"""The runs whose candidates and private selection share the total ε."""


def _mean(values: list[float | None], digits: int) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return f"{statistics.mean(values):.{digits}f}" if values else "–"


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's ρ, the pipeline's own (average ranks for ties; None below 3 pairs)."""
    from pipeline.stages.selection import spearman as rank_correlation

    return rank_correlation(list(x), list(y))


def _runs(results: list[dict], row: str) -> list[dict]:
    return [r for r in results if r.get("kind", "run") == "run" and r["row"] == row]


def _by_repeat(runs: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in runs:
        out.setdefault(r["repeat"], []).append(r)
    return dict(sorted(out.items()))


# Which figure a table compares: the windowed test perplexity (the README's), or the same with the
# control-code header left out of the targets ("text"): (a run's key, an ours candidate's key).
# Or each record scored alone, the records' total NLL over their total tokens ("record"): the
# windowed figure also scores tokens across record boundaries, which it joins.
FIGURES = {"windowed": ("student", "test_perplexity"), "text": ("student_text_windowed", "test_text_perplexity"),
           "record": ("student_per_record_token_weighted", "test_per_record_token_weighted")}
FIGURE_TITLES = {"text": "On the text alone (the control-code header left out of the targets)",
                 "record": "Per record, token-weighted (each record scored alone)"}


def _candidates(run: dict, figure: str = "windowed") -> list[dict]:
    """An `ours` run's candidates that were scored on the test split (by `figure`)."""
    key = FIGURES[figure][1]
    return [c for c in (run.get("selection") or {}).get("candidates", []) if c.get(key) is not None]


def oracle(results: list[dict], method: str, k: int = K, figure: str = "windowed") -> list[dict]:
    """Per repeat with all `k` candidates: the best candidate by test perplexity (`figure`; an upper
    bound: the test split chooses)."""
    run_key, cand_key = FIGURES[figure]
    out = []
    if method == "ours":
        for r in _runs(results, "ours"):
            cands = _candidates(r, figure)
            if len(cands) == k:
                best = min(cands, key=lambda c: c[cand_key])
                out.append({"repeat": r["repeat"], "value": best[cand_key], "candidate": best["candidate"],
                            "epsilon": r["epsilon"]})
        return out
    for repeat, runs in _by_repeat(_runs(results, ORACLE_ROW[method])).items():
        runs = [r for r in runs if r.get(run_key) is not None]
        if len({r["candidate"] for r in runs}) == k:
            best = min(runs, key=lambda r: r[run_key])
            out.append({"repeat": repeat, "value": best[run_key], "candidate": best["candidate"],
                        "epsilon": max(r["epsilon"] for r in runs)})
    return out


def _choices(results: list[dict], row: str, split: str) -> list[dict]:
    """The harness's private choices of `row` on the records of `split` (lines from before the
    second split scored the validation split)."""
    return [s for s in results if s.get("kind") == "selection" and s["row"] == row
            and s.get("split", "validation") == split]


def deployable(results: list[dict], method: str, private: bool, figure: str = "windowed",
               split: str = "validation") -> list[dict]:
    """Per repeat: the candidate a procedure that reads no test record chose, its test perplexity,
    the ε its choice spent and the row's composed total. ours: its own run's choice, by the
    zero-cost rule or (`private`) by the private validation release; DP-SGD and DPKD: the
    harness's private choice among the candidate runs (always private). `split`
    train+validation: the harness's choices on the training and validation records (ours: among
    ourspriv's kept candidates). `figure` (a key of FIGURES): which of the chosen student's test
    perplexities (None where not recorded)."""
    run_key, cand_key = FIGURES[figure]
    out = []
    if method == "ours" and private and split != "validation":
        runs = {r["repeat"]: r for r in _runs(results, PRIVATE_ROW["ours"])}
        for s in _choices(results, PRIVATE_ROW["ours"], split):
            test = {c["candidate"]: c.get(cand_key) for c in runs[s["repeat"]]["selection"]["candidates"]}
            out.append({"repeat": s["repeat"], "value": test.get(s["chosen"]), "chosen": s["chosen"],
                        "selection_epsilon": s["selection_epsilon"], "epsilon": s["epsilon"]})
        return sorted(out, key=lambda d: d["repeat"])
    if method == "ours":
        for r in _runs(results, PRIVATE_ROW["ours"] if private else "ours"):
            sel = r.get("selection") or {}
            out.append({"repeat": r["repeat"], "value": r.get(run_key), "chosen": sel.get("chosen"),
                        "selection_epsilon": (sel.get("private_validation") or {}).get("epsilon", 0.0),
                        "epsilon": r["epsilon"]})
        return out
    runs = _runs(results, PRIVATE_ROW[method])
    for s in _choices(results, PRIVATE_ROW[method], split):
        chosen = next(r for r in runs if r["repeat"] == s["repeat"] and r["candidate"] == s["chosen"])
        out.append({"repeat": s["repeat"], "value": chosen.get(run_key), "chosen": s["chosen"],
                    "selection_epsilon": s["selection_epsilon"], "epsilon": s["epsilon"]})
    return sorted(out, key=lambda d: d["repeat"])


def _study(scores: dict[str, float], test: dict[str, float], chosen: str) -> dict:
    names = sorted(scores)
    return {"spearman": spearman([scores[n] for n in names], [test[n] for n in names]),
            "regret": test[chosen] - min(test.values()), "chosen": chosen}


def rule_study(results: list[dict], method: str = "ours", private: bool = False,
               criterion: str | None = None, figure: str = "windowed", split: str = "validation") -> list[dict]:
    """Per repeat: Spearman ρ of a selection's scores against the candidates' test perplexities,
    and its regret (the chosen candidate's test perplexity minus the best's). ours: its run's
    own rule (`select_by`, or `criterion` to ask how another would have ranked); DP-SGD and
    DPKD: the noisy validation scores of the harness's private choice; `split`
    train+validation: the harness's choices on the training and validation records (ours: among
    ourspriv's kept candidates). `figure` (a key of FIGURES): against which test perplexities; a
    repeat missing one of them is left out."""
    run_key, cand_key = FIGURES[figure]
    out = []
    if method == "ours" and private and split != "validation":
        runs = {r["repeat"]: r for r in _runs(results, PRIVATE_ROW["ours"])}
        for s in _choices(results, PRIVATE_ROW["ours"], split):
            test = {c["candidate"]: c[cand_key] for c in _candidates(runs[s["repeat"]], figure)}
            if set(test) >= set(s["scores"]):
                out.append({"repeat": s["repeat"], **_study(s["scores"], {n: test[n] for n in s["scores"]},
                                                            s["chosen"])})
        return sorted(out, key=lambda d: d["repeat"])
    if method == "ours":
        for r in _runs(results, PRIVATE_ROW["ours"] if private else "ours"):
            cands, sel = _candidates(r, figure), r.get("selection") or {}
            name = criterion or sel.get("select_by")
            cands = [c for c in cands if c.get(name) is not None]
            if len(cands) < 2:
                continue
            scores = {c["candidate"]: c[name] for c in cands}
            chosen = sel["chosen"] if criterion is None else min(scores, key=scores.get)
            test = {c["candidate"]: c[cand_key] for c in cands}
            if chosen not in test:
                continue
            out.append({"repeat": r["repeat"], **_study(scores, test, chosen)})
        return out
    runs = _runs(results, PRIVATE_ROW[method])
    for s in (s for s in _choices(results, PRIVATE_ROW[method], split)
              if s.get("scores")):  # a choice transcribed without its scores has no ρ
        test = {r["candidate"]: r[run_key] for r in runs if r["repeat"] == s["repeat"]
                and r["candidate"] in s["scores"] and r.get(run_key) is not None}
        if len(test) < len(s["scores"]):
            continue
        out.append({"repeat": s["repeat"], **_study(s["scores"], test, s["chosen"])})
    return sorted(out, key=lambda d: d["repeat"])


def _each(values: list[dict], key: str = "value", name: str | None = None) -> str:
    return ", ".join(("–" if v[key] is None else f"{v[key]:.1f}") + (f" ({v[name]})" if name else "") for v in values)


def _eps(values: list[float]) -> str:
    return ", ".join(f"{e:.3f}" for e in sorted(set(round(v, 3) for v in values))) or "–"


TEXT_NOTE = ("The same tables with each student's test perplexity on the text alone: the control-code header "
             "left out of the targets. Every student learns the header (DP-SGD from the records, ours from the DP "
             "teacher's prediction of it and, with α < 1, from the codes each sample was prompted with) and the "
             "windowed figure counts it; the text alone is what the student writes.")


RECORD_NOTE = ("The same tables with each student's per-record test perplexity, token-weighted: each record "
               "scored alone, the records' total NLL over their total tokens. The windowed figure joins the records "
               "and also scores tokens across their boundaries; this one does not.")


def _tables(results: list[dict], k: int = K, figure: str = "windowed") -> list[str]:
    if figure != "windowed":
        lines = [f"## {FIGURE_TITLES[figure]}: oracle (each method's best candidate by this figure)", "",
                 TEXT_NOTE if figure == "text" else RECORD_NOTE, ""]
    else:
        lines = ["## Oracle: each method's best candidate by test perplexity (an upper bound, not deployable)", ""]
    lines += [
             "| method | repeats | test perplexity (mean ± sd) | each repeat (best candidate) | ε of each run |",
             "|---|---:|---:|---|---:|"]
    for m in METHODS:
        v = oracle(results, m, k, figure)
        lines.append(f"| {LABELS[m]} | {len(v)} | {mean_sd([x['value'] for x in v])} | {_each(v, name='candidate')} "
                     f"| {_eps([x['epsilon'] for x in v])} |")
    lines += ["", "## Deployable: chosen without the test split, inside the same total ε"
              + (f" ({FIGURE_TITLES[figure].lower()})" if figure != "windowed" else ""), "",
              "| row | repeats | test perplexity (mean ± sd) | each repeat (chosen) | selection ε | total ε |",
              "|---|---:|---:|---|---:|---:|"]
    rows = [(m, m != "ours" or private, "validation", label) for m, private, label in (
        ("ours", False, "ours (zero-cost rule)"), ("ours", True, "ours (private selection)"),
        ("dpsgd", True, "DP-SGD (private selection)"), ("dpkd", True, "DPKD (private selection)"))]
    if _second_split(results):
        rows += [(m, True, "train+validation", f"{LABELS[m]} (private selection, training + validation)")
                 for m in METHODS]
    for m, private, split, label in rows:
        v = deployable(results, m, private, figure, split)
        lines.append(f"| {label} | {len(v)} | {mean_sd([x['value'] for x in v])} | {_each(v, name='chosen')} "
                     f"| {_eps([x['selection_epsilon'] for x in v])} | {_eps([x['epsilon'] for x in v])} |")
    return lines


def _second_split(results: list[dict]) -> bool:
    """Whether any private choice scored the training records too (the tables' extra rows)."""
    return any(s.get("kind") == "selection" and s.get("split", "validation") != "validation" for s in results)


def _candidate_table(results: list[dict]) -> list[str]:
    """Each candidate's test perplexity over the repeats, at the full ε and at the deployable one."""
    lines = ["", "## Candidates: test perplexity of each (mean ± sd over repeats)", "",
             "| method | candidate | at the full ε | at the deployable row's ε |", "|---|---|---:|---:|"]
    for m in METHODS:
        full: dict[str, list[float]] = {}
        shared: dict[str, list[float]] = {}
        if m == "ours":
            for row, into in (("ours", full), ("ourspriv", shared)):
                for r in _runs(results, row):
                    for c in _candidates(r):
                        into.setdefault(c["candidate"], []).append(c["test_perplexity"])
        else:
            for row, into in ((ORACLE_ROW[m], full), (PRIVATE_ROW[m], shared)):
                for r in _runs(results, row):
                    into.setdefault(r["candidate"], []).append(r["student"])
        for name in sorted(set(full) | set(shared)):
            lines.append(f"| {LABELS[m]} | {name} | {mean_sd(full.get(name, []))} | {mean_sd(shared.get(name, []))} |")
    return lines


def _rule_table(results: list[dict], figure: str = "windowed") -> list[str]:
    against = {"windowed": "test perplexity", "text": "test perplexity on the text alone",
               "record": "per-record token-weighted test perplexity"}[figure]
    lines = ["", f"## Selection on each method's candidates: Spearman ρ against {against} and regret", "",
             "| selection | runs | ρ (mean) | each run | regret (mean ± sd) | each run |", "|---|---:|---:|---|---:|---|"]
    studies = [(f"ours: {c}" + (" (the rule)" if c == "teacher_kl" else " (would have chosen)"),
                rule_study(results, "ours", criterion=None if c == "teacher_kl" else c, figure=figure))
               for c in ("teacher_kl", "untruncated_ce", "synthetic_validation_ce")]
    studies += [(f"{LABELS[m]}: private validation", rule_study(results, m, private=True, figure=figure))
                for m in METHODS]
    if _second_split(results):
        studies += [(f"{LABELS[m]}: private, training + validation",
                     rule_study(results, m, private=True, figure=figure, split="train+validation")) for m in METHODS]
    for label, s in studies:
        rho = ", ".join("–" if x["spearman"] is None else f"{x['spearman']:.2f}" for x in s)
        lines.append(f"| {label} | {len(s)} | {_mean([x['spearman'] for x in s], 2)} | {rho} "
                     f"| {mean_sd([x['regret'] for x in s])} | {_each(s, 'regret')} |")
    return lines


def _wall_table(results: list[dict]) -> tuple[list[str], float]:
    """Each run's wall seconds by row, the private choices' apart; and the total of all. A line
    transcribed without its seconds counts as a run and shows "–"."""
    def each(items: list[dict]) -> str:
        seconds = [r.get("seconds") for r in items]
        known = [s for s in seconds if s is not None]
        shown = ", ".join("–" if s is None else f"{s:.0f}" for s in seconds)
        return f"| {len(items)} | {shown} | {f'{statistics.mean(known):.0f}' if known else '–'} |"

    lines = ["", "## Wall time", "", "| row | runs | seconds each | mean s |", "|---|---:|---|---:|"]
    for row in ("ours", "ourspriv", "dpsgd", "dpsgddep", "dpkd", "dpkddep"):
        if runs := _runs(results, row):
            lines.append(f"| {row} {each(runs)}")
    if choices := [r for r in results if r.get("kind") == "selection"]:
        lines.append(f"| private choices {each(choices)}")
    return lines, sum(r.get("seconds") or 0.0 for r in results)


def report(results: list[dict], corpus: str, k: int = K) -> str:
    """The tables, then the summary lines; the last three are the issue's."""
    wall, total = _wall_table(results)
    lines = _tables(results, k) + _candidate_table(results) + _rule_table(results) + [""]
    for figure in ("text", "record"):
        lines += _tables(results, k, figure) + _rule_table(results, figure) + [""]
    lines += wall + [""]
    runs = [r for r in results if r.get("kind", "run") == "run"]
    lines.append(f"wall corpus={corpus} runs={len(runs)} selections={len(results) - len(runs)} "
                 f"seconds={total:.0f} hours={total / 3600:.1f}")
    dep = {m: mean_sd([x["value"] for x in deployable(results, m, private=True)]) for m in METHODS}
    lines.append(f"table=deployable-private corpus={corpus} " + " ".join(f"{m}={dep[m]}" for m in METHODS))
    for m in METHODS:
        s = rule_study(results, m, private=True)
        lines.append(f"private corpus={corpus} method={m} candidates={k} "
                     f"spearman={_mean([x['spearman'] for x in s], 2)} regret={_mean([x['regret'] for x in s], 1)}")
    if _second_split(results):
        both = {m: mean_sd([x["value"] for x in deployable(results, m, True, split="train+validation")])
                for m in METHODS}
        lines.append(f"table=deployable-private-trainval corpus={corpus} "
                     + " ".join(f"{m}={both[m]}" for m in METHODS))
        for m in METHODS:
            s = rule_study(results, m, private=True, split="train+validation")
            lines.append(f"private-trainval corpus={corpus} method={m} candidates={k} "
                         f"spearman={_mean([x['spearman'] for x in s], 2)} regret={_mean([x['regret'] for x in s], 1)}")
    for figure in ("text", "record"):
        best = {m: mean_sd([x["value"] for x in oracle(results, m, k, figure)]) for m in METHODS}
        chosen = {m: mean_sd([x["value"] for x in deployable(results, m, m != "ours", figure)]) for m in METHODS}
        rule = rule_study(results, "ours", figure=figure)
        lines.append(f"table=oracle-{figure} corpus={corpus} " + " ".join(f"{m}={best[m]}" for m in METHODS))
        lines.append(f"table=deployable-{figure} corpus={corpus} " + " ".join(f"{m}={chosen[m]}" for m in METHODS))
        lines.append(f"rule-{figure} corpus={corpus} candidates={k} spearman={_mean([x['spearman'] for x in rule], 2)} "
                     f"regret={_mean([x['regret'] for x in rule], 1)}")
    oracle_line = {m: mean_sd([x["value"] for x in oracle(results, m, k)]) for m in METHODS}
    dep["ours"] = mean_sd([x["value"] for x in deployable(results, "ours", private=False)])
    rule = rule_study(results, "ours")
    lines.append(f"table=oracle corpus={corpus} " + " ".join(f"{m}={oracle_line[m]}" for m in METHODS))
    lines.append(f"table=deployable corpus={corpus} " + " ".join(f"{m}={dep[m]}" for m in METHODS))
    lines.append(f"rule corpus={corpus} candidates={k} spearman={_mean([x['spearman'] for x in rule], 2)} "
                 f"regret={_mean([x['regret'] for x in rule], 1)}")
    return "\n".join(lines) + "\n"
