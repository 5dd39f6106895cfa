"""What the user takes home (issue 59, docs/utility.md): the student and the synthetic text of
ours, with the codes as a prompt the pretrained teacher understands, beside the ε = 0 control
(the same student distilled from the base teacher, no private record) and DP-SGD of the student
at the full ε. Three runs a row; resumable; every finished run appended to a tracked jsonl with
its config's digest (experiments/shared.py `config_digest`): a run whose row resolves to another
config today is kept out of the report, named at its end, and runs again.

    OMP_NUM_THREADS=1 nohup .venv/bin/python experiments/utility.py --config configs/smollm2_airline.yaml \
        --results docs/results/utility.jsonl > runs/real_model/utility.log 2>&1 &
    .venv/bin/python experiments/utility.py --config configs/smollm2_airline.yaml \
        --results docs/results/utility.jsonl --report-only

Rows (ROWS): `ours-header` (the codes as a header, HEADERS, as the configs shipped them before this
study), `ours` (the corpus's prompt template, PROMPTS), `ours-words` (Yelp's stars named in words in
the prompt, WORDS; on the tweets it is `ours`), `ours-kept` (ours' DP teacher and synthetic
text, run k's, reused from the stage cache: its student learns only from the samples the teacher
recognises as written for their codes, distill.keep_samples=code_adherent, and the classifier is
also trained on those alone; run it right after `ours`), `ours-long` (paired the same way: the
student distilled for 4 epochs of the same synthetic text instead of 1, the best on the synthetic
validation split kept, issue 59 item 5; `ours-8l` the same with an 8-layer student, the one the
tweets config ships; `ours-8l-gpu` and `ours-12l-gpu` with the students healed on a GPU,
bench/gpu_students.py), `public-only` (distill.method=public_only with the same prompt; no DP
noise, so its repeats differ by their seed; `public-only-words` the same with `ours-words`' prompt,
P22, and `public-only-words-2x` at the distillation rate the public proxy chose for ours, PROXY_RATE,
P34; `public-only-12l-gpu` with the 12-layer student, four epochs, P26) and `dp-sgd`
(distill.method=dp_sgd at the config's settings and its whole ε, on records with the
header, as it ran in issue 36; `dp-sgd-12l-gpu` the same with the 12-layer student, P26). A DP
row's repeat k > 1 reruns its method's first noisy stage and all after it (pipeline/methods.py
`noisy_stage`), as experiments/confirmation.py does. The test split
is each corpus's fixed one (Yelp's test file; the tweets' data.test_split=fixed, issue 60). Each
row pins the student and epochs it ran with (ROWS), whatever the config ships later. The table
gives each row's student on the codes' tokens alone too (experiments/privacy_utility.py).

The report ends with the issue's lines, one per code column and one per corpus:
`synthetic model=M corpus=C column=COL runs=K f1=M±S chance=C reference=R mauve=X` (ours' synthetic
text) and `student model=M corpus=C runs=K ours=M±S public_only=M±S dpsgd=M±S teacher=M±S
base_teacher=X` (windowed test perplexity), then the same student line on the text alone. Before
them, a paired row's `paired row=R corpus=C runs=K student_minus_ours=M±S text_minus_ours=M±S`:
each of its runs minus the ours run whose teacher and text it reused.

Its data: the SmolLM2 configs read the tweets and the Yelp split in ../shared/data beside the
checkout (not shipped; experiments/shared.py); without them it exits with one line (exit code 2)
before any work; `--report-only` needs no data. The models: `dpdistill models fetch smollm2-135m`
and `dpdistill models student smollm2-135m --layers 4` and `--layers 8` first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.confirmation import _result  # noqa: E402
from experiments.privacy_utility import CODES, record_tokens, tokens_path, with_codes  # noqa: E402
from experiments.shared import (  # noqa: E402
    PINNED, add_results_option, config_digest, finish, mean_sd, read_results, require_data, run_recorded, split_stale,
    stale_note, where_run)

# Yelp's raw star values ("Review Stars: 4.0") as its config shipped them before `ours-words` won:
# the rows that ran with them keep them.
STAR_VALUES = [f"Review Stars: {k}.0" for k in range(1, 6)]
RAW_STARS = ("data.code_values={}", "control_codes.domain.label2=" + json.dumps(STAR_VALUES))
# Each corpus's prompt (pipeline/prompts.py), with room for it: the chat-templated prompt is
# ~11 (tweets) and ~20 (Yelp) tokens longer than the header, so the rows that use it get that
# many more positions and every row keeps the same room for the text.
PROMPTS = {
    "smollm2-airline": ("data.prompt_template=Write a {sentiment} tweet to the airline {airline}.",
                        "data.system_prompt=''", "teacher.max_length=80", "generate.max_length=80"),
    "smollm2-yelp": ("data.prompt_template=Write a Yelp review of a business with these details. {label1}. {label2}.",
                     *RAW_STARS, "data.system_prompt=''", "teacher.max_length=116", "generate.max_length=116"),
}
# The codes named in words a 135M instruction-tuned model reads (issue 59, its goal for Yelp's
# stars; `ours-words`): Yelp's raw "Review Stars: k.0" become a sentiment and "k of 5 stars" through
# data.code_values, in the prompt and in the released distribution's public domain. A public probe
# chose the names (docs/utility.md, the plan); configs/smollm2_yelp.yaml ships them since P20 held.
# The tweets' codes are words already: their prompt.
STARS = {value: f"{word} ({k} of 5 stars)" for k, (value, word) in
         enumerate(zip(STAR_VALUES, ("very negative", "negative", "mixed", "positive", "very positive")), start=1)}
WORDS = {
    "smollm2-airline": PROMPTS["smollm2-airline"],
    "smollm2-yelp": ("data.prompt_template=Write a {label2} Yelp review of a business. {label1}.",
                     "data.code_values=" + json.dumps({"label2": STARS}),
                     "control_codes.domain.label2=" + json.dumps(list(STARS.values())),
                     "data.system_prompt=''", "teacher.max_length=116", "generate.max_length=116"),
}
# The distillation rate the public proxy chose for ours (experiments/public_proxy.py; 2 × the pinned
# 3e-4 on Yelp, the rate configs/smollm2_yelp.yaml ships): `public-only-words-2x`, the ε = 0 control
# at ours' rate when ours runs at the proxy's choice (the README's row, P34-P35).
PROXY_RATE = {"smollm2-yelp": ("distill.learning_rate=0.0006",)}
PAIRED = "paired"
"""A row that reuses the DP teacher and synthetic text `ours` run k just made (its stages cached)."""
# The header form as each corpus's config shipped it before this study (the tweets' 64 positions,
# Yelp's 96), whatever the config ships now: the rows that compare against it keep it. (Yelp's
# header rows that took the tweets' 64 are kept in docs/results/utility_yelp_header64.jsonl.)
HEADERS = {corpus: ("data.prompt_template=null", "data.system_prompt=null", f"teacher.max_length={n}",
                    f"generate.max_length={n}", *pin) for corpus, n, pin in (("smollm2-airline", 64, ()),
                                                                             ("smollm2-yelp", 96, RAW_STARS))}
# row: (overrides, the stage whose rerun draws fresh DP noise; None: repeats differ by their seed;
# PAIRED: the row after `ours` in each repeat, on its teacher and text)
# The rows pin their student and epochs: the tweets config ships what won (8 layers, `ours-8l`; 4
# epochs, `ours-long`), the rows keep what they ran with, so a later run of a row matches its first.
FOUR, EIGHT = "distill.student_model=cache:smollm2-135m-4l", "distill.student_model=cache:smollm2-135m-8l"
EIGHT_GPU = "distill.student_model=cache:smollm2-135m-8l-gpu"  # healed 47x longer on a GPU (bench/gpu_students.py)
TWELVE_GPU = "distill.student_model=cache:smollm2-135m-12l-gpu"  # 12 of 30 layers, healed as EIGHT_GPU
ROWS = {
    "ours-header": (("distill.method=distil", "HEADER", FOUR, "distill.epochs=1"), "control-codes"),
    "ours": (("distill.method=distil", "PROMPT", FOUR, "distill.epochs=1"), "control-codes"),
    "ours-words": (("distill.method=distil", "WORDS", FOUR, "distill.epochs=1"), "control-codes"),
    "ours-kept": (("distill.method=distil", "PROMPT", FOUR, "distill.epochs=1", "distill.keep_samples=code_adherent"),
                  PAIRED),
    "ours-long": (("distill.method=distil", "PROMPT", FOUR, "distill.epochs=4"), PAIRED),
    "ours-8l": (("distill.method=distil", "PROMPT", EIGHT, "distill.epochs=4"), PAIRED),
    "ours-8l-gpu": (("distill.method=distil", "PROMPT", EIGHT_GPU, "distill.epochs=4"), PAIRED),
    "ours-12l-gpu": (("distill.method=distil", "PROMPT", TWELVE_GPU, "distill.epochs=4"), PAIRED),
    "public-only": (("distill.method=public_only", "PROMPT", FOUR, "distill.epochs=1"), None),
    "public-only-words": (("distill.method=public_only", "WORDS", FOUR, "distill.epochs=1"), None),
    "public-only-words-2x": (("distill.method=public_only", "WORDS", FOUR, "distill.epochs=1", "PROXY_RATE"), None),
    "public-only-12l-gpu": (("distill.method=public_only", "PROMPT", TWELVE_GPU, "distill.epochs=4"), None),
    "dp-sgd": (("distill.method=dp_sgd", "HEADER", FOUR), "dp-student"),
    "dp-sgd-12l-gpu": (("distill.method=dp_sgd", "HEADER", TWELVE_GPU), "dp-student"),
}


NAMED = {"PROMPT": PROMPTS, "HEADER": HEADERS, "WORDS": WORDS, "PROXY_RATE": PROXY_RATE}  # a row's per-corpus settings


def lacks(row: str, corpus: str) -> str | None:
    """The per-corpus settings (NAMED) `row` names that `corpus` has none of (PROXY_RATE where the
    proxy has not chosen for it), else None."""
    return next((o for o in ROWS[row][0] if o in NAMED and corpus not in NAMED[o]), None)


def overrides(row: str, corpus: str, repeat: int, epsilon: float | None = None) -> list[str]:
    """The row's overrides on the corpus's config (the prompt where the row names it). With
    `epsilon` (the privacy-utility sweep): the run's total target, spent as the configs spend it,
    a tenth on the control codes and the rest on DP-SGD (the DP-SGD student: all of it)."""
    out = list(PINNED.get(corpus, ()))
    if missing := lacks(row, corpus):
        raise SystemExit(f"experiments/utility.py: row {row} has no {missing} for {corpus} (it has one for "
                         f"{', '.join(NAMED[missing])}); run another row or add the corpus's to {missing}")
    for o in ROWS[row][0]:
        out += list(NAMED[o][corpus]) if o in NAMED else [o]
    if ROWS[row][1] is None:
        out.append(f"seed={repeat - 1}")
    elif epsilon is not None:
        codes = row != "dp-sgd"
        out += [f"teacher.target_epsilon={epsilon * (0.9 if codes else 1):.6g}"]
        out += [f"control_codes.epsilon={epsilon * 0.1:.6g}"] if codes else []
    return out


def run_one(config: str, corpus: str, row: str, repeat: int, extra: list[str], epsilon: float | None = None,
            paired_with: dict | None = None) -> dict:
    from flows.pipeline_flow import dp_distill
    from flows.run_info import stages_to_rerun
    from pipeline.config import load_config

    cfg = load_config(config, [*overrides(row, corpus, repeat, epsilon), *extra])
    digest = config_digest(cfg)
    tag = "" if epsilon is None else f"-e{epsilon:g}"
    cfg = cfg.model_copy(update={"name": f"{cfg.name}-{row.replace('-', '')}{tag}-r{repeat}"})
    noisy = ROWS[row][1]
    t0 = time.monotonic()
    fresh = repeat > 1 and noisy not in (None, PAIRED)
    run_dir = Path(dp_distill(cfg, rerun=stages_to_rerun(noisy, None) if fresh else None))
    out = _result(row, repeat, run_dir, time.monotonic() - t0) | where_run(cfg)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    ppl = metrics["perplexity"]
    out["base_teacher"] = ppl.get("base_teacher", {}).get("windowed")
    out["base_teacher_text"] = ppl.get("base_teacher", {}).get("text_only", {}).get("windowed")
    if kept := metrics.get("downstream_kept"):  # ours-kept: the classifier on the samples kept alone
        out["downstream_kept"] = {c: {"macro_f1": v["synthetic"]["macro_f1"], "synthetic_train": v["synthetic_train"]}
                                  for c, v in kept["columns"].items() if "synthetic" in v}
    out["target_epsilon"] = epsilon  # None: the config's own (about 2), the study's main rows
    out["config_digest"] = digest
    if paired_with is not None:
        out |= pairing(run_dir, out["dp_teacher"], paired_with)
    return out


def pairing(run_dir: Path, dp_teacher: float, paired_with: dict) -> dict:
    """Whether a paired row's run reused the DP teacher of the ours run it names. The stage cache
    is keyed by config, inputs and seed, not by run: another study's run with the same settings,
    a fresh-noise repeat too, is its latest entry for that key and serves its teacher instead
    (2026-11-30: Yelp's ours run 1 key served public_proxy.py's private ours run). The run's
    stages.json names the run the teacher came from; the same DP teacher also scores the same
    test split the same."""
    from flows.run_info import STAGES_INFO

    stages = json.loads((run_dir / STAGES_INFO).read_text())
    teacher_from = str(Path(stages["teacher"]["output"]).parent)
    same = teacher_from == paired_with["run_dir"] and dp_teacher == paired_with["dp_teacher"]
    if not same:
        print(f"experiments/utility.py: {run_dir.name} reused the DP teacher of {teacher_from}, not of "
              f"{paired_with['run_dir']}: recorded as not paired", file=sys.stderr)
    return {"paired_with": paired_with["run_dir"], "teacher_from": teacher_from, "paired": same}


def _codes_minus_ours(pairs: list[tuple[dict, dict]]) -> str:
    """The pairs' difference on the codes' tokens alone, where both runs' counts are recorded."""
    diffs = [r[CODES] - o[CODES] for r, o in pairs if CODES in r and CODES in o]
    return f" codes_minus_ours={mean_sd(diffs)}" if len(diffs) == len(pairs) else ""


def report(results: list[dict], corpus: str, model: str) -> str:
    by_row: dict[str, list[dict]] = {}
    for r in results:
        by_row.setdefault(r["row"], []).append(r)
    lines = ["| row | runs | student windowed | student text alone | student, the codes' tokens alone | DP teacher "
             "| DP teacher, text alone | MAUVE | ε (total) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in ROWS:
        rs = by_row.get(row, [])
        if rs:
            lines.append(f"| {row} | {len(rs)} | {mean_sd([r['student'] for r in rs])} "
                         f"| {mean_sd([r['student_text_windowed'] for r in rs])} | {mean_sd([r.get(CODES) for r in rs])} "
                         f"| {mean_sd([r.get('dp_teacher') for r in rs])} | {mean_sd([r.get('dp_teacher_text') for r in rs])} "
                         f"| {mean_sd([r.get('mauve') for r in rs], 3)} | {mean_sd([r['epsilon'] for r in rs], 3)} |")
    out = "\n".join(lines) + "\n\n"
    ours = by_row.get("ours", [])
    out += _synthetic_lines(ours, f"model={model} corpus={corpus}", need_reference=True)
    for row in ("ours-header", "ours-words", "public-only", "public-only-words",
                "public-only-words-2x"):  # the other rows' text (P1, P20, P22, P34)
        out += _synthetic_lines(by_row.get(row, []), f"row={row} model={model} corpus={corpus}")
    kept = by_row.get("ours-kept", [])  # issue 59 item 4: the classifier on the samples the teacher recognises
    for column in sorted({c for r in kept for c in r.get("downstream_kept", {})}):
        scores = [r["downstream_kept"][column] for r in kept if column in r.get("downstream_kept", {})]
        out += (f"synthetic-kept model={model} corpus={corpus} column={column} runs={len(scores)} "
                f"f1={mean_sd([s['macro_f1'] for s in scores], 3)} "
                f"samples={mean_sd([s['synthetic_train'] for s in scores], 0)} "
                f"paired={sum(bool(r.get('paired')) for r in kept)}\n")
    for row in (r for r, spec in ROWS.items() if spec[1] == PAIRED):  # each run minus the ours run it reused
        pairs = [(r, o) for r in by_row.get(row, []) for o in ours
                 if r.get("paired") and r.get("paired_with") == o.get("run_dir")]
        if pairs:
            out += (f"paired row={row} corpus={corpus} runs={len(pairs)} "
                    f"student_minus_ours={mean_sd([r['student'] - o['student'] for r, o in pairs])} "
                    f"text_minus_ours={mean_sd([r['student_text_windowed'] - o['student_text_windowed'] for r, o in pairs])}"
                    f"{_codes_minus_ours(pairs)}\n")
    # the student lines; then the same for the stars named in words (P22) and the 12-layer
    # student (P26), where their ε = 0 control ran
    for tag, mine, control, dpsgd in (("", "ours", "public-only", "dp-sgd"),
                                      ("row=words ", "ours-words", "public-only-words", "dp-sgd"),
                                      ("row=12l ", "ours-12l-gpu", "public-only-12l-gpu", "dp-sgd-12l-gpu")):
        if tag and not by_row.get(control):
            continue
        for key, what in (("student", ""), ("student_text_windowed", " figure=text_alone")):
            out += _student_line(by_row, mine, control, dpsgd, key, f"{tag}model={model} corpus={corpus}{what}")
    return out


def _student_line(by_row: dict[str, list[dict]], mine: str, control: str, dpsgd: str, key: str, what: str) -> str:
    """`student WHAT runs=K ours=M±S public_only=M±S dpsgd=M±S teacher=M±S base_teacher=X` of row
    `mine` against the ε = 0 row `control` and DP-SGD's row `dpsgd` (the figure `key`); empty while
    `mine` has no base teacher."""
    ours = by_row.get(mine, [])
    teacher_key, base_key = ("dp_teacher", "base_teacher") if key == "student" else ("dp_teacher_text",
                                                                                   "base_teacher_text")
    base = [r[base_key] for r in ours if r.get(base_key) is not None]
    if not base:
        return ""
    runs = min(len(by_row.get(row, [])) for row in (mine, control, dpsgd))
    return (f"student {what} runs={runs} ours={mean_sd([r[key] for r in ours])} "
            f"public_only={mean_sd([r[key] for r in by_row.get(control, [])])} "
            f"dpsgd={mean_sd([r[key] for r in by_row.get(dpsgd, [])])} "
            f"teacher={mean_sd([r.get(teacher_key) for r in ours])} base_teacher={statistics.mean(base):.1f}\n")


def _synthetic_lines(rs: list[dict], what: str, need_reference: bool = False) -> str:
    """A `synthetic WHAT column=COL runs=K f1=M±S chance=C [reference=R] mauve=X` line per code
    column the runs `rs` scored their synthetic text on (with `need_reference`: only a column that
    has the real-data reference, the issue's lines)."""
    out = ""
    for column in sorted({c for r in rs for c in r.get("downstream", {})}):
        scores = [r["downstream"][column] for r in rs if column in r.get("downstream", {})]
        ref = [s["real_reference_macro_f1"] for s in scores if s.get("real_reference_macro_f1") is not None]
        if ref or not need_reference:
            out += (f"synthetic {what} column={column} runs={len(scores)} "
                    f"f1={mean_sd([s['macro_f1'] for s in scores], 3)} chance={scores[0]['chance_macro_f1']:.3f} "
                    + (f"reference={statistics.mean(ref):.3f} " if ref else "")
                    + f"mauve={mean_sd([r.get('mauve') for r in rs], 3)}\n")
    return out


def digests(config: str, extra: list[str]):
    """`digest_of(line)` for `split_stale`: the config digest the line's row, repeat and ε resolve to
    today under `extra` (every run's overrides), None for a row since retired (no config to compare:
    a line of it that records a digest is kept out)."""
    from pipeline.config import load_config

    name, memo = load_config(config, extra).name, {}

    def digest_of(r: dict) -> str | None:
        key = (r["row"], r["repeat"], r.get("target_epsilon"))
        if key not in memo:
            row = overrides(r["row"], name, r["repeat"], r.get("target_epsilon")) if r["row"] in ROWS else None
            memo[key] = None if row is None else config_digest(load_config(config, [*row, *extra]))
        return memo[key]
    return digest_of


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    p.add_argument("--config", default="configs/smollm2_airline.yaml")
    p.add_argument("--rows", default=None, help="rows to run, e.g. ours,public-only (default: every row the "
                   "config's corpus has the settings of)")
    p.add_argument("--repeats", type=int, default=3, help="runs per row")
    p.add_argument("--runs", default=None, help="only these repeats, e.g. 3 or 2,3 (a paired row pairs with the "
                   "ours run whose teacher the stage cache holds: the last one run)")
    p.add_argument("--epsilon", type=float, default=None,
                   help="the privacy-utility sweep (issue 59 item 6): run the rows at this total target ε "
                   "instead of the config's; the main rows' report leaves these runs out")
    add_results_option(p, "utility.jsonl")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)
    if cfg.name not in PROMPTS:
        print(f"experiments/utility.py: no prompt for config {cfg.name!r}; add one to PROMPTS", file=sys.stderr)
        return 2
    rows = args.rows.split(",") if args.rows else [row for row in ROWS if not lacks(row, cfg.name)]
    if unknown := [row for row in rows if row not in ROWS]:
        print(f"experiments/utility.py: no row {', '.join(unknown)}; the rows: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    for row in rows:
        overrides(row, cfg.name, 1)  # a row without its corpus's settings: one error before the data is read
    if not args.report_only:
        require_data(cfg, "experiments/utility.py", args.config)
    root = Path(cfg.run_root)
    root.mkdir(parents=True, exist_ok=True)
    results_path = args.results or root / "utility.jsonl"
    model = cfg.teacher.model.removeprefix("cache:")
    failed = []
    repeats = [int(k) for k in args.runs.split(",")] if args.runs else range(1, args.repeats + 1)
    schedule = [(row, k) for k in repeats for row in rows]
    digest_of = digests(args.config, args.overrides)

    def current(stale: list | None = None) -> list[dict]:  # the lines of today's configs (a changed one runs again)
        out, old = split_stale(read_results(results_path, cfg.name), digest_of)
        if stale is not None:
            stale += old
        return out

    for row, k in [] if args.report_only else schedule:
        if any(r["row"] == row and r["repeat"] == k and r.get("target_epsilon") == args.epsilon for r in current()):
            continue
        paired_with = None
        if ROWS[row][1] == PAIRED:
            paired_with = next((r for r in current() if r["row"] == "ours"
                                and r["repeat"] == k and r.get("target_epsilon") == args.epsilon), None)
            if paired_with is None:
                print(f"experiments/utility.py: {row} run {k} reuses ours run {k}'s teacher and text, which is not "
                      f"done: run the rows ours,{row} in that order", file=sys.stderr)
                continue
        run_recorded(results_path, cfg.name, f"{row} run {k}",
                     lambda row=row, k=k, p=paired_with: run_one(args.config, cfg.name, row, k, list(args.overrides),
                                                                 args.epsilon, p),
                     failed)
        record_tokens(results_path, tokens_path(results_path))  # the codes' tokens' perplexity needs them
    stale = []
    main_rows = [r for r in current(stale) if r.get("target_epsilon") is None]
    main_rows = with_codes(main_rows, read_results(tokens_path(results_path)))
    text = report(main_rows, cfg.name, model) + stale_note(
        stale, lambda r: f"{r['row']} run {r['repeat']}" + (f" at ε {e:g}" if (e := r.get("target_epsilon")) else ""))
    return finish(root / f"{cfg.name}-utility.md", text, failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
