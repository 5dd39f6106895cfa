"""`dpdistill audit --empirical RUN_DIR`: an empirical ε beside the ledger's (issue 38 item 4).

The teacher is trained twice more on the run's private training split, with the run's own
teacher settings (`train_teacher`, pipeline/stages/teacher/recipe.py), plus m canaries each
included with probability ½ by a secret coin:

- "dp": `train_teacher` itself, σ calibrated for the split plus the included canaries at
  teacher.target_epsilon, with its own ledger entry (the ε the bound is set against);
- "noise_off": the same recipe (its `_setup` and `_step`: Poisson sampling, clipping, the
  optimizer, the same steps) with σ = 0, no ledger: it shows the audit has power.

Each is scored as pipeline/audits/empirical.py says: the ε lower bound from the canaries
(score = the public base model's per-token loss on the canary minus the trained model's: the
base model is public, and subtracting it removes how hard a canary is anyway), loss-based
membership inference (training records against the test split) and extraction (the first
`PROMPT_TOKENS` tokens of a record's text, greedy decoding of the next `CONTINUATION_TOKENS`).

Canaries are `CANARY_WORDS` words drawn with `secrets` from the tokenizer's whole-word
tokens (public), each under a control code copied from a random training record. The data
copy and both models live in a 0700 work directory under `RUN_DIR/private/`, deleted when
the audit ends. The figures are about private records: they go to
`RUN_DIR/private/empirical_audit.json` (0600 in a 0700 folder), never into the report; the
caller prints aggregates only (`format_summary`).

Cost: two teacher trainings of the run's length (plus the canaries' records) and, per model,
one forward pass over the canaries, the scored records and the extraction prompts.
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
from pipeline.audits.empirical import extraction_figures, membership_figures, one_run_audit
from pipeline.batching import TokenizedRecords, lm_batch
from pipeline.config import PipelineConfig, TeacherConfig, load_config
from pipeline.devices import Runtime
from pipeline.manifest import MANIFEST, atomic_write_json, private_dir
from pipeline.models.base import load_causal_lm, load_tokenizer
from pipeline.privacy.dpsgd import plan_dp_sgd
from pipeline.prompts import HEADER
from pipeline.records import encode_record, read_split, read_users

PRIVATE = "private"
EMPIRICAL = "empirical_audit.json"
DEFAULT_CANARIES = 256
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


def train_noise_off(cfg, *, train_path: Path, validation_path: Path, base_model: str, out_dir: Path, seed: int,
                    runtime: Runtime) -> torch.nn.Module:
    """The teacher recipe with σ = 0: the same Poisson sampling, clipping, optimizer and steps
    as `train_teacher`, no noise and no ledger (nothing of it is released). Returns the model."""
    from pipeline.stages.teacher import recipe

    runtime.apply_threads()
    users = read_users(train_path)
    n, unit = (pq.read_metadata(train_path).num_rows, "record") if users is None else (len(set(users)), "user")
    plan = plan_dp_sgd(cfg, n, unit)
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


def empirical_audit(run_dir: Path, canaries: int = DEFAULT_CANARIES, records: int = DEFAULT_RECORDS,
                    teacher_overrides: dict | None = None) -> tuple[Path, dict]:
    """Train, score, write `RUN_DIR/private/empirical_audit.json`; returns (its path, the figures).
    `teacher_overrides`: teacher settings changed for both trainings (e.g. epochs), said in the file."""
    run_dir = Path(run_dir)
    cfg, files, base_model = _inputs(run_dir)
    try:  # validated as the config is: a wrong key or value is an error naming it
        teacher = TeacherConfig.model_validate({**cfg.teacher.model_dump(), **(teacher_overrides or {}),
                                                "monitor": "none", "processes": 1, "nnodes": 1})
    except ValidationError as e:
        raise EmpiricalAuditError(f"teacher overrides {teacher_overrides}: {e}") from None
    t0, runtime = time.time(), Runtime.from_config(cfg)
    private = private_dir(run_dir / PRIVATE)
    work = Path(private / f".empirical-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}")
    private_dir(work)
    try:
        tok = load_tokenizer(base_model)
        train_codes, _ = read_split(files["train"])
        texts = canary_texts(tok, canaries)
        codes = [secrets.choice(train_codes) for _ in texts]
        included = [bool(secrets.randbits(1)) for _ in texts]
        write_train_copy(files["train"], codes, texts, included, work / "train.parquet")
        from pipeline.stages.teacher.recipe import train_teacher

        dp = train_teacher(teacher, train_path=work / "train.parquet", validation_path=files["validation"],
                           base_model=base_model, out_dir=work / "dp", seed=cfg.seed, stage="teacher (audit)",
                           runtime=runtime)
        models = {"dp": load_causal_lm(str(dp.checkpoint)).to(runtime.device),
                  "noise_off": train_noise_off(teacher, train_path=work / "train.parquet",
                                               validation_path=files["validation"], base_model=base_model,
                                               out_dir=work / "noise_off", seed=cfg.seed, runtime=runtime)}
        base = load_causal_lm(base_model).to(runtime.device)
        members, non_members = (read_split(files[s]) for s in ("train", "test"))
        members = tuple(x[:records] for x in members)
        non_members = tuple(x[:records] for x in non_members)
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
        "models": figures,
        "elapsed_seconds": round(time.time() - t0, 1),
    }
    out = private / EMPIRICAL
    atomic_write_json(out, report)  # mkstemp: 0600
    os.chmod(out, 0o600)
    return out, report


def format_summary(report: dict) -> str:
    """Aggregates only: no record, canary or per-record figure."""
    eps = report["ledger_epsilon_teacher"]
    lines = [f"empirical audit: ledger ε (teacher) = {'n/a' if eps is None else f'{eps:.4g}'}; audit training "
             f"ε = {report['audit_training_epsilon']:.4g} (replace-one {report['audit_training_epsilon_replace_one']:.4g}),"
             f" δ = {report['delta']:.3g}, σ = {report['noise_multiplier']:.4g}"]
    for name, f in report["models"].items():
        o, mi, ex = f["one_run"], f["membership"], f["extraction"]
        lines.append(f"  {name}: ε lower bound (95 %) {o['epsilon_lower_bound']:.3f} from {o['canaries']} canaries "
                     f"({o['right']}/{o['guesses']} guesses right); membership AUC {mi['auc']:.3f}, "
                     f"TPR@1%FPR {mi['tpr_at_1pct_fpr']:.3f}; extraction exact {ex['exact_match']:.3f}, token "
                     f"accuracy {ex['token_accuracy']:.3f}, median edit distance {ex['median_edit_distance']:.1f}")
    return "\n".join(lines)
