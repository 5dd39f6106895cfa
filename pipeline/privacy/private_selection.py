"""Choosing the distilled student on private records, as an accounted DP release
(distill.select_by=private_validation; issue 20's second route).

The default criterion (pipeline/stages/selection.py) reads DP outputs only and costs nothing.
This one asks the records themselves: each candidate student's loss on the private validation
split and, by default (distill.selection_split=train+validation), on the training split too,
which is what the test perplexity measures on other records of the same distribution. Those
scores leave the stage only as one Gaussian release:

    score(candidate) = mean over n units of clip(unit's mean per-token loss, 0, C) + N(0, (z·C/n)²)

and the student with the lowest noisy score is kept (post-processing of the release).

Sensitivity. Replacing one scored unit (a record, or at user level all of one user's records)
moves each candidate's clipped mean by at most C/n, so the k scores together are k
Gaussian releases of sensitivity C/n at noise sd z·C/n: the ledger entry's history is
[(z, 1, k)], calibrated by the accountant for (selection_epsilon, δ) and composed with the
run's other releases by it (ledger.compose) and across runs (budget.py). n (the number of
units scored) follows from the split sizes the data stage publishes, as N does: treated as
public, like N in δ = 1/(10N). The same C/n bounds a replacement, so the entry's replace-one
sensitivity is 1 (monitor.gaussian_entry, pld.py). The release is composed sequentially with
every other release of the run, the teacher's DP-SGD on the same training records included.

Why the training records may score. The noise sd is z·C/n: at the studies' 100-250 validation
units and ε 0.2 it was 0.75-2.1 nats, against candidates 0.1-0.5 nats apart, and the choice was
close to a coin toss (docs/baselines.md). The splits together hold about 20x the units. A
candidate's loss on records it trained on can read low, so a candidate that fits them more
closely could look better than it is; here the candidates are students that never trained on a
private record, and the DP teacher they share reads each record only as DP-SGD allows. On the
builtin Yelp study's DP-SGD and DPKD candidates, which did train on them, the exact training
and validation scores put the same candidate first in each of the 5 repeats scored
(experiments/selection_split.py, docs/privacy.md).

The noise comes from a secret generator (pipeline/privacy/noise.py), never from the config's
seed or torch's global generator. Only the noisy scores are published; the exact ones are
never written. Besides the data and teacher stages, the validation split is read by
teacher.monitor=dp, under its own accounted release, and by this route, which with
selection_split=train+validation is also the only reader of the training split after the
teacher.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.models.scoring import nll_by_owner
from pipeline.privacy import monitor, noise
from pipeline.privacy.ledger import LedgerEntry
from pipeline.records import read_users
from pipeline.prompts import HEADER, PromptFormat
from pipeline.tokenized import TokenIds, token_column, tokenized_split

STAGE = "distillation-selection"
"""The ledger stage of the release."""


@dataclass(frozen=True)
class PrivateValidation:
    """What select_by=private_validation needs from the run: the data stage's private
    validation split, its training split where that scores too (selection_split=
    train+validation), and the DP settings of its other releases."""

    path: Path
    delta: float
    accountant: str
    secure_mode: bool = False
    max_length: int = 512
    train: Path | None = None
    prompt: PromptFormat = HEADER
    """How the records' codes are written before their text, as the students trained (pipeline/prompts.py)."""


@dataclass
class Scorer:
    """The scored units of the validation split and the calibrated mechanism."""

    records: TokenIds
    owners: list[int]  # each record's unit index
    n: int  # units
    clip: float
    z: float
    entry: LedgerEntry
    secure: bool
    splits: str = "validation"  # or "validation and training": the splits whose units are scored

    def release(self, students: dict[str, torch.nn.Module], batch_size: int, autocast) -> dict[str, float]:
        """Every student's noisy score, from one secret generator. The exact means stay here."""
        generator = noise.generator("selection", secure=self.secure)
        out = {}
        for name, student in students.items():
            with autocast():
                nll, count = nll_by_owner(student, self.records, self.owners, self.n, batch_size)
            per_unit = torch.from_numpy(nll / count.clip(min=1))  # (n,) each unit's mean per-token loss
            out[name] = monitor.noisy_mean(per_unit, self.clip, self.z, generator)
        return out


def setup(spec: PrivateValidation, tok, *, candidates: int, epsilon: float, clip: float, limit: int | None) -> Scorer:
    """Read the first `limit` units (all: None) of the validation split, then of the training
    split where it scores too, and calibrate z for `candidates` scores. At user level a unit is
    all of one user's records in either split: the data stage never puts a user on both sides,
    and if a split did, that user would still be one unit, never two (which would double what
    one user can move a score)."""
    paths = [spec.path] + ([spec.train] if spec.train is not None else [])
    columns = [token_column(tokenized_split(path, tok, spec.prompt)) for path in paths]
    users_of = [read_users(path) for path in paths]
    if len({users is None for users in users_of}) > 1:
        raise monitor.MonitorError(f"distill.selection_split: {paths[0].name} and {paths[1].name} disagree on "
                                   "the privacy unit (one has a user column, the other not); rebuild the splits "
                                   "with the data stage, or set distill.selection_split=validation")
    users = None if users_of[0] is None else [u for split in users_of for u in split]
    column = pa.chunked_array([chunk for c in columns for chunk in c.chunks], type=columns[0].type)
    records, units, n = monitor.first_units(column, users, limit)
    if n == 0:
        raise monitor.MonitorError("distill.select_by=private_validation: the validation split is empty; raise "
                                   "data.validation_fraction or use distill.select_by=teacher_kl (no private data)")
    z, accountant = calibrate(epsilon, spec.delta, candidates, spec.accountant)
    unit = "record" if users is None else "user"
    owners = list(range(len(records))) if units is None else units.tolist()
    entry = ledger_entry(z=z, candidates=candidates, n=n, clip=clip, target_epsilon=epsilon, delta=spec.delta,
                         accountant=accountant, unit=unit, secure=spec.secure_mode, train=spec.train is not None)
    return Scorer(TokenIds(records, spec.max_length, tok.pad_token_id), owners, n, clip, z, entry, spec.secure_mode,
                  splits_scored(spec.train is not None))


def calibrate(epsilon: float, delta: float, candidates: int, accountant: str) -> tuple[float, str]:
    return monitor.calibrate(epsilon, delta, candidates, accountant, setting="distill.selection_epsilon",
                             fewer="list fewer distill.candidates")


def splits_scored(train: bool) -> str:
    """The splits whose units the release scores, as the ledger note, selection.json and the report name them."""
    return "validation and training" if train else "validation"


def ledger_entry(*, z: float, candidates: int, n: int, clip: float, target_epsilon: float, delta: float,
                 accountant: str, unit: str, secure: bool, train: bool = False) -> LedgerEntry:
    """The release's ledger entry: one Gaussian step per candidate at q = 1."""
    return monitor.gaussian_entry(
        STAGE, z=z, releases=candidates, delta=delta, accountant=accountant, unit=unit, secure=secure,
        note=f"the distilled student chosen on private records (distill.select_by="
        f"private_validation): each of the {candidates} candidates' mean over the first {n} "
        f"{splits_scored(train)} {unit}s "
        f"of each {unit}'s mean per-token loss clipped to [0, {clip:g}] nats, plus Gaussian noise of sd "
        f"z·{clip:g}/{n} = {z * clip / max(n, 1):.4g} (z={z:.4g} calibrated for ε={target_epsilon} over the "
        f"{candidates} scores); only the noisy scores are published",
    )
