"""Baselines as strong as ours (issue 37 items 1-2): every method gets K = 4 candidate settings,
and two tables compare them, each row repeated with fresh DP noise. Resumable.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/baselines.py --config configs/airline.yaml --plan
    OMP_NUM_THREADS=1 nohup .venv/bin/python experiments/baselines.py --config configs/airline.yaml \\
        > runs/confirmation/baselines.log 2>&1 &
    OMP_NUM_THREADS=1 .venv/bin/python experiments/baselines.py --config configs/reference.yaml
    .venv/bin/python experiments/baselines.py --config configs/airline.yaml --report-only

`--ours-from FILE` takes the ours row from experiments/confirmation.py's results where those runs
are this grid's (the SmolLM2 configs' own candidates are the k2 grid's α under the rule).

`--grid k2` runs the smaller grid docs/real_model.md fixed for SmolLM2 before any run (K = 2:
ours α ∈ {0.4, 1}; DP-SGD's learning rate ∈ {the config's, 4x}; DPKD α ∈ {0.4, 1}); the default,
`--grid k4`, is the one below.

The candidates (K = 4 each; "3x": three times the config's value):
- ours: α ∈ {0, 0.4, 0.7, 1}, all in ONE run (distill.candidates, distill.keep_candidates=true, so
  that every candidate's student is scored on the test split after the choice): the distillation
  settings the rule chooses among, the shipped pair's α plus α = 0 (the synthetic text alone) and
  a point between.
- DP-SGD: teacher.learning_rate ∈ {config's, 3x} × teacher.epochs ∈ {config's, 3x} at the same ε.
  The DP-SGD student trains with the `teacher` section's settings (flows/tasks.py dp_student_task,
  pipeline/plan.py dp_sgd_budgets), so its candidates override teacher.*; more steps at the same
  ε (more noise per step) is the setting a simply tuned DP-SGD won with on the news corpus.
- DPKD: distill.alpha ∈ {0.4, 1} × teacher.learning_rate ∈ {config's, 3x}: α because DPKD never had
  α = 1, the setting ours won with; the learning rate rather than epochs because DPKD's two DP-SGD
  trainings (its teacher, then its student with the teacher's forward in every step) both read
  the teacher section, so 3x epochs would triple both, past an hour a run on 2 cores, where the
  learning rate costs nothing. It applies to DPKD's teacher and student alike: the candidates
  tune DPKD's whole recipe. Candidates with the same learning rate share one teacher per repeat
  (the stage cache hands the second the first one's), counted once in the deployable total.

The rows and what each spends (T: ours' composed total at the config's settings, e.g. 1.987 on
airline; every row is composed to T by the ledger's accountant, pipeline/privacy/ledger.py compose):
- `ours`: one run at the config's ε, chosen by the zero-cost rule (distill.select_by default). It
  feeds the oracle table (its best candidate by test perplexity) and the deployable one (its choice).
- `ourspriv`: the same candidates chosen by select_by=private_validation at the selection ε (the
  config's distill.selection_epsilon, 0.2, or --selection-epsilon); the teacher's ε is lowered
  so that codes + teacher + selection compose to T.
- `dpsgd`, `dpkd`: each candidate one run at T (the oracle rows).
- `dpsgddep`, `dpkddep`: each candidate one run at the smaller ε at which the K runs and the
  private choice among them compose to T (bisection on that composed total); then the harness
  releases each candidate's noisy clipped validation loss (pipeline/privacy/private_selection.py,
  the release select_by=private_validation makes) and keeps the lowest.

Every run is the Prefect flow in its own run directory (`<name>-<row>-r<k>`, with `-c<i>` for the
i-th candidate of a DP-SGD or DPKD row). Repeat 1 takes what the stage cache holds; every later
repeat reruns the stage that draws DP noise and all after it (control-codes for ours, the
dp-student for DP-SGD, the teacher for a DPKD candidate that trains one, else its dp-student), as
experiments/confirmation.py does. Finished runs and choices are appended to
`<run_root>/baselines.jsonl` (or the file `--results` names); a restart skips them and
continues a killed run in its own directory. Each row's teacher.target_epsilon is found once
and kept in `<run_root>/baselines_budget.json`. The report (experiments/baselines_report.py)
ends with the lines `table=oracle ...`, `table=deployable ...` and `rule corpus=NAME candidates=K ...`.

Its data: configs/airline.yaml reads the airline tweets and configs/reference.yaml the Yelp split
in ../shared/data beside the checkout (not shipped; experiments/shared.py). Without them it exits
with one line (exit code 2) before any work; `--report-only` needs no data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.baselines_report import report  # noqa: E402
from experiments.shared import (  # noqa: E402  the data in ../shared
    add_results_option, append_result, finish, read_results, refresh_selections, require_data, selection_of)
from pipeline.methods import DISTIL, DP_SGD, DPKD, method_spec  # noqa: E402


@dataclass(frozen=True)
class Grid:
    """Each method's K candidate settings, as multiples of the config's teacher section."""

    ours_alphas: tuple[float, ...]
    dpsgd: tuple[tuple[float, int], ...]  # (learning-rate multiple, epochs multiple)
    dpkd: tuple[tuple[float, float], ...]  # (α, learning-rate multiple); one learning rate's next to each other

    @property
    def k(self) -> int:
        assert len(self.ours_alphas) == len(self.dpsgd) == len(self.dpkd), "every method gets K candidates"
        return len(self.ours_alphas)


GRIDS = {
    # the builtin models (docs/baselines.md): "3x" is three times the config's value
    "k4": Grid(ours_alphas=(0.0, 0.4, 0.7, 1.0), dpsgd=((1, 1), (1, 3), (3, 1), (3, 3)),
               dpkd=((0.4, 1), (1.0, 1), (0.4, 3), (1.0, 3))),
    # SmolLM2 (docs/real_model.md, fixed there before any run): ours α ∈ {0.4, 1}; DP-SGD's
    # learning rate ∈ {5e-4, 2e-3}, the configs' and 4x; DPKD α ∈ {0.4, 1}
    "k2": Grid(ours_alphas=(0.4, 1.0), dpsgd=((1, 1), (4, 1)), dpkd=((0.4, 1), (1.0, 1))),
}
DEFAULT_GRID = GRIDS["k4"]
OURS_ALPHAS = DEFAULT_GRID.ours_alphas
ROWS = ("ours", "dpsgd", "dpsgddep", "ourspriv", "dpkd", "dpkddep")
"""The order of one repeat's runs: the zero-cost row and the cheap DP-SGD first."""
METHOD = {"ours": DISTIL, "ourspriv": DISTIL, "dpsgd": DP_SGD, "dpsgddep": DP_SGD, "dpkd": DPKD, "dpkddep": DPKD}
SHARED = ("dpsgddep", "dpkddep")
"""The rows whose K candidate runs and private choice share the total ε."""
SPLITS = ("validation", "train+validation")
"""The private choices of each deployable row, each a procedure of its own at the same selection ε
(distill.selection_split): the validation split alone, as the study was planned; then the
training split too (2026-11-27, planned in docs/baselines.md before any of its choices ran), one
more choice of a SHARED row's candidate runs or of ourspriv's kept candidates, in place of the
first: a deployable row spends one of them, never both."""
RESULTS, BUDGET = "baselines.jsonl", "baselines_budget.json"


@dataclass(frozen=True)
class Candidate:
    name: str  # "" for ours, whose candidates live inside one run
    overrides: tuple[str, ...]

    @property
    def teacher(self) -> tuple[str, ...]:
        """Its teacher.* settings: DPKD candidates with the same ones share one teacher per repeat."""
        return tuple(o for o in self.overrides if o.startswith("teacher."))


def candidates(cfg, row: str, grid: Grid = DEFAULT_GRID) -> list[Candidate]:
    """The row's candidate settings (module docstring), from the config's teacher section."""
    t = cfg.teacher
    if METHOD[row] is DP_SGD:
        return [Candidate(f"lr={lr * t.learning_rate:g},epochs={e * t.epochs}",
                          (f"teacher.learning_rate={lr * t.learning_rate:g}", f"teacher.epochs={e * t.epochs}"))
                for lr, e in grid.dpsgd]
    if METHOD[row] is DPKD:  # one learning rate's candidates next to each other: they share its teacher
        return [Candidate(f"alpha={a},lr={lr * t.learning_rate:g}",
                          (f"distill.alpha={a}", f"teacher.learning_rate={lr * t.learning_rate:g}"))
                for a, lr in grid.dpkd]
    return [Candidate("", ())]


def row_overrides(row: str, selection_epsilon: float, grid: Grid = DEFAULT_GRID) -> list[str]:
    out = [f"distill.method={METHOD[row].name}"]
    if METHOD[row] is DISTIL:
        alphas = ", ".join(f"{{alpha: {a}}}" for a in grid.ours_alphas)
        out += ["distill.keep_candidates=true", f"distill.candidates=[{alphas}]"]
    if row == "ourspriv":  # its run's own choice: the validation split alone, as pre-registered (SPLITS)
        out += ["distill.select_by=private_validation", f"distill.selection_epsilon={selection_epsilon:g}",
                "distill.selection_split=validation"]
    return out


# --- the budget: each row's teacher.target_epsilon -----------------------------------------------

def bisect(total_of: Callable[[float], float], target: float, lo: float, hi: float,
           tol: float = 2e-3, steps: int = 30) -> float:
    """The largest x found in [lo, hi] with `total_of(x)` ≤ `target` (total_of increasing), stopping
    once the total is within `tol` below the target. σ is calibrated on a grid, so the total
    moves in small steps and may never land inside `tol`: the best x below is returned."""
    if total_of(lo) > target:
        raise ValueError(f"even x={lo} composes past the total {target}")
    if total_of(hi) <= target:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        total = total_of(mid)
        if total <= target:
            lo = mid
            if target - total < tol:
                break
        else:
            hi = mid
    return lo


def unique_releases(planned: list[tuple[Candidate, list]], teachers: dict[str, str] | None = None) -> list:
    """The DP releases of a row's candidate runs, each once: a teacher that DPKD candidates with the
    same teacher settings share is one release; every candidate's student is its own. `teachers`
    (candidate name -> the teacher its run used, e.g. the teacher stage's output directory): the
    finished runs' actual teachers, so that a candidate whose run trained a teacher of its own
    (the stage cache missed it: a lost cache, code that changed the teacher's key between two
    sessions) counts as another release instead of the planned shared one."""
    seen, out = set(), []
    for cand, entries in planned:
        for e in entries:
            if not (e.private and e.epsilon):
                continue
            shared = cand.teacher if teachers is None else teachers[cand.name]
            key = ("teacher", shared) if e.stage == "teacher" else (e.stage, cand.name)
            if key not in seen:
                seen.add(key)
                out.append(e)
    return out


def selection_release(epsilon: float, delta: float, k: int, accountant: str, n: int, unit: str):
    """The ledger entry of the private choice among `k` candidates (as select_by=private_validation's)."""
    from pipeline.privacy import private_selection

    z, used = private_selection.calibrate(epsilon, delta, k, accountant)
    return private_selection.ledger_entry(z=z, candidates=k, n=n, clip=10.0, target_epsilon=epsilon, delta=delta,
                                          accountant=used, unit=unit, secure=False)


class Budget:
    """T, ours' total at the config's settings, and each row's teacher.target_epsilon x at which the
    row composes to T: every candidate's own run (oracle rows, ourspriv), or all K candidate runs
    plus the private choice (SHARED rows). Each total is `dpdistill plan`'s (make_plan on the
    run's config: σ, q, steps, δ as the run will have them) composed by the ledger's accountant."""

    def __init__(self, config: str, overrides: list[str], selection_epsilon: float, grid: Grid = DEFAULT_GRID):
        from pipeline.config import load_config
        from pipeline.stages.data import planned_split

        self.config, self.overrides, self.selection_epsilon, self.grid = config, overrides, selection_epsilon, grid
        self.cfg = load_config(config, overrides)
        self.split = planned_split(self.cfg.data, Path(self.cfg.run_root), self.cfg.control_codes.domain)
        self.target = self.total("ours", self.cfg.teacher.target_epsilon)

    def run_config(self, row: str, cand: Candidate, x: float):
        from pipeline.config import load_config

        return load_config(self.config, [*self.overrides, *row_overrides(row, self.selection_epsilon, self.grid),
                                         *cand.overrides, f"teacher.target_epsilon={x:.6g}"])

    def total(self, row: str, x: float) -> float:
        from pipeline.plan import make_plan
        from pipeline.privacy.ledger import compose

        planned = [(c, make_plan(self.run_config(row, c, x), split=self.split))
                   for c in candidates(self.cfg, row, self.grid)]
        accountant, delta = self.cfg.teacher.accountant, planned[0][1].total.accountant_delta()
        if row in SHARED:
            entries = unique_releases([(c, p.entries) for c, p in planned])
            entries.append(selection_release(self.selection_epsilon, delta, len(planned), accountant,
                                             self.split.n_validation, self.split.unit))
            return compose(entries, accountant, delta).epsilon
        return max(compose(unique_releases([(c, p.entries)]), accountant, delta).epsilon for c, p in planned)

    def epsilons(self, rows: list[str], cache: Path) -> dict[str, float]:
        """Each row's x, found by bisection once and kept in `cache` under the study's settings."""
        text = Path(self.config).read_text()
        # the k4 grid's key is the one it had before there were grids: studies under way keep their budget
        grid = [self.grid.k] if self.grid == DEFAULT_GRID else [repr(self.grid)]
        key = hashlib.sha256(json.dumps([text, self.overrides, self.selection_epsilon, *grid,
                                         self.split.n, self.split.n_validation]).encode()).hexdigest()[:16]
        kept = json.loads(cache.read_text()) if cache.is_file() else {}
        found = kept.get(key, {})
        for row in rows:
            if row in found:
                continue
            if row == "ours":
                found[row] = self.cfg.teacher.target_epsilon
            else:
                print(f"budget: bisecting {row}'s teacher.target_epsilon to a total of {self.target:.4f}", flush=True)
                found[row] = bisect(lambda x: self.total(row, x), self.target, self.target / 8, 4 * self.target)
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(kept | {key: found}, indent=1))
        return found


# --- the schedule ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    row: str
    repeat: int
    index: int  # the candidate's place in its row, from 1
    candidate: Candidate
    overrides: tuple[str, ...]
    shares_teacher: bool  # DPKD: an earlier candidate of the repeat trained the teacher it uses

    @property
    def tag(self) -> str:
        return f"{self.row}-c{self.index}-r{self.repeat}" if self.candidate.name else f"{self.row}-r{self.repeat}"

    @property
    def noisy_stage(self) -> str | None:
        """The stage to rerun, and all after it, for fresh DP noise (None: repeat 1, take what the
        cache holds). A DPKD candidate reruns its teacher unless the repeat's earlier one just did."""
        if self.repeat == 1:
            return None
        if METHOD[self.row] is DISTIL:
            return "control-codes"
        return "teacher" if METHOD[self.row] is DPKD and not self.shares_teacher else "dp-student"


@dataclass(frozen=True)
class Choice:
    """The private choice among a SHARED row's candidate runs of one repeat, or (split
    train+validation) among ourspriv's kept candidates too."""

    row: str
    repeat: int
    split: str = "validation"


def schedule(cfg, rows: list[str], repeats: int, epsilons: dict[str, float],
             selection_epsilon: float, grid: Grid = DEFAULT_GRID) -> list[Run | Choice]:
    out: list[Run | Choice] = []
    for k in range(1, repeats + 1):
        for row in (r for r in ROWS if r in rows):
            cands = candidates(cfg, row, grid)
            for i, c in enumerate(cands):
                overrides = (*row_overrides(row, selection_epsilon, grid), *c.overrides,
                             f"teacher.target_epsilon={epsilons[row]:.6g}")
                shares = METHOD[row] is DPKD and c.teacher in [e.teacher for e in cands[:i]]
                out.append(Run(row, k, i + 1, c, overrides, shares))
            out += [Choice(row, k, split) for split in SPLITS
                    if row in SHARED or (row == "ourspriv" and split != "validation")]  # ourspriv's run made its first
    return out


def _done(results: list[dict], item: Run | Choice) -> bool:
    if isinstance(item, Choice):
        return any(r.get("kind") == "selection" and r["row"] == item.row and r["repeat"] == item.repeat
                   and r.get("split", "validation") == item.split for r in results)
    return any(r.get("kind", "run") == "run" and r["row"] == item.row and r["repeat"] == item.repeat
               and r.get("candidate") == (item.candidate.name or None) for r in results)


# --- running -----------------------------------------------------------------------------------------

def _stage_output(run_dir: Path, stage: str) -> Path:
    """Where a stage's outputs are: this run's directory, or the earlier run's whose cache it reused."""
    return Path(json.loads((run_dir / "stages.json").read_text())[stage]["output"])


def result_of(run: Run, run_dir: Path, seconds: float, target_epsilon: float) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    ledger = json.loads((run_dir / "ledger.json").read_text())
    student = next(m for name, m in metrics["perplexity"].items() if name.startswith("student_"))
    text = student.get("text_only") or {}
    out = {"kind": "run", "row": run.row, "candidate": run.candidate.name or None, "repeat": run.repeat,
           "run_dir": str(run_dir), "seconds": round(seconds, 1), "student": student["windowed"],
           "student_per_record_mean": student.get("per_record_mean"),
           "student_per_record_token_weighted": student.get("per_record_token_weighted"),
           "student_text_windowed": text.get("windowed"), "teacher_target_epsilon": target_epsilon,
           "epsilon": ledger["total"]["epsilon"], "delta": ledger["total"]["delta"]}
    if metrics.get("selection"):
        out["selection"] = selection_of(metrics)
    return out


def run_one(config: str, overrides: list[str], run: Run) -> dict:
    from flows.pipeline_flow import dp_distill
    from flows.run_info import stages_to_rerun
    from pipeline.config import load_config

    cfg = load_config(config, [*overrides, *run.overrides])
    cfg = cfg.model_copy(update={"name": f"{cfg.name}-{run.tag}"})
    t0 = time.monotonic()
    rerun = stages_to_rerun(run.noisy_stage, None) if run.noisy_stage else None
    run_dir = Path(dp_distill(cfg, rerun=rerun))
    return result_of(run, run_dir, time.monotonic() - t0, cfg.teacher.target_epsilon)


def private_choice(config: str, overrides: list[str], choice: Choice, runs: list[dict],
                   selection_epsilon: float, grid: Grid = DEFAULT_GRID) -> dict:
    """Release each candidate student's clipped mean loss on the private records of `choice.split`
    with Gaussian noise (the mechanism of select_by=private_validation, pipeline/privacy/
    private_selection.py, at `selection_epsilon` over the K scores) and keep the lowest. A SHARED
    row's total composes the K runs' releases (a shared DPKD teacher once) with this one; ourspriv's
    (its kept candidates, in one run) composes its run's releases with this one in place of the
    run's own choice. The splits are rebuilt from the config and the run root's split key, as
    experiments/private_selection.py does."""
    from pipeline.config import load_config
    from pipeline.devices import Runtime
    from pipeline.models.base import load_causal_lm, load_tokenizer
    from pipeline.privacy import private_selection
    from pipeline.privacy.ledger import compose, read_ledger
    from pipeline.records import split_key
    from pipeline.stages.data import prepare_data

    cfg = load_config(config, overrides)
    t0 = time.monotonic()
    if choice.row == "ourspriv":
        [run] = runs
        kept = _stage_output(Path(run["run_dir"]), "distillation") / "candidates"
        models = {c["candidate"]: kept / c["candidate"] / "model" for c in run["selection"]["candidates"]}
        ledger = read_ledger(Path(run["run_dir"]) / "ledger.json")
        entries = [e for e in ledger.entries if e.stage != private_selection.STAGE]
    else:
        models = {r["candidate"]: _stage_output(Path(r["run_dir"]), "dp-student") / "model" for r in runs}
        ledgers = {r["candidate"]: read_ledger(Path(r["run_dir"]) / "ledger.json") for r in runs}
        by_name = {c.name: c for c in candidates(cfg, choice.row, grid)}
        teachers = None  # DP-SGD's runs train no teacher (their stages.json has none)
        if METHOD[choice.row] is DPKD:
            teachers = {r["candidate"]: str(_stage_output(Path(r["run_dir"]), "teacher")) for r in runs}
        entries = unique_releases([(by_name[n], led.entries) for n, led in ledgers.items()], teachers)
        if teachers and len({teachers[n] for n in ledgers}) > len({by_name[n].teacher for n in ledgers}):
            print(f"== {choice.row} r{choice.repeat}: a candidate trained a teacher of its own where the plan "
                  "shared one (stage cache missed); each is counted, so the row's total exceeds the planned one",
                  flush=True)
        ledger = next(iter(ledgers.values()))
    delta = ledger.total.accountant_delta()
    runtime = Runtime.from_config(cfg)
    runtime.apply_threads()
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(cfg.data, Path(tmp), cfg.control_codes.domain,
                            split_key(Path(cfg.run_root).resolve(), create=False))
        spec = private_selection.PrivateValidation(path=Path(data.validation), delta=delta,
                                                   accountant=cfg.teacher.accountant,
                                                   secure_mode=cfg.teacher.secure_mode,
                                                   max_length=cfg.teacher.max_length,
                                                   train=Path(data.train) if choice.split != "validation" else None)
        tok = load_tokenizer(str(next(iter(models.values()))))
        scorer = private_selection.setup(spec, tok, candidates=len(models), epsilon=selection_epsilon,
                                         clip=cfg.distill.selection_clip, limit=cfg.distill.selection_records)
        students = {n: load_causal_lm(str(p), dtype=runtime.dtype).to(runtime.device).eval() for n, p in models.items()}
        scores = scorer.release(students, cfg.evaluate.batch_size, runtime.autocast)
    entries.append(scorer.entry)
    return {"kind": "selection", "row": choice.row, "repeat": choice.repeat, "split": choice.split,
            "chosen": min(scores, key=scores.get), "scores": scores, "selection_epsilon": scorer.entry.epsilon,
            "noise_sd": scorer.z * scorer.clip / scorer.n, "units": scorer.n,
            "epsilon": compose(entries, cfg.teacher.accountant, delta).epsilon,
            "seconds": round(time.monotonic() - t0, 1)}


# --- ours' row from the confirmation study ---------------------------------------------------------

def ours_from_confirmation(lines: list[dict], grid: Grid, source: str) -> list[dict]:
    """experiments/confirmation.py's `ours` runs as this study's `ours` row: the same runs where
    the confirmation ran the grid's candidates under the zero-cost rule and kept them (scored each
    on the test split). On the SmolLM2 configs, where the confirmation's candidates (RULE_CANDIDATES)
    are the k2 grid's α, its three runs are that row; running them again would spend three hours to repeat them. Raises
    ValueError naming the run whose candidates or rule differ."""
    out = []
    for r in (r for r in lines if r.get("row") == "ours"):
        sel = r.get("selection") or {}
        alphas = [c.get("alpha") for c in sel.get("candidates", [])]
        scored = all(c.get("test_perplexity") is not None for c in sel.get("candidates", []))
        if alphas != list(grid.ours_alphas) or sel.get("select_by") != "teacher_kl" or not scored:
            raise ValueError(f"ours run {r.get('repeat')} of {source} chose by {sel.get('select_by')} among α "
                             f"{alphas}{'' if scored else ' (not all scored on the test split)'}; this grid's "
                             f"ours row is α {list(grid.ours_alphas)} by teacher_kl, each scored: run it instead")
        keep = ("config", "repeat", "run_dir", "seconds", "student", "student_per_record_mean",
                "student_per_record_token_weighted", "student_text_windowed", "epsilon", "delta", "selection",
                "transcribed")
        out.append({"kind": "run", "row": "ours", "candidate": None, **{k: r[k] for k in keep if k in r},
                    "source": f"{source}: experiments/confirmation.py's ours run {r['repeat']}"})
    return out


def take_ours(path: Path, source: Path, config: str, grid: Grid) -> int:
    """Append to the study's results the confirmation's ours runs it does not hold yet; returns how many."""
    have = {r["repeat"] for r in read_results(path, config) if r.get("row") == "ours"}
    new = [r for r in ours_from_confirmation(read_results(source, config), grid, str(source)) if r["repeat"] not in have]
    for r in new:
        append_result(path, {"config": config, **r})
    return len(new)


# --- --plan --------------------------------------------------------------------------------------------

def _time_key(cfg) -> tuple:
    """What the plan's time of a run depends on (not its ε, learning rate, α or select_by: the plan
    leaves the private scoring out), so that runs alike are timed once, alike."""
    d = cfg.distill
    return d.method, cfg.teacher.epochs, len(d.candidates) if method_spec(d.method).distils else 0


def plan_text(budget: Budget, items: list[Run | Choice], epsilons: dict[str, float], corpus: str) -> str:
    """The run list and the wall time `dpdistill plan` estimates for each run (from scratch; a
    DPKD candidate that reuses its repeat's teacher without the teacher stage)."""
    from pipeline.plan import make_plan
    from pipeline.plan_time import estimate_seconds

    timed: dict[tuple, dict[str, float]] = {}
    runs = [i for i in items if isinstance(i, Run)]
    lines = [f"plan of experiments/baselines.py --config {budget.config} (corpus {corpus}): {len(runs)} runs, "
             f"{len(items) - len(runs)} private choices; every row composes to ε = {budget.target:.4f}",
             "row        teacher.target_epsilon  selection ε  candidates"]
    for row in dict.fromkeys(i.row for i in items):
        sel = budget.selection_epsilon if row in (*SHARED, "ourspriv") else 0.0
        names = [c.name for c in candidates(budget.cfg, row, budget.grid) if c.name] or budget.grid.ours_alphas
        lines.append(f"{row:<10} {epsilons[row]:<23.4f} {sel:<12g} {', '.join(map(str, names))}")
    lines.append("runs (seconds estimated by `dpdistill plan`'s stage timings on this machine):")
    total = 0.0
    for run in runs:
        cfg = budget.run_config(run.row, run.candidate, epsilons[run.row])
        key = _time_key(cfg)
        if key not in timed:
            print(f"plan: timing a {run.row} run", flush=True)
            seconds = estimate_seconds(cfg, make_plan(cfg, split=budget.split), budget.split)
            timed[key] = {s: t or 0.0 for s, (t, _) in seconds.items()}
        stages = timed[key]
        seconds = sum(s for name, s in stages.items() if not (run.shares_teacher and name == "teacher"))
        total += seconds
        flag = "  > 1 h" if seconds > 3600 else ""
        lines.append(f"  {run.tag:<18} ~{seconds / 60:5.0f} min{flag}  rerun from {run.noisy_stage or '(cache)'}: "
                     + " ".join(run.overrides))
    lines.append(f"estimated wall time: ~{total / 3600:.1f} h for {len(runs)} runs (each from scratch but for a "
                 "DPKD teacher reused within a repeat; cached stages take less; the kept candidates' test "
                 "perplexities and the private choices' scoring are not in it: seconds on the validation split, "
                 "minutes on training + validation records, 2.5-5 on builtin Yelp and 8-12 on SmolLM2's)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    p.add_argument("--config", default="configs/airline.yaml")
    p.add_argument("--corpus", default=None, help="the corpus name of the summary lines (default: the config's name)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"rows to run, e.g. ours,dpsgd (of {', '.join(ROWS)})")
    p.add_argument("--repeats", type=int, default=3, help="runs per row, each with fresh DP noise")
    p.add_argument("--selection-epsilon", type=float, default=None,
                   help="ε of each private choice (default: the config's distill.selection_epsilon)")
    p.add_argument("--plan", action="store_true", help="print the runs and their estimated wall time; train nothing")
    p.add_argument("--grid", choices=GRIDS, default="k4",
                   help="the candidate grid: k4 (the builtin models, docs/baselines.md) or k2 (SmolLM2, "
                   "docs/real_model.md)")
    add_results_option(p, RESULTS)
    p.add_argument("--ours-from", type=Path, default=None, metavar="FILE",
                   help="take the ours row's runs from experiments/confirmation.py's results FILE (its ours runs, "
                   "where they ran this grid's candidates under the rule: the SmolLM2 configs' k2) instead of "
                   "running them")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--choices-only", action="store_true",
                   help="make the private choices whose candidate runs are done, and train nothing (beside a "
                   "running study: its runs are left to it)")
    p.add_argument("--refresh", action="store_true",
                   help="first re-derive each finished run's selection figures from its metrics.json "
                   "(figures added to the report after the run was recorded)")
    args = p.parse_args(argv)
    grid = GRIDS[args.grid]
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)
    corpus = args.corpus or cfg.name
    root = Path(cfg.run_root)
    results_path = args.results or root / RESULTS
    if args.ours_from:
        try:
            print(f"took {take_ours(results_path, args.ours_from, cfg.name, grid)} ours run(s) from {args.ours_from}")
        except ValueError as e:
            p.error(str(e))
    if args.refresh:
        print(f"refreshed the selection figures of {refresh_selections(results_path)} recorded run(s)")
    if args.report_only:
        print(report(read_results(results_path, cfg.name), corpus, grid.k))
        return 0
    require_data(cfg, "experiments/baselines.py", args.config)
    rows = [r for r in args.rows.split(",") if r]
    if unknown := sorted(set(rows) - set(ROWS)):
        p.error(f"unknown rows {unknown}; rows are {', '.join(ROWS)}")
    selection_epsilon = args.selection_epsilon or cfg.distill.selection_epsilon
    budget = Budget(args.config, args.overrides, selection_epsilon, grid)
    epsilons = budget.epsilons(rows, root / BUDGET)
    items = schedule(cfg, rows, args.repeats, epsilons, selection_epsilon, grid)
    if args.plan:
        print(plan_text(budget, items, epsilons, corpus))
        return 0
    failed, t_start = [], time.monotonic()
    for item in items:
        results = read_results(results_path, cfg.name)
        if _done(results, item) or args.choices_only and isinstance(item, Run):
            continue
        try:
            if isinstance(item, Run):
                print(f"== {item.tag} {item.candidate.name}", flush=True)
                result = run_one(args.config, args.overrides, item)
            else:
                runs = [r for r in results if r.get("kind", "run") == "run" and r["row"] == item.row
                        and r["repeat"] == item.repeat]
                if len(runs) < (1 if item.row == "ourspriv" else grid.k):
                    if args.choices_only:  # the running study has yet to finish them
                        continue
                    failed.append(f"{item.row} r{item.repeat} {item.split} choice (candidates missing)")
                    continue
                if not all(r.get("run_dir") for r in runs):  # lines transcribed after a lost checkout: no models
                    failed.append(f"{item.row} r{item.repeat} {item.split} choice (its runs were transcribed "
                                  "without their directories; make them again to choose among them)")
                    continue
                print(f"== {item.row} r{item.repeat}: private choice among {grid.k} candidates on the {item.split} "
                      "records", flush=True)
                result = private_choice(args.config, args.overrides, item, runs, selection_epsilon, grid)
        except Exception as e:  # name it, go on with the others; a restart retries it
            print(f"== {item} failed: {e!r}", flush=True)
            failed.append(str(item))
            continue
        append_result(results_path, {"config": cfg.name, **result})
        print(f"== done: {json.dumps({k: result[k] for k in ('row', 'repeat', 'seconds')})}", flush=True)
    print(f"this invocation: {time.monotonic() - t_start:.0f} s wall")
    text = report(read_results(results_path, cfg.name), corpus, grid.k)
    return finish(root / f"{cfg.name}-baselines.md", text, failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
