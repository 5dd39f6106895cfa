"""The privacy ledger: one entry per stage, and the run's total composed by an accountant.

ε values come from accountants, never from our arithmetic: Opacus' for `epsilon` (add/remove
adjacency), dp-accounting's PLD accountant for `epsilon_replace_one` (the guarantee when N is
known, as it is: it is published) and `epsilon_pld` (add/remove, a check of Opacus'). Gaussian mechanisms
(DP-SGD steps, a Gaussian histogram) are composed by giving the accountant their joint
history; a pure ε-DP mechanism (the geometric histogram) is added by basic composition,
which is valid and conservative, and the total says so. Stages after the teacher are
post-processing (ε = 0). A release that is not DP (exact control-code counts) makes the
total incomplete, and the ledger says so; so does a mechanism whose noise came from the
test-only fixed-seed hook (its `noise_source`, see pipeline/privacy/noise.py).

    dpdistill ledger show RUN_DIR     # the ledger as a table
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from pipeline.manifest import atomic_write_json

LEDGER = "ledger.json"
ADJACENCY_NOTE = (
    "guarantee: 'DP release' (computed from private records through an accounted mechanism), "
    "'post-processing' (reads DP outputs only, ε 0) or 'NOT DP'. "
    "epsilon: add/remove-one (neighbouring datasets differ by one unit present or absent); "
    "epsilon_replace_one: one unit replaced by another, N unchanged. N is published, so replace-one is "
    "the guarantee against an attacker who knows it (dp-accounting PLD; docs/privacy.md). "
    "epsilon_rdp, epsilon_pld: add/remove checks of epsilon by Opacus' RDP and dp-accounting's PLD accountants."
)
# Stage names that changed, read under their current name. The DP-SGD student's entry was
# 'student' while its flow stage (`--from`, `--force`, stages.json, status) and its release in
# the dataset's budget were 'dp-student' (issue 37): one name now, and ledgers and budgets
# written before still read.
RENAMED_STAGES = {"student": "dp-student", "student-validation": "dp-student-validation"}


def current_stage_name(stage: str) -> str:
    """A stage's name as ledgers write it now (RENAMED_STAGES)."""
    return RENAMED_STAGES.get(stage, stage)


TEST_HOOK = "TEST HOOK"
"""How a `noise_source` made through the test-only fixed-noise hook starts (pipeline/privacy/noise.py)."""


class LedgerEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: str
    private: bool
    """True when this stage's release is covered by a DP guarantee (or spends nothing)."""
    epsilon: float | None
    """ε spent by this stage; None where the release is not differentially private."""
    delta: float | None = None
    accountant: str | None = None
    mechanism: str | None = None
    """'subsampled_gaussian', 'gaussian' or 'geometric' for DP mechanisms."""
    noise_multiplier: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    max_grad_norm: float | None = None
    privacy_unit: str | None = None
    """'record' or 'user': what one protected unit is."""
    epsilon_rdp: float | None = None
    """The RDP accountant's ε for the same history: a cross-check of the default PRV figure."""
    epsilon_replace_one: float | None = None
    """ε when neighbouring datasets have the same size and differ in one unit replaced by
    another (dp-accounting's PLD accountant, pipeline/privacy/pld.py). `epsilon` is add/remove-one;
    N is published, so this is the guarantee against an attacker who knows it (docs/privacy.md)."""
    epsilon_pld: float | None = None
    """dp-accounting's PLD ε for the same history at add/remove: a check of `epsilon` by a second library."""
    history: list[tuple[float, float, int]] = []
    """(σ, q, steps) of each Gaussian mechanism, what the accountant composes."""
    replace_one_sensitivity: float | None = None
    """A Gaussian release's L2 sensitivity under replace-one, in units of its add/remove one
    (the unit σ is relative to), set by the mechanism from what it releases: 2 for DP-SGD (a
    clipped gradient g replaced by -g), √2 for the histogram (a count moves between two bins),
    1 for a clipped mean over a fixed number of units (monitor.py, private_selection.py). None
    in ledgers written before it: read as the figure they were made with (pld.py)."""
    delta_threshold: float | None = None
    """A release whose very keys are private (the DP tokenizer's words, pipeline/privacy/dp_vocabulary.py):
    the probability that a key of one unit passes its threshold. Added to δ: the release is
    (ε, δ + delta_threshold)-DP, and so is any composition it joins (the total's δ includes it)."""
    noise_source: str | None = None
    """Where the mechanism's randomness came from (pipeline/privacy/noise.py): OS entropy, a CSPRNG,
    or the test hook's fixed seed, which anyone could regenerate: then the entry is not private."""
    validation_monitor: str | None = None
    """A DP-SGD stage's teacher.monitor: what its published validation loss is computed from,
    'none' (nothing published), 'dp' (its own '<stage>-validation' entry) or 'public' (records
    the user declared public). None in ledgers written before the setting existed."""
    untied_parameters: int | None = None
    """DP-SGD stages: parameters added by giving lm_head its own weight (0: the model's was
    already untied); a tied weight would get one clipping norm per use."""
    note: str

    @field_validator("stage")
    @classmethod
    def _current_name(cls, stage: str) -> str:
        return current_stage_name(stage)


class LedgerTotal(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epsilon: float
    delta: float
    accountant: str
    composition: str
    complete: bool
    """False when some release of the run is not DP: then ε covers the DP stages only."""
    epsilon_replace_one: float | None = None
    """The same releases composed under replace-one adjacency (see LedgerEntry.epsilon_replace_one)."""
    epsilon_pld: float | None = None
    """dp-accounting's PLD ε of the same releases at add/remove: a check of `epsilon`."""
    delta_threshold: float | None = None
    """The part of `delta` that thresholded releases add (LedgerEntry.delta_threshold); the
    accountants' ε figures are at `delta` minus it. None: nothing added."""
    note: str

    def accountant_delta(self) -> float:
        """The δ the accountants composed at: what a second composition of the same releases
        (the dataset's budget, privacy.max_epsilon) starts from."""
        return self.delta - (self.delta_threshold or 0.0)


class PrivacyLedger(BaseModel):
    model_config = ConfigDict(extra="forbid")

    entries: list[LedgerEntry]
    total: LedgerTotal | None = None

    def entry(self, stage: str) -> LedgerEntry:
        return next(e for e in self.entries if current_stage_name(e.stage) == current_stage_name(stage))


def post_processing(stage: str, note: str) -> LedgerEntry:
    """A stage that only reads DP outputs: no privacy cost (post-processing theorem)."""
    return LedgerEntry(stage=stage, private=True, epsilon=0.0, epsilon_replace_one=0.0, epsilon_pld=0.0,
                       note=f"post-processing: {note}")


def _pld_epsilons(dp: list[LedgerEntry], delta: float) -> dict[str, float]:
    """dp-accounting's ε of these DP releases: replace-one, and add/remove as a check."""
    from pipeline.privacy import pld  # dp-accounting: only when there is something to account

    gaussians = [(e.mechanism, e.history, e.replace_one_sensitivity) for e in dp if e.history]
    pure = [e.epsilon for e in dp if e.mechanism == "geometric"]
    return {"epsilon_replace_one": pld.epsilon(gaussians, delta, pld.REPLACE_ONE, pure),
            "epsilon_pld": pld.epsilon(gaussians, delta, pld.ADD_REMOVE, pure)}


def with_pld_epsilons(entry: LedgerEntry) -> LedgerEntry:
    """`entry` with its replace-one ε and PLD check filled in, computed once, when the entry is
    made, so that reading a ledger never needs an accountant. Not DP: left as it is."""
    if not entry.private:
        return entry
    if not entry.epsilon:
        return entry.model_copy(update={"epsilon_replace_one": 0.0, "epsilon_pld": 0.0})
    return entry.model_copy(update=_pld_epsilons([entry], entry.delta))


def composing_accountant(accountant: str, history: list[tuple[float, float, int]]) -> str:
    """The accountant a joint history is composed with: rdp in place of gdp when the history mixes
    (σ, q), since Opacus' GDP accountant reads only its last entry."""
    return "rdp" if accountant == "gdp" and len({(s, q) for s, q, _ in history}) > 1 else accountant


def compose(entries: list[LedgerEntry], accountant: str, delta: float) -> LedgerTotal:
    """The run's total: Gaussian histories through the accountant at `delta`, pure-ε ones
    added; its δ is `delta` plus each thresholded release's `delta_threshold`."""
    dp = [e for e in entries if e.private and e.epsilon]
    units = {e.privacy_unit for e in dp}
    if len(units) > 1:
        raise ValueError(f"cannot compose mechanisms with different privacy units: {sorted(units)}")
    history = [h for e in dp for h in e.history]
    pure = [e for e in dp if e.mechanism == "geometric"]
    used = composing_accountant(accountant, history)
    parts = []
    eps = 0.0
    if history:
        from pipeline.privacy.accountant import epsilon_of  # Opacus and torch: only when there is something to compose

        eps = epsilon_of(used, history, delta)
        gaussians = [e.stage for e in dp if e.history]
        parts.append(f"{used} accountant over the joint history of {', '.join(gaussians)}")
    if pure:
        eps += sum(e.epsilon for e in pure)
        parts.append(f"plus basic composition (ε added) of the pure-ε {', '.join(e.stage for e in pure)}")
    thresholds = [e for e in dp if e.delta_threshold]
    if thresholds:
        parts.append(f"δ plus the threshold δ of {', '.join(e.stage for e in thresholds)}")
    not_dp = [e.stage for e in entries if not e.private]
    fixed_noise = [e.stage for e in entries if (e.noise_source or "").startswith(TEST_HOOK)]
    note = (f"(ε, δ)-DP per {next(iter(units), 'record')} for everything this run releases from its training "
            f"split{_validation_scope(entries)}")
    if not_dp:
        note = f"covers the DP stages only; NOT differentially private: {', '.join(not_dp)}"
    if fixed_noise:
        note = (f"NOT private: the noise of {', '.join(fixed_noise)} came from the test hook's fixed "
                f"seed, which anyone can regenerate (ε assumes secret noise); {note}")
    if used != accountant:
        note += f"; composed with rdp because {accountant} cannot compose different mechanisms"
    return LedgerTotal(
        epsilon=eps,
        **(_pld_epsilons(dp, delta) if dp else {"epsilon_replace_one": 0.0, "epsilon_pld": 0.0}),
        delta=delta + sum(e.delta_threshold for e in thresholds),
        delta_threshold=sum(e.delta_threshold for e in thresholds) or None,
        accountant=used,
        composition="; ".join(parts) or "no DP mechanism",
        complete=not not_dp and not fixed_noise,
        note=note,
    )


def run_delta(entries: list[LedgerEntry]) -> float:
    """The δ a run's releases compose at: its DP-SGD stages' (one rule and N: `resolve_delta`);
    before any (the control codes alone, a DP vocabulary) the first Gaussian release's; 0 with none."""
    return next((e.delta for e in entries if e.mechanism == "subsampled_gaussian"),
                next((e.delta for e in entries if e.history), 0.0))


def composed(entries: list[LedgerEntry], accountant: str) -> PrivacyLedger:
    """The ledger of these entries, totalled at the run's δ (`run_delta`). An entry cached by a
    version before replace-one ε gets its figures here, once."""
    entries = [e if e.epsilon_replace_one is not None else with_pld_epsilons(e) for e in entries]
    return PrivacyLedger(entries=entries, total=compose(entries, accountant, run_delta(entries)))


class RunLedger:
    """A run's ledger as its stages hand back their entries: composed and written to `path`
    after each stage, so that an interrupted run shows what it spent."""

    def __init__(self, path: Path, accountant: str):
        self.path, self.accountant = Path(path), accountant
        self.entries: list[LedgerEntry] = []

    def add(self, entries: list[LedgerEntry]) -> PrivacyLedger:
        self.entries += entries
        ledger = composed(self.entries, self.accountant)
        write_ledger(self.path, ledger)
        return ledger


def _validation_scope(entries: list[LedgerEntry]) -> str:
    """What the total says about the held-out splits, from what each DP-SGD stage published
    from its validation split (`validation_monitor`) and whether evaluation read the test split."""
    trained = [e for e in entries if e.mechanism == "subsampled_gaussian"]
    modes = {e.validation_monitor for e in trained}
    released = [e.stage for e in entries if e.stage.endswith("-validation") and e.mechanism == "gaussian"]
    parts = []
    if released:
        parts.append(f" and the validation loss it publishes ({', '.join(released)})")
    if modes == {"none"}:
        parts.append("; nothing computed from the validation split is published")
    if "public" in modes:
        parts.append("; the validation loss of a stage with teacher.monitor=public is computed on records the "
                     "user declared public, not on the private validation split")
    if None in modes:
        old = [e.stage for e in trained if e.validation_monitor is None]
        parts.append(f"; the validation loss that {', '.join(old)} published (made before teacher.monitor "
                     "existed) is computed on private validation records and NOT covered")
    if any(e.stage == "evaluation" for e in entries):
        parts.append("; the test split's figures (evaluation) are not covered")
    return "".join(parts)


def write_ledger(path: Path, ledger: PrivacyLedger) -> None:
    stages = [e.stage for e in ledger.entries]
    if len(set(stages)) != len(stages):
        raise ValueError(f"ledger has duplicate stages: {stages}")
    atomic_write_json(Path(path), ledger.model_dump(mode="json"))


def read_ledger(path: Path) -> PrivacyLedger:
    return PrivacyLedger.model_validate(json.loads(Path(path).read_text()))


def guarantee(entry: "LedgerEntry") -> str:
    """The `private` flag in words, as tables show it: "DP release" (the stage released
    something computed from private records through an accounted mechanism), "post-processing"
    (it read only DP outputs: ε 0) or "NOT DP". A bare "private: yes" on generation read as
    "reads private data" (issue 24)."""
    if not entry.private:
        return "NOT DP"
    return "DP release" if entry.epsilon else "post-processing"


def total_guarantee(total: "LedgerTotal") -> str:
    """The total's `complete` flag in words: every release of the run is DP, or not."""
    return "all DP" if total.complete else "INCOMPLETE"


def table_rows(ledger: "PrivacyLedger") -> list[dict]:
    """One dict per entry, then the total's (stage "TOTAL"), with the `guarantee` words: what
    `ledger show`, the report and the Prefect artifact each pick their columns from."""
    rows = [e.model_dump() | {"guarantee": guarantee(e)} for e in ledger.entries]
    if ledger.total:
        rows.append(ledger.total.model_dump() | {"stage": "TOTAL", "guarantee": total_guarantee(ledger.total)})
    return rows


def fmt_value(x) -> str:
    """A ledger value as shown in tables: 4 significant digits, yes/NO, '-' for none."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def format_table(ledger: PrivacyLedger) -> str:
    """The ledger as a fixed-width text table plus its total and notes."""
    cols = ["stage", "guarantee", "epsilon", "epsilon_replace_one", "delta", "accountant", "noise_multiplier",
            "sample_rate", "steps", "max_grad_norm", "privacy_unit", "epsilon_rdp", "epsilon_pld"]
    rows = [[fmt_value(row.get(c)) for c in cols] for row in table_rows(ledger)]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths))  # noqa: E731
    out = [line(cols), line(["-" * w for w in widths]), *map(line, rows), ""]
    out += [f"{e.stage}: {e.note}" + (f" [noise: {e.noise_source}]" if e.noise_source else "")
            for e in ledger.entries]
    if ledger.total:
        out += [f"TOTAL: {ledger.total.composition}. {ledger.total.note}"]
    out += [ADJACENCY_NOTE]
    return "\n".join(out)
