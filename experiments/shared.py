"""The data the studies read from outside the checkout: `../shared/data` beside it (or
`$DPDISTILL_SHARED/data`), which is not shipped. configs/reference.yaml reads the Yelp split
there, configs/airline.yaml the airline tweets (each config's header says what they are and
their license). A study whose config reads a file that is not there exits with one line
(exit code 2) before any work, naming the field, the path and, when the path lies in
../shared, that the data is not shipped."""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULE_CANDIDATES = "distill.candidates=[{alpha: 0.4}, {alpha: 1.0}]"
"""ours' candidates under the zero-cost rule, as the studies in docs/ were planned and run: the
product's default until the rule stopped being the default (docs/baselines.md, "The rule")."""


def shared_root() -> Path:
    """The folder holding `data/`: $DPDISTILL_SHARED, else ../shared beside the checkout."""
    return Path(os.environ.get("DPDISTILL_SHARED") or ROOT.parent / "shared").resolve()


def where_run(cfg) -> dict:
    """Where a study run computed, when not on a CPU in fp32 (every line before bench/device_study.sh):
    the device, its GPU and the precision, for a results line; {} on a CPU in fp32. The method
    and its ε are the same anywhere; the rounding and the seconds are not."""
    import torch

    from pipeline.devices import resolve_device

    device = resolve_device(cfg.device, cfg.precision)
    if device.type == "cpu" and cfg.precision == "fp32":
        return {}
    gpu = {"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
    return {"device": device.type, **gpu, "precision": cfg.precision}


def require_data(cfg, script: str, config: str | None = None) -> None:
    """Exit 2 with one line when a file `cfg` reads (data.path, data.test_path) is not there."""
    fields = {"data.path": cfg.data.path, "data.test_path": cfg.data.test_path}
    missing = [(field, Path(path)) for field, path in fields.items() if path and not Path(path).exists()]
    if not missing:
        return
    field, path = missing[0]
    where = f" ({config})" if config else ""
    shared = [roots for roots in (shared_root(), (ROOT.parent / "shared").resolve())
              if path.resolve().is_relative_to(roots)]
    why = ("this study reads ../shared/data beside the checkout (or $DPDISTILL_SHARED/data), which is not "
           "shipped; put it there, or pass a config of your own data" if shared else "pass a config whose data exists")
    print(f"{script}: {field} {path}{where} is not there: {why}", file=sys.stderr)
    sys.exit(2)


def read_results(path: Path, config: str | None = None) -> list[dict]:
    """A study's jsonl, only the lines of the config named `config` (None: every line). Two configs
    may share a run_root (configs/smollm2_airline.yaml and smollm2_yelp.yaml do): each line names its
    config; an older line without the name is its run directory's, `<config name>-<row>-...`."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if config is None:
        return rows
    return [r for r in rows if r.get("config", _config_of(r)) == config]


def _config_of(row: dict) -> str | None:
    """The config name in a run directory `<config>-<row>[-c<i>]-r<k>-<date>-<time>`; None for none."""
    m = re.fullmatch(r"(.+)-[a-z]+(?:-c\d+)?-r\d+-\d{8}-\d{6}", Path(row.get("run_dir", "")).name)
    return m and m.group(1)


def refresh_selections(path: Path) -> int:
    """Re-derive the selection figures of every line with a run directory from its metrics.json
    (`selection_of`: figures added after a line was written); returns how many lines changed.
    Under the file's lock, which `append_result` takes too: a study running beside this keeps
    the line it appends."""
    from pipeline.locks import file_lock

    with file_lock(lock_of(path)):
        rows = read_results(path)
        changed = 0
        for r in rows:
            metrics = Path(r.get("run_dir", "")) / "metrics.json"
            if r.get("selection") and metrics.is_file():
                new = {**r["selection"], **selection_of(json.loads(metrics.read_text()))}
                changed += new != r["selection"]
                r["selection"] = new
        if changed:
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.replace(tmp, path)
    return changed


def add_results_option(p, default_name: str) -> None:
    """`--results FILE`: where a study's finished runs go and are read from (default
    `<run_root>/<default_name>`). A run root is not tracked: a tracked file, committed as runs
    finish, keeps them when a new checkout lacks the run root."""
    p.add_argument("--results", type=Path, default=None,
                   help=f"the study's jsonl of finished runs (default: <run_root>/{default_name}); name a tracked "
                   "file, e.g. docs/results/NAME.jsonl, and commit it as runs finish: a run root is not "
                   "tracked, and a new checkout without it would run every finished run again")


def append_result(path: Path, result: dict) -> None:
    """One finished run (or choice) as a line of the study's jsonl: a restart skips it."""
    from pipeline.locks import file_lock

    with file_lock(lock_of(path)), path.open("a") as f:
        f.write(json.dumps(result) + "\n")


def run_recorded(path: Path, config: str, what: str, run, failed: list[str], extra: dict | None = None) -> dict | None:
    """`run()` one study run named `what`, its result appended to the study's jsonl `path` (with
    its `config` name and `extra`); a run that raises is named, added to `failed` and skipped (a
    restart retries it), so that the study goes on with the others."""
    print(f"== {what}", flush=True)
    try:
        result = run()
    except Exception as e:  # name it, go on with the others
        print(f"== {what} failed: {e!r}", flush=True)
        failed.append(what)
        return None
    append_result(path, {"config": config, **(extra or {}), **result})
    print(f"== {what}: {result['student']:.1f} ({result['seconds']:.0f} s)", flush=True)
    return result


def lock_of(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def finish(report_path: Path, text: str, failed: list[str]) -> int:
    """Write and print the study's report, name what failed (a restart retries it); the exit status."""
    report_path.write_text(text)
    print(text)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


def selection_of(metrics: dict) -> dict:
    """An `ours` run's selection: each candidate's criteria and test perplexities, windowed, on
    the text alone and per record token-weighted (from the evaluation's per-model figures, for a
    run evaluated before the selection table carried the text-alone one)."""
    sel = metrics["selection"]
    ppl = metrics["perplexity"]
    student = next((m for name, m in ppl.items() if name.startswith("student_")), {})

    def figures(name: str) -> dict:
        return ppl.get(f"candidate {name}") or (student if name == sel["chosen"] else {})

    return {"select_by": sel["select_by"], "chosen": sel["chosen"],
            "private_validation": sel.get("private_validation"), "candidates": [
                {**{k: c.get(k) for k in ("candidate", "alpha", "teacher_kl", "untruncated_ce",
                                          "synthetic_validation_ce", "private_validation", "test_perplexity")},
                 "test_text_perplexity": c.get("test_text_perplexity",
                                               (figures(c["candidate"]).get("text_only") or {}).get("windowed")),
                 "test_per_record_token_weighted": figures(c["candidate"]).get("per_record_token_weighted")}
                for c in sel["candidates"]]}


# Settings a corpus's studies keep where its config has shipped another since, so that a study's
# multiples and rows stay what they ran with (SmolLM2 Yelp ships ours' proxy choice, 6e-4, since
# experiments/public_proxy.py chose it; its studies ran with 3e-4).
PINNED = {"smollm2-yelp": ("distill.learning_rate=0.0003",)}


# Where and how a run is watched, not what it computes: left out of its config's digest.
OPERATIONAL = ("name", "run_root", "progress_seconds", "threads")


def config_digest(cfg) -> str:
    """What a run computes, as a digest of its resolved config less `OPERATIONAL` (its paths are the
    config's, relative: the same in every checkout). A study's line records it, so that a row counts
    only the runs of the config it names today (issue 60): one whose config has changed since it ran
    is kept out and runs again."""
    data = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in OPERATIONAL}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def config_path(name: str) -> Path:
    """The shipped config of the name `name`: configs/<name, - as _>.yaml."""
    return ROOT / "configs" / f"{name.replace('-', '_')}.yaml"


def split_stale(results: list[dict], digest_of) -> tuple[list[dict], list[dict]]:
    """`results` as (current, stale): a line is stale when it records a config digest that is not
    `digest_of(line)`, the digest its row's config resolves to now. A line recorded before digests
    were (2026-12-02) cannot be checked and counts; the docs name those known to have run another
    config."""
    current, stale = [], []
    for r in results:
        (stale if "config_digest" in r and r["config_digest"] != digest_of(r) else current).append(r)
    return current, stale


def stale_note(stale: list[dict], name) -> str:
    """One line naming the runs kept out because their config has changed since they ran."""
    if not stale:
        return ""
    return (f"kept out, their config changed since they ran (they run again): {len(stale)} run(s): "
            + ", ".join(name(r) for r in stale) + "\n")


def mean_sd(values: list[float | None], digits: int = 1) -> str:
    """`M±S` over the values that are not None (sample sd; `M±–` for one value, whose sd is
    undefined), `–` for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    sd = f"{statistics.stdev(values):.{digits}f}" if len(values) > 1 else "–"
    return f"{statistics.mean(values):.{digits}f}±{sd}"


def _teachers(runs: list[dict]) -> list[float]:
    return [round(r["dp_teacher"], 6) for r in runs if r.get("dp_teacher") is not None]


def share_a_teacher(runs: list[dict]) -> bool:
    """Whether runs meant as independent draws share a DP teacher (equal `dp_teacher` figures):
    before 2026-11-30 a DPKD repeat reran its student alone."""
    teachers = _teachers(runs)
    return len(teachers) != len(set(teachers))


def shared_teacher_note(label: str, runs: list[dict]) -> str:
    """A line saying that the runs share a DP teacher, so their spread leaves the teacher's noise
    out; empty when every run that records its teacher read its own."""
    if not share_a_teacher(runs):
        return ""
    teachers = _teachers(runs)
    return (f"{label}: {len(teachers)} runs read {len(set(teachers))} DP teacher(s) "
            f"({', '.join(f'{t:.1f}' for t in sorted(set(teachers)))}): they differ by the student's DP "
            "noise alone, so the spread leaves the teacher's out (a DPKD repeat reran its student alone "
            "before 2026-11-30).\n")
