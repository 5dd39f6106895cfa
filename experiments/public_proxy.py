"""The baseline a user would run (issue 60 item 3, docs/baselines.md "Settings chosen on a public
proxy"): each method at the whole ε, its learning rate chosen on a public proxy corpus, free of
any private record, beside the config's own setting. Resumable; every run appended to a tracked jsonl.

    OMP_NUM_THREADS=1 nohup .venv/bin/python experiments/public_proxy.py --config configs/reference.yaml \
        --proxy configs/airline.yaml --results docs/results/public_proxy.jsonl > runs/public_proxy.log 2>&1 &
    .venv/bin/python experiments/public_proxy.py --config configs/reference.yaml --proxy configs/airline.yaml \
        --results docs/results/public_proxy.jsonl --report-only

Two phases per method (ours, DP-SGD of the student, DPKD):
1. **Proxy.** One run of each candidate learning rate (`MULTIPLES` × the private config's value:
   `distill.learning_rate` for ours, `teacher.learning_rate` for the DP-SGD students, which train
   with the teacher section) on the proxy config, treated as public: its test split may be read.
   The candidate of lowest windowed test perplexity there is chosen; while it is the grid's
   largest or smallest, the grid grows by one more factor of 2 that way (at most `EXTEND` times),
   so that the chosen one is interior.
2. **Private.** The chosen learning rate and the config's own (multiple 1), three runs each on
   the private config at its whole ε (fresh DP noise each: the noisy stage is rerun), on its
   fixed test split (issue 60).

The report ends with `table=deployable-public corpus=NAME ours=M±S dpsgd=M±S dpkd=M±S` (windowed
test perplexity of the chosen settings) and `table=defaults corpus=NAME ...` (the config's).

Its data: the configs read the Yelp split and the tweets in ../shared/data beside the checkout
(not shipped; experiments/shared.py); without them it exits with one line (exit code 2) before
any work; `--report-only` needs no data.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.confirmation import _result  # noqa: E402
from experiments.shared import add_results_option, finish, read_results, require_data, run_recorded  # noqa: E402

MULTIPLES = (0.5, 1.0, 2.0, 4.0)  # the first grid, × the private config's learning rate
EXTEND = 3  # at most this many more factors of 2 past the grid's edge
# method: (its distill.method, the field its candidates set, the stage whose rerun draws fresh noise)
METHODS = {"ours": ("distil", "distill.learning_rate", "control-codes"),
           "dpsgd": ("dp_sgd", "teacher.learning_rate", "dp-student"),
           "dpkd": ("dpkd", "teacher.learning_rate", "dp-student")}


def _value(cfg, field: str) -> float:
    section, name = field.split(".")
    return getattr(getattr(cfg, section), name)


def run_one(config: str, method: str, multiple: float, base: float, phase: str, repeat: int, extra: list[str]) -> dict:
    from flows.pipeline_flow import dp_distill
    from flows.run_info import stages_to_rerun
    from pipeline.config import load_config

    name, field, noisy = METHODS[method]
    overrides = [f"distill.method={name}", f"{field}={base * multiple:.6g}", *extra]
    cfg = load_config(config, overrides)
    cfg = cfg.model_copy(update={"name": f"{cfg.name}-{phase}-{method}-m{multiple:g}-r{repeat}"})
    t0 = time.monotonic()
    run_dir = Path(dp_distill(cfg, rerun=stages_to_rerun(noisy, None) if repeat > 1 else None))
    return {"phase": phase, "method": method, "multiple": multiple, "learning_rate": base * multiple,
            **_result(method, repeat, run_dir, time.monotonic() - t0)}


def chosen(results: list[dict], method: str) -> float | None:
    """The proxy's choice: the multiple of lowest windowed test perplexity, once it is interior to
    the multiples run (or the grid can grow no more); None while the grid still has to grow."""
    runs = {r["multiple"]: r["student"] for r in results if r["phase"] == "proxy" and r["method"] == method}
    if not runs:
        return None
    best = min(runs, key=runs.get)
    if min(runs) < best < max(runs) or next_multiple(runs, best) is None:
        return best
    return None


def next_multiple(runs: dict[float, float], best: float) -> float | None:
    """The multiple to run next on the proxy: the first grid's, then one factor of 2 past the edge
    the best sits on; None when it may grow no more (EXTEND factors past the first grid)."""
    missing = [m for m in MULTIPLES if m not in runs]
    if missing:
        return missing[0]
    edge = max(runs) * 2 if best == max(runs) else min(runs) / 2
    allowed = max(MULTIPLES) * 2 ** EXTEND >= edge >= min(MULTIPLES) / 2 ** EXTEND
    return edge if allowed else None


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{statistics.mean(values):.1f}±{statistics.stdev(values) if len(values) > 1 else float('nan'):.1f}"


def report(results: list[dict], corpus: str) -> str:
    lines = ["| method | proxy: multiple → windowed test perplexity | chosen | private: chosen, windowed "
             "| text alone | private: the config's, windowed | text alone |", "|---|---|---:|---:|---:|---:|---:|"]
    summary = {"chosen": {}, "default": {}}
    for method in METHODS:
        proxy = sorted((r["multiple"], r["student"]) for r in results if r["phase"] == "proxy" and r["method"] == method)
        pick = chosen(results, method)
        private = {m: [r for r in results if r["phase"] == "private" and r["method"] == method and r["multiple"] == m]
                   for m in {pick, 1.0} if m is not None}
        cells = []
        for m, key in ((pick, "chosen"), (1.0, "default")):
            runs = private.get(m, [])
            summary[key][method] = _mean_sd([r["student"] for r in runs])
            cells += [summary[key][method], _mean_sd([r["student_text_windowed"] for r in runs])]
        lines.append(f"| {method} | {', '.join(f'{m:g} → {p:.1f}' for m, p in proxy) or '–'} "
                     f"| {'–' if pick is None else f'{pick:g}'} | " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n\n"
    for table, key in (("deployable-public", "chosen"), ("defaults", "default")):
        s = summary[key]
        out += f"table={table} corpus={corpus} ours={s['ours']} dpsgd={s['dpsgd']} dpkd={s['dpkd']}\n"
    return out


def _todo(results: list[dict], method: str, repeats: int) -> tuple[str, float, int] | None:
    """The next run of `method`: a proxy candidate, else a private repeat of the chosen or the default."""
    proxy = {r["multiple"]: r["student"] for r in results if r["phase"] == "proxy" and r["method"] == method}
    pick = chosen(results, method)
    if pick is None:
        return "proxy", next_multiple(proxy, min(proxy, key=proxy.get)) if proxy else MULTIPLES[0], 1
    for m in dict.fromkeys((pick, 1.0)):
        done = {r["repeat"] for r in results if r["phase"] == "private" and r["method"] == method
                and r["multiple"] == m}
        if missing := [k for k in range(1, repeats + 1) if k not in done]:
            return "private", m, missing[0]
    return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    p.add_argument("--config", required=True, help="the private corpus's config")
    p.add_argument("--proxy", required=True, help="the public proxy's config (the other corpus, treated as public)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=3)
    add_results_option(p, "public_proxy.jsonl")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    from pipeline.config import load_config

    cfg, proxy = load_config(args.config, args.overrides), load_config(args.proxy, args.overrides)
    if not args.report_only:
        require_data(cfg, "experiments/public_proxy.py", args.config)
        require_data(proxy, "experiments/public_proxy.py", args.proxy)
    results_path = args.results or Path(cfg.run_root) / "public_proxy.jsonl"
    failed = []
    for method in [] if args.report_only else args.methods.split(","):
        base = _value(cfg, METHODS[method][1])  # candidates are multiples of the private config's value
        while (todo := _todo(read_results(results_path, cfg.name), method, args.repeats)) is not None:
            phase, multiple, repeat = todo
            done = run_recorded(
                results_path, cfg.name, f"{method} {phase} m={multiple:g} r{repeat}",
                lambda: run_one(args.proxy if phase == "proxy" else args.config, method, multiple, base, phase, repeat,
                                list(args.overrides)), failed, extra={"proxy": proxy.name})
            if done is None:
                break  # go on with the next method; a restart retries it
    text = report(read_results(results_path, cfg.name), cfg.name)
    root = Path(cfg.run_root)
    root.mkdir(parents=True, exist_ok=True)
    return finish(root / f"{cfg.name}-public-proxy.md", text, failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
