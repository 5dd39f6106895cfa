"""The baseline a user would run (issue 60 item 3, docs/baselines.md "Settings chosen on a public
proxy"): each method at the whole ε, its learning rate chosen on a public proxy corpus, free of
any private record, beside the config's own setting. Resumable; every run appended to a tracked jsonl
with its config's digest (experiments/shared.py `config_digest`): a run whose config has changed
since (a config that ships another setting) is kept out of the report and the README, named at
the report's end, and runs again. Lines recorded before the digest (2026-12-02) cannot be
checked; the docs name those that ran another config.

    OMP_NUM_THREADS=1 nohup .venv/bin/python experiments/public_proxy.py --config configs/reference.yaml \
        --proxy configs/airline.yaml --results docs/results/public_proxy.jsonl > runs/public_proxy.log 2>&1 &
    .venv/bin/python experiments/public_proxy.py --config configs/reference.yaml --proxy configs/airline.yaml \
        --results docs/results/public_proxy.jsonl --report-only

Two phases per method (ours, DP-SGD of the student, DPKD; and, issue 59 item 3, ours' DP teacher:
`teacher`, its learning rate, `teacher-lora`, the same with LoRA adapters, `teacher-epochs`, its
epochs at the same ε):
1. **Proxy.** One run of each candidate of the method's first grid (`Study.grid`, multiples of the
   private config's value of its field: `distill.learning_rate` for ours, `teacher.learning_rate`
   for the DP-SGD students, which train with the teacher section, and for `teacher`,
   `teacher.epochs` for `teacher-epochs`) on the proxy config with the private config's models
   and schedule (`same_training`; the candidate set last), treated as public: its test split may
   be read. The candidate of lowest windowed test perplexity there (the student's; for the
   teacher's studies, the DP teacher's) is chosen; while it is the grid's largest or smallest,
   the grid grows by one more factor of 2 that way (at most `EXTEND` times up, down to the study's
   `lowest`), so that the chosen one is interior. At multiple 1 ours and the full teacher's
   studies run the same config: their runs count for all of them.
2. **Private.** The chosen learning rate and the config's own (multiple 1), three runs each on
   the private config at its whole ε (fresh DP noise each: the noisy stage is rerun), on its
   fixed test split (issue 60). Where the config has shipped a choice since, the study keeps the
   settings it ran with (experiments/shared.py `PINNED`). Runs of experiments/utility.py whose
   config is the one a private run at the config's own has (the tweets' `ours-8l`) fill the
   repeats it lacks there (`utility_runs`: runs shared with the utility issue count for both).

The report ends with `teacher corpus=NAME settings=chosen|default ...` (and `teacher-lora ...`,
`teacher-epochs ...` once they have run: the DP teacher, the student, MAUVE and the synthetic
text's classifier, with the teacher's chosen setting and the config's),
then `table=deployable-public corpus=NAME ours=M±S dpsgd=M±S dpkd=M±S` (windowed test perplexity of
the chosen settings) and `table=defaults corpus=NAME ...` (the config's).

Its data: the configs read the Yelp split and the tweets in ../shared/data beside the checkout
(not shipped; experiments/shared.py); without them it exits with one line (exit code 2) before
any work; `--report-only` needs no data.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.confirmation import _result  # noqa: E402
from experiments.shared import (  # noqa: E402
    PINNED, add_results_option, config_digest, config_path, finish, mean_sd, read_results, require_data, run_recorded,
    shared_teacher_note, split_stale, stale_note, where_run)

MULTIPLES = (0.5, 1.0, 2.0, 4.0)  # the first grid, × the private config's value
REPEATS = 3  # private runs at each of the chosen and the config's settings
EXTEND = 3  # at most this many more factors of 2 past the grid's edge


@dataclass(frozen=True)
class Study:
    """One method of the harness. A repeat reruns its distill.method's first noisy stage and all
    after it (pipeline/methods.py `noisy_stage`; DPKD's teacher too since 2026-11-30, before: its
    dp-student alone, so its repeats shared one DP teacher)."""

    method: str  # its distill.method
    field: str  # the setting its candidates set, as multiples of the private config's value
    figure: str  # the proxy's windowed test perplexity it is chosen by: the student's or the DP teacher's
    fixed: tuple[str, ...] = ()  # overrides every run of it has
    grid: tuple[float, ...] = MULTIPLES  # its first grid
    lowest: float = min(MULTIPLES) / 2 ** EXTEND  # the smallest multiple the grid may grow to


METHODS = {"ours": Study("distil", "distill.learning_rate", "student"),
           "dpsgd": Study("dp_sgd", "teacher.learning_rate", "student"),
           "dpkd": Study("dpkd", "teacher.learning_rate", "student"),
           # Issue 59 item 3: ours' DP teacher, chosen by the DP teacher's own figure: its learning
           # rate; the same with LoRA adapters in place of the full model (docs/utility.md, P28-P30);
           # its epochs at the same ε, more and noisier steps (whole epochs from the config's one, P31-P33)
           "teacher": Study("distil", "teacher.learning_rate", "dp_teacher"),
           "teacher-lora": Study("distil", "teacher.learning_rate", "dp_teacher", ("teacher.mode=lora",)),
           "teacher-epochs": Study("distil", "teacher.epochs", "dp_teacher", grid=(1.0, 2.0, 4.0), lowest=1.0)}
TABLE = ("ours", "dpsgd", "dpkd")  # the methods of the table= lines
TEACHERS = [m for m, study in METHODS.items() if study.figure == "dp_teacher"]  # their teacher= lines


def _value(cfg, field: str) -> float:
    section, name = field.split(".")
    return getattr(getattr(cfg, section), name)


def run_one(config: str, method: str, multiple: float, base: float, phase: str, repeat: int, extra: list[str]) -> dict:
    from flows.pipeline_flow import dp_distill
    from flows.run_info import stages_to_rerun
    from pipeline.config import load_config

    cfg = load_config(config, run_overrides(method, multiple, base, extra))
    digest = config_digest(cfg)
    cfg = cfg.model_copy(update={"name": f"{cfg.name}-{phase}-{method}-m{multiple:g}-r{repeat}"})
    t0 = time.monotonic()
    run_dir = Path(dp_distill(cfg, rerun=stages_to_rerun(noisy_stage(method), None) if repeat > 1 else None))
    field = METHODS[method].field
    setting = {"learning_rate" if field.endswith("learning_rate") else field: base * multiple}
    return {"phase": phase, "method": method, "multiple": multiple, **setting,
            **_result(method, repeat, run_dir, time.monotonic() - t0), **where_run(cfg), "config_digest": digest}


def run_overrides(method: str, multiple: float, base: float, extra: list[str]) -> list[str]:
    """A run's overrides: the candidate last, so that neither a pin (PINNED) nor the proxy's
    schedule (`same_training`) nor the method's fixed overrides can set its field back."""
    study = METHODS[method]
    return [f"distill.method={study.method}", *extra, *study.fixed, f"{study.field}={base * multiple:.6g}"]


def noisy_stage(method: str) -> str | None:
    """The stage a private repeat of `method` reruns, with all after it, for fresh DP noise."""
    from pipeline.methods import method_spec

    return method_spec(METHODS[method].method).noisy_stage


def same_training(cfg) -> list[str]:
    """The proxy's runs train the private config's models on its schedule (epochs, batch sizes),
    on the proxy's public data at the proxy's lengths and prompt: the learning rate is chosen for
    the training the private runs do (the tweets config ships an 8-layer student distilled for 4
    epochs, SmolLM2 Yelp a 4-layer one for 1; the builtin pair's schedules are the same)."""
    return [f"teacher.model={cfg.teacher.model}", f"teacher.epochs={cfg.teacher.epochs}",
            f"teacher.batch_size={cfg.teacher.batch_size}", f"distill.student_model={cfg.distill.student_model}",
            f"distill.epochs={cfg.distill.epochs}", f"distill.batch_size={cfg.distill.batch_size}"]


def digests(config: str, proxy: str | None, overrides: list[str]):
    """`digest_of(line)` for `split_stale`: the config digest a run of the line's method, phase and
    multiple has today (`config`, `proxy`: the configs' paths, None for the proxy: the one the line
    names, configs/<name>.yaml; `overrides`: every run's, as main's)."""
    from pipeline.config import load_config

    cfg = load_config(config, [*PINNED.get(load_config(config).name, ()), *overrides])
    pins = list(PINNED.get(cfg.name, ()))
    memo = {}

    def digest_of(r: dict) -> str:
        path = config if r["phase"] == "private" else proxy or config_path(r["proxy"])
        key = (r["phase"], r["method"], r["multiple"], str(path))
        if key not in memo:
            extra = [*(same_training(cfg) if r["phase"] == "proxy" else pins), *overrides]
            memo[key] = config_digest(load_config(path, run_overrides(r["method"], r["multiple"],
                                                                      _value(cfg, METHODS[r["method"]].field), extra)))
        return memo[key]
    return digest_of


def runs_of(results: list[dict], method: str, phase: str, multiple: float | None = None) -> list[dict]:
    """The runs of `method` in `phase` (at `multiple`). At multiple 1 a method runs the config as it
    is, as another method of the same distill.method and fixed overrides does (ours and teacher):
    their runs count for both (not teacher-lora's, whose teacher is another)."""
    same = {m for m, study in METHODS.items()
            if (study.method, study.fixed) == (METHODS[method].method, METHODS[method].fixed)}
    return [r for r in results if r["phase"] == phase and (multiple is None or r["multiple"] == multiple)
            and (r["method"] == method or (r["multiple"] == 1.0 and r["method"] in same))]


def with_shared(results: list[dict], shared: list[dict], method: str, repeats: int = REPEATS) -> list[dict]:
    """`results` with the utility study's runs of the same config (`utility_runs`) filling the
    repeats `method`'s private runs at the config's own setting still lack (issue 60: runs shared
    with the utility issue count for both); a corpus whose harness ran its own keeps them alone."""
    own = {r["repeat"] for r in runs_of(results, method, "private", 1.0)}
    free = [k for k in range(1, repeats + 1) if k not in own]
    return results + [{**r, "repeat": k} for k, r in zip(free, shared)]


def utility_runs(path: Path, config: str, method: str, base: float, extra: list[str]) -> list[dict]:
    """The runs of experiments/utility.py in `path` whose resolved config is the one this harness's
    private run of `method` at multiple 1 has, as such runs (a paired row's run that did not get
    its own DP teacher is left out: its draw is another's). `config` is the private config's path,
    `extra` the private runs' overrides."""
    from experiments.utility import ROWS, overrides
    from pipeline.config import load_config

    ours = load_config(config, run_overrides(method, 1.0, base, extra))
    digest, out = config_digest(ours), []
    for r in read_results(path, ours.name):
        if r.get("paired") is False or r["row"] not in ROWS:  # a row since retired: no config to compare
            continue
        row = overrides(r["row"], ours.name, r["repeat"], r.get("target_epsilon"))
        same = load_config(config, [*row, *extra]) == ours  # both under this call's overrides (a run_root)
        if same and r.get("config_digest", digest) == digest:  # not a run recorded with another config
            out.append({**r, "phase": "private", "method": method, "multiple": 1.0,
                        "shared_from": (r["row"], r["repeat"])})
    return out


def _proxy(results: list[dict], method: str) -> dict[float, float]:
    """The proxy's figure of each multiple run: the one `method` is chosen by."""
    return {r["multiple"]: r[METHODS[method].figure] for r in runs_of(results, method, "proxy")}


def chosen(results: list[dict], method: str) -> float | None:
    """The proxy's choice: the multiple of lowest windowed test perplexity, once the first grid has
    run in full and the best is interior to the multiples run (or the grid can grow no more); None
    while the grid still has to run or grow."""
    runs = _proxy(results, method)
    if not runs or any(m not in runs for m in METHODS[method].grid):
        return None
    best = min(runs, key=runs.get)
    if min(runs) < best < max(runs) or next_multiple(runs, best, method) is None:
        return best
    return None


def next_multiple(runs: dict[float, float], best: float, method: str) -> float | None:
    """The multiple to run next on the proxy: the first grid's, then one factor of 2 past the edge
    the best sits on; None when it may grow no more (EXTEND factors past the first grid upwards;
    downwards no further than the study's lowest)."""
    study = METHODS[method]
    missing = [m for m in study.grid if m not in runs]
    if missing:
        return missing[0]
    edge = max(runs) * 2 if best == max(runs) else min(runs) / 2
    allowed = max(study.grid) * 2 ** EXTEND >= edge >= study.lowest
    return edge if allowed else None


def report(results: list[dict], corpus: str) -> str:
    lines = ["| method | proxy: multiple → windowed test perplexity (teacher: the DP teacher's) | chosen "
             "| private: chosen, windowed | text alone | private: the config's, windowed | text alone |",
             "|---|---|---:|---:|---:|---:|---:|"]
    summary = {"chosen": {}, "default": {}}
    for method in METHODS:
        if method not in TABLE and not any(r["method"] == method for r in results):
            continue  # a teacher's study not yet run on this corpus (ours' runs at 1 × are not its start)
        pick = chosen(results, method)
        cells = []
        for m, key in ((pick, "chosen"), (1.0, "default")):
            runs = runs_of(results, method, "private", m) if m is not None else []
            summary[key][method] = runs
            cells += [mean_sd([r["student"] for r in runs]), mean_sd([r["student_text_windowed"] for r in runs])]
        proxy = ", ".join(f"{m:g} → {p:.1f}" for m, p in sorted(_proxy(results, method).items()))
        lines.append(f"| {method} | {proxy or '–'} | {'–' if pick is None else f'{pick:g}'} | " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n\n"
    for m in ("dpsgd", "dpkd"):  # runs meant as independent draws that share a DP teacher
        for key, what in (("chosen", "the chosen rate"), ("default", "the config's rate")):
            if key == "default" or chosen(results, m) != 1.0:
                out += shared_teacher_note(f"{m}, private at {what}", summary[key][m])
    for m in TABLE:
        if borrowed := [r["shared_from"] for r in summary["default"][m] if "shared_from" in r]:
            rows = {row: [k for x, k in borrowed if x == row] for row, _ in borrowed}
            out += (f"{m}, private at the config's rate: {len(borrowed)} run(s) of experiments/utility.py, the same config ("
                    + "; ".join(f"row {row}, repeats {', '.join(map(str, ks))}" for row, ks in rows.items()) + ")\n")
    for method, settings in [(m, k) for m in TEACHERS for k in ("chosen", "default")
                             if m in summary[k]]:  # issue 59 item 3: what the teacher's choice does to the text
        runs = summary[settings][method]
        multiple = chosen(results, method) if settings == "chosen" else 1.0
        columns = sorted({c for r in runs for c in r.get("downstream", {})})
        out += (f"{method} corpus={corpus} settings={settings} multiple={'–' if multiple is None else f'{multiple:g}'} "
                f"runs={len(runs)} dp_teacher={mean_sd([r['dp_teacher'] for r in runs])} "
                f"student={mean_sd([r['student'] for r in runs])} "
                f"text={mean_sd([r['student_text_windowed'] for r in runs])} "
                f"mauve={mean_sd([r.get('mauve') for r in runs], 3)}"
                + "".join(f" f1.{c}={mean_sd([r['downstream'][c]['macro_f1'] for r in runs if c in r['downstream']], 3)}"
                          for c in columns)
                + "\n")
    for table, key in (("deployable-public", "chosen"), ("defaults", "default")):
        out += f"table={table} corpus={corpus} " + " ".join(
            f"{m}={mean_sd([r['student'] for r in summary[key][m]])}" for m in TABLE) + "\n"
    return out


def _todo(results: list[dict], method: str, repeats: int) -> tuple[str, float, int] | None:
    """The next run of `method`: a proxy candidate, else a private repeat of the chosen or the default."""
    proxy = _proxy(results, method)
    pick = chosen(results, method)
    if pick is None:
        return "proxy", next_multiple(proxy, min(proxy, key=proxy.get), method) if proxy else METHODS[method].grid[0], 1
    for m in dict.fromkeys((pick, 1.0)):
        done = {r["repeat"] for r in runs_of(results, method, "private", m)}
        if missing := [k for k in range(1, repeats + 1) if k not in done]:
            return "private", m, missing[0]
    return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    p.add_argument("--config", required=True, help="the private corpus's config")
    p.add_argument("--proxy", required=True, help="the public proxy's config (the other corpus, treated as public)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--proxy-only", action="store_true",
                   help="stop each method once its proxy has chosen (its private runs wait for a later call)")
    add_results_option(p, "public_proxy.jsonl")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    from pipeline.config import load_config

    pins = list(PINNED.get(load_config(args.config).name, ()))  # the study's private runs keep them
    cfg, proxy = load_config(args.config, [*pins, *args.overrides]), load_config(args.proxy, args.overrides)
    if not args.report_only:
        require_data(cfg, "experiments/public_proxy.py", args.config)
        require_data(proxy, "experiments/public_proxy.py", args.proxy)
    results_path = args.results or Path(cfg.run_root) / "public_proxy.jsonl"
    shared = {m: utility_runs(results_path.parent / "utility.jsonl", args.config, m, _value(cfg, METHODS[m].field),
                              [*pins, *args.overrides]) for m in METHODS}

    digest_of = digests(args.config, args.proxy, args.overrides)

    def results(stale: list | None = None) -> list[dict]:
        out, old = split_stale(read_results(results_path, cfg.name), digest_of)
        if stale is not None:
            stale += old
        for m in METHODS:
            out = with_shared(out, shared[m], m, args.repeats)
        return out

    failed = []
    for method in [] if args.report_only else args.methods.split(","):
        base = _value(cfg, METHODS[method].field)  # candidates are multiples of the private config's value
        while (todo := _todo(results(), method, args.repeats)) is not None:
            phase, multiple, repeat = todo
            if phase == "private" and args.proxy_only:
                break
            done = run_recorded(
                results_path, cfg.name, f"{method} {phase} m={multiple:g} r{repeat}",
                lambda: run_one(args.proxy if phase == "proxy" else args.config, method, multiple, base, phase, repeat,
                                [*(same_training(cfg) if phase == "proxy" else pins), *args.overrides]),
                failed, extra={"proxy": proxy.name})
            if done is None:
                break  # go on with the next method; a restart retries it
    stale = []
    text = report(results(stale), cfg.name) + stale_note(
        stale, lambda r: f"{r['method']} {r['phase']} m={r['multiple']:g} r{r['repeat']}")
    root = Path(cfg.run_root)
    root.mkdir(parents=True, exist_ok=True)
    return finish(root / f"{cfg.name}-public-proxy.md", text, failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
