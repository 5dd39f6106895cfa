"""`dpdistill audit --empirical RUN_DIR`: an empirical ε beside the ledger's (issues 38, 62).

The teacher is trained again on the run's private training split, with the run's own teacher
settings (`train_teacher`, pipeline/stages/teacher/recipe.py), plus m canaries each included
with probability ½ by a secret coin:

- "dp": `train_teacher` itself, σ calibrated for the split plus the included canaries at
  teacher.target_epsilon. It is a DP release on the run's records (its figures are printed):
  charged to their budget as its own entry, `empirical-audit`, and checked against
  `privacy.max_epsilon` before it trains (pipeline/privacy/budget.py);
- "noise_off", only with `noise_off=True` (`--noise-off`): the same recipe (its `_setup` and
  `_step`: Poisson sampling, clipping, the optimizer, the same steps) with σ = 0. Its figures
  carry no DP guarantee, so it is made only on request, and the records' budget then records
  a release without DP (`empirical-audit-noise-off`): every later total of them says so.

Each is scored as pipeline/audits/empirical.py says: the ε lower bound from the canaries
(score = the public base model's per-token loss on the canary minus the trained model's: the
base model is public, and subtracting it removes how hard a canary is anyway), loss-based
membership inference (training records against the test split) and extraction (the first
`PROMPT_TOKENS` tokens of a record's text, greedy decoding of the next `CONTINUATION_TOKENS`).
The report says whether the audit had power (`empirical.power`): measured by the noise-off
training when there is one, else what m canaries can show at best, and the m that would.

Canaries are `CANARY_WORDS` words drawn with `secrets` from the tokenizer's whole-word
tokens (public), each under a control code copied from a random training record. The data
copy and the models live in a 0700 work directory under `RUN_DIR/private/`, deleted when
the audit ends. The figures are about private records: they go to
`RUN_DIR/private/empirical_audit.json` (0600 in a 0700 folder), never into the report; the
caller prints aggregates only (`format_summary`).

Cost: one teacher training of the run's length (two with the noise-off one) plus the
canaries' records and, per model, one forward pass over the canaries, the scored records and
the extraction prompts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from pydantic import ValidationError

from pipeline.audits.audit import split_files
from pipeline.audits.empirical import extraction_figures, membership_figures, one_run_audit, power
from pipeline.batching import TokenizedRecords, lm_batch
from pipeline.config import PipelineConfig, TeacherConfig, load_config
from pipeline.devices import Runtime
from pipeline.manifest import MANIFEST, atomic_write_json, private_dir
from pipeline.models.base import load_causal_lm, load_tokenizer
from pipeline.privacy.accountant import epsilon_of
from pipeline.privacy.budget import (check_max_epsilon, read_budget, record_non_dp_release, record_release,
                                     records_key, register_records, split_digests)
from pipeline.privacy.dpsgd import DpSgdPlan, plan_dp_sgd
from pipeline.privacy.ledger import LedgerEntry
from pipeline.prompts import HEADER
from pipeline.records import encode_record, read_split, read_users

PRIVATE = "private"
AUDIT_STAGE = "empirical-audit"
NOISE_OFF_STAGE = "empirical-audit-noise-off"
NOISE_OFF_NOTE = ("NOT DP: the empirical audit's teacher trained with σ = 0 on these records (--noise-off); its "
                  "membership, extraction and ε-bound figures were printed")
EMPIRICAL = "empirical_audit.json"
DEFAULT_CANARIES = 1000
"""Has power on the demo config: the noise-off training's bound was 2.774 there, above the
ledger's ε 1.99; with 256 it was 1.980, below (issue 62 item 8; docs/privacy.md)."""
CANARY_WORDS = 8
PROMPT_TOKENS = 8
CONTINUATION_TOKENS = 16
DEFAULT_RECORDS = 200  # training records scored for membership and extraction


class EmpiricalAuditError(ValueError):
    """The run cannot be audited this way; the message says why and what to set."""


# --- canaries and the data copy ----------------------------------------------------------


def canary_texts(tokenizer, m: int, words: int = CANARY_WORDS) -> list[str]:
    """m distinct strings of `words` random whole-word tokens of the tokenizer (public words),
    drawn with `secrets`; with fewer than 64 such words (a tiny vocabulary), of 2 × `words` random
    printable tokens joined as they decode."""
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    vocab = sorted({p.strip() for p in pieces if len(p.strip()) >= 3 and p.strip().isalpha()})
    join, count = " ".join, words
    if len(vocab) < 64:
        vocab = sorted({p for p in pieces if p.strip() and p.isascii() and p.isprintable()})
        join, count = (lambda parts: "".join(parts).strip()), 2 * words
    if len(vocab) < 8:
        raise EmpiricalAuditError(f"the tokenizer has {len(vocab)} printable tokens: too few to build canaries")
    out: list[str] = []
    while len(out) < m:
        text = join([secrets.choice(vocab) for _ in range(count)])
        if text and text not in out:
            out.append(text)
    return out


def write_train_copy(train: Path, codes: list[str], texts: list[str], included: list[bool], path: Path) -> None:
    """The training split plus the included canaries (each its own user) at random rows, 0600."""
    table = pq.read_table(train)
    rows = {c: table[c].to_pylist() for c in table.column_names if c in ("control_code", "text", "user")}
    rng = secrets.SystemRandom()
    for i, (code, text, inc) in enumerate(zip(codes, texts, included)):
        if inc:
            at = rng.randrange(len(rows["text"]) + 1)
            rows["control_code"].insert(at, code)
            rows["text"].insert(at, text)
            if "user" in rows:
                rows["user"].insert(at, f"canary-user-{i}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        pq.write_table(pa.table({c: pa.array(v, pa.string()) for c, v in rows.items()}), f)


# --- training ------------------------------------------------------------------------------


def units(train_path: Path) -> tuple[int, str]:
    """N and the privacy unit of a training split: its users when it has them, else its records."""
    users = read_users(train_path)
    return (pq.read_metadata(train_path).num_rows, "record") if users is None else (len(set(users)), "user")


def train_noise_off(cfg, *, train_path: Path, validation_path: Path, base_model: str, out_dir: Path, seed: int,
                    runtime: Runtime) -> torch.nn.Module:
    """The teacher recipe with σ = 0: the same Poisson sampling, clipping, optimizer and steps
    as `train_teacher`, no noise and no ledger entry (not DP: the caller records the release in
    the records' budget). Returns the model."""
    from pipeline.stages.teacher import recipe

    runtime.apply_threads()
    plan = plan_dp_sgd(cfg, *units(train_path))
    plan = dataclasses.replace(plan, sigma=0.0, steps_allowed=plan.steps)
    run = recipe._setup(cfg, train_path=train_path, validation_path=validation_path, monitor_path=None,
                        base_model=base_model, out_dir=out_dir, seed=seed, stage="teacher (noise off, audit)", kd=None,
                        runtime=runtime, planned=plan)
    assert run.sigma == 0.0, run.sigma
    done = 0
    while done < run.steps_allowed:
        with BatchMemoryManager(data_loader=run.loader, max_physical_batch_size=cfg.physical_batch_size,
                                optimizer=run.optimizer) as physical_loader:
            for ids, lengths in physical_loader:
                recipe._step(run, ids, lengths)
                if run.optimizer._is_last_step_skipped:
                    continue
                done += 1
                if done >= run.steps_allowed:
                    break
    run.dp_model._close()
    model = run.model.merge_and_unload() if cfg.mode == "lora" else run.model
    return model.eval()


# --- scoring ------------------------------------------------------------------------------


@torch.no_grad()
def text_losses(model, tokenizer, codes: list[str], texts: list[str], max_length: int, batch_size: int = 32):
    """Mean per-token loss (nats) of each text given its control code, as the teacher trains on
    it (`encode_record`, cut at `max_length`): the tokens after the prompt, eos included."""
    model.eval()
    device = next(model.parameters()).device
    ids = [encode_record(tokenizer, c, t, max_length) for c, t in zip(codes, texts)]
    prefixes = [len(HEADER.ids(tokenizer, c)) for c in codes]
    data = TokenizedRecords(ids, tokenizer.pad_token_id, max(map(len, ids)))
    out = np.zeros(len(texts))
    for start in range(0, len(texts), batch_size):
        batch = lm_batch(data.ids[start : start + batch_size], data.lengths[start : start + batch_size])
        labels = batch.pop("labels").to(device)  # (B, L-1)
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits[:, :-1].float()  # (B, L-1, V)
        logp = torch.log_softmax(logits, dim=-1)
        mask = labels >= 0
        for row, prefix in enumerate(prefixes[start : start + batch_size]):
            mask[row, : prefix - 1] = False
        picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, L-1)
        out[start : start + len(labels)] = (-(picked * mask).sum(1) / mask.sum(1).clamp(min=1)).cpu().numpy()
    return out


@torch.no_grad()
def greedy_pairs(model, tokenizer, codes: list[str], texts: list[str], max_length: int,
                 prompt_tokens: int = PROMPT_TOKENS,
                 continuation_tokens: int = CONTINUATION_TOKENS) -> list[tuple[list[int], list[int]]]:
    """(greedy continuation, true continuation) of each record with more than `prompt_tokens`
    text tokens: prompted with its control code and first `prompt_tokens` text tokens; the
    continuation stops where training cut the record (`max_length` tokens)."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for code, text in zip(codes, texts):
        body = tokenizer.encode(text, add_special_tokens=False)
        if len(body) <= prompt_tokens:
            continue
        prompt = HEADER.ids(tokenizer, code) + body[:prompt_tokens]
        truth = body[prompt_tokens : prompt_tokens + max(0, min(continuation_tokens, max_length - len(prompt)))]
        if not truth:
            continue
        ids = torch.tensor([prompt], device=device)
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(truth), do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
        out.append((got, truth))
    return out


def score(model, base, tokenizer, canaries: tuple[list[str], list[str], list[bool]], members, non_members,
          delta: float, max_length: int) -> dict:
    """The three figures of one trained model."""
    codes, texts, included = canaries
    canary_scores = (text_losses(base, tokenizer, codes, texts, max_length)
                     - text_losses(model, tokenizer, codes, texts, max_length))
    return {
        "one_run": one_run_audit(canary_scores, included, delta),
        "membership": membership_figures(text_losses(model, tokenizer, *members, max_length),
                                         text_losses(model, tokenizer, *non_members, max_length)),
        "extraction": extraction_figures(greedy_pairs(model, tokenizer, *members, max_length)),
    }


# --- the audit ------------------------------------------------------------------------------


def _inputs(run_dir: Path) -> tuple[PipelineConfig, dict[str, Path], str]:
    if not (run_dir / "config.yaml").is_file():
        raise EmpiricalAuditError(f"{run_dir} holds no config.yaml: pass a run directory")
    cfg = load_config(run_dir / "config.yaml")
    files = split_files(run_dir)
    if not {"train", "test"} <= files.keys():
        why = ("the run deleted them after evaluation (data.keep_private_copies=false)"
               if not cfg.data.keep_private_copies else "they are missing or changed since the data manifest")
        raise EmpiricalAuditError(
            f"{run_dir}/data holds no private train and test splits: {why}. The empirical audit trains on the "
            "run's private training split: run the pipeline with data.keep_private_copies=true")
    manifest = run_dir / "teacher" / MANIFEST
    try:
        base_model = json.loads(manifest.read_text())["base_model"]
    except (OSError, ValueError, KeyError) as e:
        raise EmpiricalAuditError(f"{manifest}: no finished teacher stage to take the base model from "
                                  f"({type(e).__name__})") from None
    return cfg, files, base_model


def _ledger_epsilon(run_dir: Path) -> float | None:
    try:
        entries = json.loads((run_dir / "ledger.json").read_text())["entries"]
    except (OSError, ValueError, KeyError):
        return None
    return next((e["epsilon"] for e in entries if e.get("stage") == "teacher" and e.get("epsilon")), None)


def _teacher_config(cfg: PipelineConfig, overrides: dict | None) -> TeacherConfig:
    try:  # validated as the config is: a wrong key or value is an error naming it
        return TeacherConfig.model_validate({**cfg.teacher.model_dump(), **(overrides or {}),
                                             "monitor": "none", "processes": 1, "nnodes": 1})
    except ValidationError as e:
        raise EmpiricalAuditError(f"teacher overrides {overrides}: {e}") from None


def _records_budget(run_dir: Path, cfg: PipelineConfig, train: Path) -> tuple[Path, str]:
    """The run_root and id of the budget of the run's training records: the one its run.json
    names, else named now from the split as the flow names it (pipeline/privacy/budget.py)."""
    try:
        info = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        info = {}
    root = Path(info.get("run_root") or cfg.run_root).resolve()
    return root, info.get("records_id") or register_records(root, split_digests(train, records_key(root)))


def _checked_plan(teacher: TeacherConfig, n: int, unit: str, cfg: PipelineConfig, budget: tuple[Path, str]
                  ) -> DpSgdPlan:
    """σ, q and steps of the audit's DP training over `n` units, refused (`BudgetExceeded`) before
    it trains when it would take the records' budget past `privacy.max_epsilon`."""
    dp = plan_dp_sgd(teacher, n, unit)
    history = [(dp.sigma, dp.sample_rate, dp.steps_allowed)]
    planned = LedgerEntry(stage=AUDIT_STAGE, private=True, epsilon=epsilon_of(teacher.accountant, history, dp.delta),
                          delta=dp.delta, accountant=teacher.accountant, mechanism="subsampled_gaussian",
                          noise_multiplier=dp.sigma, sample_rate=dp.sample_rate, steps=dp.steps_allowed,
                          privacy_unit=unit, history=history, note="planned: the empirical audit's DP training")
    check_max_epsilon(read_budget(*budget), [planned], cfg.privacy.max_epsilon, teacher.accountant, dp.delta)
    return dp


def _canaries(tok, m: int, train: Path) -> tuple[list[str], list[str], list[bool]]:
    """m canaries, each under a random training record's control code, and their secret coins."""
    train_codes, _ = read_split(train)
    texts = canary_texts(tok, m)
    return [secrets.choice(train_codes) for _ in texts], texts, [bool(secrets.randbits(1)) for _ in texts]


def empirical_audit(run_dir: Path, canaries: int = DEFAULT_CANARIES, records: int = DEFAULT_RECORDS,
                    teacher_overrides: dict | None = None, noise_off: bool = False) -> tuple[Path, dict]:
    """Train, score, write `RUN_DIR/private/empirical_audit.json`; returns (its path, the figures).
    `teacher_overrides`: teacher settings changed for both trainings (e.g. epochs), said in the file.
    `noise_off`: also train without noise (not DP: recorded so in the records' budget)."""
    run_dir = Path(run_dir)
    cfg, files, base_model = _inputs(run_dir)
    teacher = _teacher_config(cfg, teacher_overrides)
    t0, runtime = time.time(), Runtime.from_config(cfg)
    budget = _records_budget(run_dir, cfg, files["train"])
    private = private_dir(run_dir / PRIVATE)
    work = Path(private / f".empirical-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}")
    private_dir(work)
    try:
        tok = load_tokenizer(base_model)
        codes, texts, included = _canaries(tok, canaries, files["train"])
        n, unit = units(files["train"])
        plan = _checked_plan(teacher, n + sum(included), unit, cfg, budget)  # each canary one unit
        write_train_copy(files["train"], codes, texts, included, work / "train.parquet")
        from pipeline.stages.teacher.recipe import train_teacher

        paths = {"train_path": work / "train.parquet", "validation_path": files["validation"], "base_model": base_model}
        dp = train_teacher(teacher, **paths, out_dir=work / "dp", seed=cfg.seed, stage=AUDIT_STAGE, runtime=runtime,
                           dp_sgd=plan)
        record_release(*budget, release_id=f"{AUDIT_STAGE}:{secrets.token_hex(16)}", stage=AUDIT_STAGE,
                       run_dir=run_dir, entry=dp.ledger)
        models = {"dp": load_causal_lm(str(dp.checkpoint)).to(runtime.device)}
        if noise_off:
            models["noise_off"] = train_noise_off(teacher, **paths, out_dir=work / "noise_off", seed=cfg.seed,
                                                  runtime=runtime)
            record_non_dp_release(*budget, release_id=f"{NOISE_OFF_STAGE}:{secrets.token_hex(16)}",
                                  stage=NOISE_OFF_STAGE, run_dir=run_dir, unit=unit, note=NOISE_OFF_NOTE)
        base = load_causal_lm(base_model).to(runtime.device)
        members, non_members = (tuple(x[:records] for x in read_split(files[s])) for s in ("train", "test"))
        figures = {name: score(model, base, tok, (codes, texts, included), members, non_members, dp.ledger.delta,
                               teacher.max_length) for name, model in models.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "run_dir": str(run_dir),
        "ledger_epsilon_teacher": _ledger_epsilon(run_dir),
        "audit_training_epsilon": dp.ledger.epsilon,
        "audit_training_epsilon_replace_one": dp.ledger.epsilon_replace_one,
        "delta": dp.ledger.delta,
        "noise_multiplier": dp.ledger.noise_multiplier,
        "teacher_overrides": teacher_overrides or {},
        "canary_format": f"{CANARY_WORDS} random whole-word (or 2x as many random) tokens of the tokenizer; the "
                         "canaries and their coins are not written here",
        "records_budget": budget[1],
        "models": figures,
        "power": power(canaries, dp.ledger.delta, dp.ledger.epsilon, figures.get("noise_off", {}).get("one_run")),
        "elapsed_seconds": round(time.time() - t0, 1),
    }
    out = private / EMPIRICAL
    atomic_write_json(out, report)  # mkstemp: 0600
    os.chmod(out, 0o600)
    return out, report


def format_summary(report: dict) -> str:
    """Aggregates only: no record, canary or per-record figure."""
    eps, audit_eps = report["ledger_epsilon_teacher"], report["audit_training_epsilon"]
    lines = [f"empirical audit: ledger ε (teacher) = {'n/a' if eps is None else f'{eps:.4g}'}; audit training "
             f"ε = {audit_eps:.4g} (replace-one {report['audit_training_epsilon_replace_one']:.4g}),"
             f" δ = {report['delta']:.3g}, σ = {report['noise_multiplier']:.4g}: charged to the records' budget"]
    for name, f in report["models"].items():
        o, mi, ex = f["one_run"], f["membership"], f["extraction"]
        label = "noise_off (NO DP, released on request)" if name == "noise_off" else name
        lines.append(f"  {label}: ε lower bound (95 %) {o['epsilon_lower_bound']:.3f} from {o['canaries']} canaries "
                     f"({o['right']}/{o['guesses']} guesses right); membership AUC {mi['auc']:.3f}, "
                     f"TPR@1%FPR {mi['tpr_at_1pct_fpr']:.3f}; extraction exact {ex['exact_match']:.3f}, token "
                     f"accuracy {ex['token_accuracy']:.3f}, median edit distance {ex['median_edit_distance']:.1f}")
    if report["models"]["dp"]["one_run"]["epsilon_lower_bound"] > audit_eps:
        lines.append("  the DP bound is above the audit training's ε: at 95 % confidence a correct accountant "
                     "gives that in up to 5 % of audits; a second audit above it too points to a bug")
    lines.append("  " + _power_line(report.get("power"), report["models"]["dp"]["one_run"]["canaries"]))
    return "\n".join(lines)


def _power_line(p: dict | None, m: int) -> str:
    if not p or p["epsilon"] is None:
        return "power: unknown (no ledger ε to set the bound against)"
    need = p["canaries_for_power"]
    more = f"--canaries {need} would" if need else (
        f"no number of canaries would: the bound gets no higher than {p['best_lower_bound'] or 0:.3f} at this rate "
        f"of right guesses and δ (the test's 2mδ term grows with m): a training that leaks more (e.g. more "
        "teacher.epochs) or a larger split (a smaller δ) would")
    if p["noise_off_lower_bound"] is not None:
        if p["has_power"]:
            return (f"power: yes, the noise-off training's bound {p['noise_off_lower_bound']:.3f} exceeds ε "
                    f"{p['epsilon']:.4g}")
        return (f"NO POWER: the noise-off training's bound {p['noise_off_lower_bound']:.3f} does not exceed ε "
                f"{p['epsilon']:.4g}, so the DP bound says nothing; {more}")
    if p["has_power"] is False:
        return (f"NO POWER: {m} canaries cannot show a bound above {p['max_lower_bound']:.3f} (every guess right), "
                f"not above ε {p['epsilon']:.4g}; {more}")
    return (f"power: not measured; {m} canaries can show up to {p['max_lower_bound']:.3f} (every guess right) "
            "against ε {:.4g}; --noise-off measures whether the attack sees a training that leaks (a release "
            "without DP, recorded in the records' budget)".format(p["epsilon"]))
