"""Stage 3: the student learns from the synthetic data only (no DP needed).

Loss = (1-α)·CE + α·T²·KL(teacher_T ‖ student_T) + β·MSE(last hidden states), see
`pipeline.models.losses`. Teacher logits are computed on the fly, in eval mode, without
gradients; with `teacher_top_k` set they come instead from a cache of the teacher's top-k
logits (`pipeline.stages.logit_cache`), built once per synthetic set and teacher and reused by
every student, so no teacher forward pass runs per step. This stage takes the synthetic
Parquet and the DP teacher, never the private data, so it is post-processing of the DP
release.

Teacher and student must share one tokenizer: the KL compares distributions over the
same vocabulary, and the synthetic token ids are fed to both.

With several `candidates` (α, T, β, ...), one student is trained per candidate and the one
closest to the DP teacher on texts it samples without truncation is kept
(`pipeline.stages.selection`): post-processing too. With select_by=private_validation the
choice is made instead on private records (the validation split, and by default the training
split: distill.selection_split), through an accounted Gaussian release
(`pipeline.privacy.private_selection`): the one way this stage reads a private record, and a
ledger entry of its own.

The recipe: `_setup` (tokenizers, teacher or its logit cache, synthetic ids) →
`_train_together` (every candidate a `_Student`, stepped batch by batch beside the others:
`step_loss` per batch, the teacher's logits once per batch; `_Validation` keeps the best) → `_select` →
`_save` (training log, manifest last).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from transformers import AutoConfig

from pipeline.batching import IGNORE, lm_batch
from pipeline.models.scoring import mean_token_nll
from pipeline.privacy import private_selection
from pipeline.privacy.ledger import LedgerEntry
from pipeline.privacy.monitor import MonitorError
from pipeline.stages.adherence import adherent_samples
from pipeline.stages.selection import choose, log_selection, score_students, selection_set
from pipeline.config import DistillConfig
from pipeline.devices import CPU_FP32, Runtime, adamw
from pipeline.stages.generate import synthetic_files, synthetic_ids, synthetic_prompt
from pipeline.stages.logit_cache import CachedTopK, build_teacher_cache
from pipeline.models.losses import TopKLogits, distillation_loss, prompt_mask
from pipeline.manifest import atomic_write_json, write_manifest
from pipeline.models.base import load_causal_lm, load_tokenizer, model_positions, same_tokenizer
from pipeline.progress import DEFAULT_EVERY, ProgressLog, on_batch_lines
from pipeline.tokenized import TokenIds

log = logging.getLogger(__name__)


SCRATCH = ".synthetic_ids"  # out_dir's memory-mapped copy of the synthetic ids, while the stage runs
KEPT_SAMPLES = "kept_samples.json"  # keep_samples=code_adherent: the ids of the synthetic samples kept


class DistillError(ValueError):
    """The distillation cannot run as configured; the message says what to change."""


@dataclass(frozen=True)
class DistillResult:
    checkpoint: Path
    train_loss: list[float]
    seconds: float
    teacher_cache: Path | None = None
    """The top-k teacher logit cache used (None: logits on the fly)."""
    train_samples: int | None = None
    """Synthetic train samples the student trained on (`num_synthetic`, or all of them)."""
    available_samples: int | None = None
    """Synthetic train samples the generation holds."""
    selection: dict | None = None
    """The candidates, their criterion values and the chosen one (None: one setting, no selection)."""
    candidates: dict[str, Path] | None = None
    """Each candidate's student checkpoint, when `keep_candidates` (evaluated on the test split too)."""
    selection_ledger: LedgerEntry | None = None
    """select_by=private_validation: the noisy private scores' release, composed into the run's total."""
    kept_samples: Path | None = None  # keep_samples=code_adherent: the ids of the samples kept (KEPT_SAMPLES)

    def releases(self) -> dict[str, LedgerEntry]:
        """The stage's DP release: the private selection's, when it made one."""
        return {":selection": self.selection_ledger} if self.selection_ledger else {}


@dataclass
class _Setup:
    """What every candidate shares: tokenizer, teacher (or its top-k logit cache), synthetic ids."""

    tok: object
    teacher: torch.nn.Module | None
    cache: object | None  # TeacherCache
    max_len: int
    train_table: object  # pyarrow Table: sample_id, n_prompt_tokens, token_ids
    validation: TokenIds
    available: int
    scratch: Path


def _setup(cfg: DistillConfig, *, synthetic_path: Path, teacher_dir: Path, student_model: str, out_dir: Path,
           teacher_cache_dir: Path | None, progress_every: float, runtime: Runtime) -> _Setup:
    teacher_tok, student_tok = load_tokenizer(str(teacher_dir)), load_tokenizer(student_model)
    if not same_tokenizer(teacher_tok, student_tok):
        raise DistillError(
            f"the student {student_model!r} and the teacher use different tokenizers; the KL needs "
            "one vocabulary: pick a student of the teacher's family (e.g. gpt2 teacher, distilgpt2 student)"
        )
    teacher = cache = None
    if cfg.teacher_top_k is None:
        teacher = load_causal_lm(str(teacher_dir), dtype=runtime.dtype).eval().to(runtime.device)
        teacher_positions = model_positions(teacher.config)
    elif cfg.beta > 0:
        raise DistillError(f"distill.beta={cfg.beta} needs teacher hidden states, which the top-k cache "
                           "does not hold; set distill.beta=0 or distill.teacher_top_k=null")
    else:
        cache = build_teacher_cache(Path(teacher_dir), Path(synthetic_path), k=cfg.teacher_top_k,
                                    cache_dir=teacher_cache_dir, batch_size=cfg.batch_size,
                                    progress_every=progress_every, runtime=runtime)
        teacher_positions = cache.max_length
    max_len = min(model_positions(AutoConfig.from_pretrained(student_model)), teacher_positions)
    # The shards' ids copied, a batch at a time, into memory-mapped Arrow files: random access
    # for shuffled epochs without the synthetic set in memory. Public; removed at the end.
    scratch = Path(out_dir) / SCRATCH
    train_table = synthetic_ids(synthetic_path, "train", scratch / "train.arrow").data.table
    val_table = synthetic_ids(synthetic_path, "validation", scratch / "validation.arrow").data.table
    if train_table.num_rows == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise DistillError(f"synthetic data {str(synthetic_path)!r} has no train samples; generate samples first")
    validation = TokenIds(val_table["token_ids"], max_len, student_tok.pad_token_id)
    if len(validation) == 0:  # generate.validation_fraction=0, or shards of a single kept sample
        log.warning(
            "distillation: the synthetic data has no validation samples, so the student is never evaluated "
            "during training and the last one is kept (no early stopping); raise generate.num_samples or "
            "generate.validation_fraction"
        )
    return _Setup(tok=student_tok, teacher=teacher, cache=cache, max_len=max_len, train_table=train_table,
                  validation=validation, available=train_table.num_rows, scratch=scratch)


def _kept(cfg: DistillConfig, setup: _Setup, *, synthetic_path: Path, teacher_dir: Path, out_dir: Path,
          code_values: dict[str, dict[str, str]] | None, runtime: Runtime, progress_every: float) -> _Setup:
    """distill.keep_samples=code_adherent: only the synthetic train samples the teacher that wrote
    them recognises as written for their codes (issue 59 item 4). It reads the teacher and its
    text only: post-processing, no privacy cost. Their ids go beside the student, for the evaluation."""
    if cfg.keep_samples == "all":
        return setup
    if not code_values:
        raise DistillError("distill.keep_samples=code_adherent needs the declared code values (control_codes.domain)")
    teacher = setup.teacher
    if teacher is None:  # teacher_top_k: its logits are cached, the model is loaded for this only
        teacher = load_causal_lm(str(teacher_dir), dtype=runtime.dtype).eval().to(runtime.device)
    kept = adherent_samples(teacher, setup.tok, synthetic_path, code_values, setup.available, cfg.batch_size,
                            synthetic_prompt(synthetic_path),
                            on_batch_lines(log, "distillation: code adherence", "sequences", progress_every))
    table = setup.train_table.filter(pc.is_in(setup.train_table["sample_id"], pa.array(sorted(kept), pa.int64())))
    log.info("distillation: keeping %d of the %d synthetic train samples, those the teacher recognises as written "
             "for their codes (distill.keep_samples=code_adherent)", table.num_rows, setup.available)
    if table.num_rows == 0:
        raise DistillError("distill.keep_samples=code_adherent kept no synthetic sample: the teacher recognises "
                           "none as written for its codes; use distill.keep_samples=all")
    atomic_write_json(out_dir / KEPT_SAMPLES, {"rule": cfg.keep_samples, "sample_ids": table["sample_id"].to_pylist()})
    return replace(setup, train_table=table, available=table.num_rows)


def _train_rows(cfg: DistillConfig, setup: _Setup, synthetic_path: Path):
    """The candidate's synthetic train samples: all, or the first `num_synthetic` in the shards'
    order (sample_id order: each size is a prefix of the next, Figure 3 from one generation)."""
    if cfg.num_synthetic is None:
        return setup.train_table
    if cfg.num_synthetic > setup.available:
        raise DistillError(
            f"distill.num_synthetic={cfg.num_synthetic} exceeds the {setup.available} synthetic train samples in "
            f"{str(synthetic_path)!r} (generation keeps fewer than generate.num_samples: the validation "
            f"split and empty samples); set distill.num_synthetic to at most {setup.available} or raise "
            "generate.num_samples"
        )
    return setup.train_table.slice(0, cfg.num_synthetic)


def _n_steps(cfg: DistillConfig, n_train: int) -> int:
    return cfg.epochs * math.ceil(n_train / cfg.batch_size)


class _Validation:
    """CE on the synthetic validation split every `eval_every` steps; saves the student to
    `ckpt` when it improves; says when `patience` evaluations passed without improvement."""

    def __init__(self, cfg: DistillConfig, setup: _Setup, ckpt: Path, runtime: Runtime):
        self.cfg, self.setup, self.ckpt, self.runtime = cfg, setup, ckpt, runtime
        self.evals: list[dict] = []
        self.best, self.since_best = float("inf"), 0

    def __call__(self, student, step: int) -> bool:
        """Evaluate at `step`; True: stop early."""
        if len(self.setup.validation) == 0:
            return False
        with self.runtime.autocast():  # mean_token_nll upcasts the logits
            loss = mean_token_nll(student, self.setup.validation, self.cfg.batch_size)
        student.train()
        self.evals.append({"step": step, "validation_loss": loss})
        if loss < self.best:
            self.best, self.since_best = loss, 0
            _save_model(student, self.setup.tok, self.ckpt)
        else:
            self.since_best += 1
        log.info("distillation: step %d validation loss %.4f (best %.4f)", step, loss, self.best)
        return self.cfg.patience is not None and self.since_best >= self.cfg.patience


def _save_model(student, tok, ckpt: Path) -> None:
    student.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)


def step_loss(cfg: DistillConfig, teacher, vocab: int, student, projection, cached, ids, lengths, skip,
              runtime: Runtime, shared: dict | None = None, prompts: torch.Tensor | None = None):
    """One batch's loss parts (the caller steps the optimiser). ids (B, L), lengths (B,), skip (B,);
    `prompts` (B,): under a prompt template, each sample's prompt length, whose tokens no loss counts;
    `teacher`: the frozen teacher, None with `cached` top-k logits; `vocab`: the tokenizer's size;
    `shared`: a dict kept over the candidates stepping the same batch, in which the first keeps
    the teacher's logits and hidden states for the others. `dpdistill plan` times this function
    (pipeline/timing.py).

    The models run the batch in `cfg.length_groups` groups of samples of similar length, each
    padded to its own longest; the vocabulary projections and the losses then run once, on the
    batch's N real targets only, as one (1, N) row. The same per-token losses, means over the
    same tokens and gradient as on the padded (B, L-1, V) logits (issue 22: a shuffled batch
    of synthetic samples was ~30% padding, and the (B, L-1, V) tensors the largest of the step)."""
    device, want_hidden = runtime.device, cfg.beta > 0
    groups = [g for g in torch.argsort(lengths).chunk(cfg.length_groups) if len(g)]  # similar lengths together
    batches, labels, kl_mask = [], [], []
    for g in groups:
        batch = {k: v.to(device) for k, v in lm_batch(ids[g], lengths[g], None if prompts is None else prompts[g]).items()}
        target = batch.pop("labels")  # (b, l-1)
        real = target != IGNORE  # (b, l-1): the targets that count
        batches.append((batch, real))
        labels.append(target[real])
        kl_mask.append(prompt_mask(target.shape[1], skip[g]).to(device)[real])
    labels, kl_mask = torch.cat(labels)[None], torch.cat(kl_mask)[None]  # (1, N)
    teacher_hidden = None
    if cached is not None:  # TopKLogits (B, L-1, k), already on the device
        teacher_logits = TopKLogits(*(None if t is None else  # (1, N, k) and (1, N)
                                      torch.cat([t[g][:, : real.shape[1]][real] for g, (_, real) in zip(groups, batches)])[None]
                                      for t in cached))
    elif shared is not None and "teacher" in shared:  # the same batch, in the same length groups
        teacher_logits, t_last = shared["teacher"]
    else:
        with torch.no_grad(), runtime.autocast():
            t_last = _real_hidden(teacher, batches)  # (N, H_t)
            teacher_logits = _vocab_logits(teacher, t_last, vocab).float()[None]  # (1, N, V)
        if shared is not None:
            shared["teacher"] = teacher_logits, t_last
    if cached is None:
        teacher_hidden = t_last.float()[None] if want_hidden else None
    with runtime.autocast():  # forward only; the losses below run in fp32
        s_last = _real_hidden(student, batches)  # (N, H_s)
        s_logits = _vocab_logits(student, s_last, vocab)  # (N, V)
        s_hidden = projection(s_last) if projection is not None else s_last  # (N, H_t)
    return distillation_loss(
        s_logits.float()[None], teacher_logits, labels, kl_mask, alpha=cfg.alpha, temperature=cfg.temperature,
        beta=cfg.beta, student_hidden=s_hidden.float()[None] if want_hidden else None, teacher_hidden=teacher_hidden,
    )


def _real_hidden(model, batches: list[tuple[dict, torch.Tensor]]) -> torch.Tensor:
    """The last hidden states (N, H) at the real targets' positions of every group, in order:
    what the LM head reads, `hidden_states[-1]` of the model's output (after the final norm)."""
    return torch.cat([model.base_model(**batch).last_hidden_state[:, :-1][real] for batch, real in batches])


def _vocab_logits(model, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
    """The LM head on some positions' hidden states (N, H) -> (N, V): GPT-2's head is a plain
    projection (a model that scales or caps its logits after the head would need that here)."""
    return model.get_output_embeddings()(hidden)[:, :vocab]


class _Student:
    """One candidate's training: its student, optimiser, schedule, validation and history, stepped
    one batch at a time by `_train_together`. Its draws (dropout) come from a random state of
    its own, seeded like the others' at the start: stepped beside other candidates, it trains
    exactly as it would alone. The best student on the synthetic validation split is saved to
    `ckpt` (the last one without a validation split)."""

    def __init__(self, cfg: DistillConfig, setup: _Setup, *, name: str, student_model: str, synthetic_path: Path,
                 ckpt: Path, seed: int, runtime: Runtime, progress: Callable[[dict], None]):
        torch.manual_seed(seed)  # every candidate starts from the same draws
        self.cfg, self.setup, self.name, self.ckpt, self.runtime, self.progress = cfg, setup, name, ckpt, runtime, progress
        rows = _train_rows(cfg, setup, synthetic_path)
        self.data = TokenIds(rows["token_ids"], setup.max_len, setup.tok.pad_token_id)
        self.prompt_lengths = torch.from_numpy(rows["n_prompt_tokens"].to_numpy().astype("int64"))  # (N,)
        self.masks_prompt = synthetic_prompt(synthetic_path).masks_prompt  # a template's prompt: no loss counts it
        self.cached = CachedTopK(setup.cache, rows["sample_id"].to_pylist()) if setup.cache is not None else None
        log.info("distillation%s: training on %d of the %d synthetic train samples%s", self.tag, len(self.data),
                 setup.available, "" if cfg.num_synthetic is None else " (distill.num_synthetic)")
        self.student = load_causal_lm(student_model).to(runtime.device)  # fp32 master weights
        # β > 0 with different widths: a learned linear map from the student's hidden size to
        # the teacher's (FitNets-style); it trains with the student and is not saved with it.
        h_s = self.student.config.hidden_size
        h_t = setup.teacher.config.hidden_size if setup.teacher is not None else h_s
        self.projection = torch.nn.Linear(h_s, h_t, device=runtime.device) if cfg.beta > 0 and h_s != h_t else None
        self.params = list(self.student.parameters()) + (list(self.projection.parameters()) if self.projection else [])
        self.optimizer = adamw(self.params, cfg.learning_rate, cfg.weight_decay)
        self.total = _n_steps(cfg, len(self.data))
        warmup = max(1, int(cfg.warmup_fraction * self.total))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, (self.total - s) / max(1, self.total - warmup))
        )
        self.validate = _Validation(cfg, setup, ckpt, runtime)
        self.history: list[dict] = []
        self.steps, self.stopped_early, self.seconds = 0, False, 0.0
        self.student.train()
        self.rng = _rng_state(runtime)

    @property
    def tag(self) -> str:
        return f" [{self.name}]" if self.name else ""

    def step(self, epoch: int, idx: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, shared: dict) -> None:
        """One optimiser step on the samples `idx`, collated to `ids` (B, L) and `lengths` (B,);
        `shared`: this batch's teacher logits, computed by the first candidate stepping it."""
        t0 = time.time()
        _set_rng_state(self.rng)
        cfg = self.cfg
        skip = self.prompt_lengths[idx] if cfg.kl_skip_tokens is None else torch.full((len(idx),), cfg.kl_skip_tokens)
        top = None
        if self.cached is not None:
            top = self.cached.batch(idx, lengths)  # (B, L-1, k)
            top = type(top)(*(None if t is None else t.to(self.runtime.device) for t in top))
        parts = step_loss(cfg, self.setup.teacher, len(self.setup.tok), self.student, self.projection, top, ids, lengths,
                          skip, self.runtime, shared=shared, prompts=self.prompt_lengths[idx] if self.masks_prompt else None)
        parts.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        step = self.steps
        record = {"step": step, "epoch": epoch, **{k: v.detach().item() for k, v in parts._asdict().items()}}
        self.history.append(record)
        self.progress({**record, "tokens": int(lengths.sum()), "candidate": self.name})  # synthetic tokens: public
        if step % cfg.log_every == 0 or step == self.total:
            log.info("distillation%s: step %d/%d loss %.4f (ce %.4f, kl %.4f, mse %.4f) (%.0f s)", self.tag, step,
                     self.total, record["loss"], record["ce"], record["kl"], record["mse"], self.seconds + time.time() - t0)
        if (step % cfg.eval_every == 0 or step == self.total) and self.validate(self.student, step):
            self.stopped_early = True
            log.info("distillation%s: no improvement in %d evaluations, stopping at step %d", self.tag, cfg.patience, step)
        self.rng = _rng_state(self.runtime)
        self.seconds += time.time() - t0

    def result(self) -> dict:
        """The training log; without a validation split the last student is saved as the result."""
        if not self.validate.evals:
            _save_model(self.student, self.setup.tok, self.ckpt)
        return {"history": self.history, "validation": self.validate.evals, "stopped_early": self.stopped_early,
                "seconds": self.seconds, "steps": self.steps, "train_samples": len(self.data),
                "best_validation_loss": self.validate.best if self.validate.evals else None}


def _rng_state(runtime: Runtime) -> tuple:
    """The generators a student's step draws from: the CPU's, and its CUDA device's."""
    cuda = runtime.device.type == "cuda"
    return torch.get_rng_state(), (torch.cuda.get_rng_state(runtime.device), runtime.device) if cuda else None


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(*cuda)  # (state, device)


def _train_together(students: list[_Student], seed: int) -> None:
    """Step `students` (candidates on the same samples, batch size and epochs) on the same shuffled
    batches, one batch at a time, each candidate's step after the other's: the teacher's logits
    of a batch are computed once for all of them, where training one candidate after the other
    repeated the teacher's forward pass for each (half of a step on the demo, issue 22). A
    candidate that stops early drops out; the others go on."""
    first = students[0]
    generator = torch.Generator().manual_seed(seed)  # one order for all, as each drew it alone
    for epoch in range(first.cfg.epochs):
        order = torch.randperm(len(first.data), generator=generator)
        for start in range(0, len(first.data), first.cfg.batch_size):
            active = [s for s in students if not s.stopped_early]
            if not active:
                return
            idx = order[start : start + first.cfg.batch_size]
            ids, lengths = first.data.collate([first.data[i] for i in idx])  # padded to this batch's longest
            shared: dict = {}
            for s in active:
                s.step(epoch, idx, ids, lengths, shared)


def lockstep_key(cfg: DistillConfig) -> tuple:
    """Candidates with equal keys see the same batches in the same order, and are stepped
    together (`dpdistill plan` counts their teacher forward once)."""
    return cfg.num_synthetic, cfg.batch_size, cfg.epochs


def _private_scorer(cfg: DistillConfig, setup: _Setup, candidates: int,
                    spec: private_selection.PrivateValidation | None) -> private_selection.Scorer | None:
    """select_by=private_validation with candidates to choose from: the validation units and the
    calibrated release, set up before any training (an impossible ε fails now, not after hours)."""
    if cfg.select_by != "private_validation" or candidates < 2:
        return None
    if spec is None:
        raise DistillError("distill.select_by=private_validation needs the private validation split: pass "
                           "distill(private_validation=...) (the flow does), or use distill.select_by=teacher_kl")
    try:
        return private_selection.setup(spec, setup.tok, candidates=candidates, epsilon=cfg.selection_epsilon,
                                       clip=cfg.selection_clip, limit=cfg.selection_records)
    except MonitorError as e:
        raise DistillError(str(e)) from e


def _select(cfg: DistillConfig, setup: _Setup, logs: dict[str, dict], ckpts: dict[str, Path], *,
            settings: dict[str, DistillConfig], teacher_dir: Path, synthetic_path: Path, seed: int, runtime: Runtime,
            scorer: private_selection.Scorer | None) -> dict:
    """Score every candidate's student on texts the DP teacher samples without truncation (and,
    with `scorer`, release their noisy private scores) and choose one by
    `cfg.select_by` (pipeline/stages/selection.py). `settings`: each candidate's, as trained."""
    teacher = setup.teacher
    if teacher is None:  # logits came from the top-k cache: load the teacher for the criterion
        teacher = load_causal_lm(str(teacher_dir), dtype=runtime.dtype).eval().to(runtime.device)
    max_length = min(setup.max_len, _generated_max_length(synthetic_path))
    t0 = time.time()
    selection = selection_set(teacher, setup.tok, synthetic_path, cfg.selection_samples, max_length, seed)
    students = {name: load_causal_lm(str(path), dtype=runtime.dtype).to(runtime.device) for name, path in ckpts.items()}
    scores = score_students(teacher, students, selection, len(setup.tok), cfg.batch_size, runtime.autocast)
    if scorer is not None:  # the only private read of this stage: noisy scores leave it, nothing else
        for name, value in scorer.release(students, cfg.batch_size, runtime.autocast).items():
            scores[name]["private_validation"] = value
    rows = [{"candidate": name, "settings": cfg.candidates[i],
             "alpha": settings[name].alpha, "temperature": settings[name].temperature, "beta": settings[name].beta,
             "kl_skip_tokens": settings[name].kl_skip_tokens, "epochs": settings[name].epochs,
             "train_samples": logs[name]["train_samples"], "steps": logs[name]["steps"],
             "synthetic_validation_ce": logs[name]["best_validation_loss"], **scores[name]}
            for i, name in enumerate(ckpts)]
    chosen = choose(rows, cfg.select_by)
    log_selection(rows, chosen, cfg.select_by)
    out = {"select_by": cfg.select_by, "chosen": chosen, "selection_samples": len(selection),
           "selection_tokens": int(sum(len(s) - 1 for s in selection.sequences)),
           "seconds": time.time() - t0, "candidates": rows}
    if scorer is not None:
        out["private_validation"] = {"units": scorer.n, "splits": scorer.splits, "clip": scorer.clip,
                                     "noise_multiplier": scorer.z,
                                     "noise_sd": scorer.z * scorer.clip / scorer.n, "epsilon": scorer.entry.epsilon,
                                     "delta": scorer.entry.delta}
    return out


def _generated_max_length(synthetic_path: Path) -> int:
    """generate.max_length of the synthetic data (the selection texts are capped alike)."""
    meta = pq.read_schema(synthetic_files(synthetic_path)[0]).metadata or {}
    return json.loads(meta.get(b"dpdistill.generate_config", b"{}")).get("max_length", 10**9)


def distill(
    cfg: DistillConfig,
    *,
    synthetic_path: Path,
    teacher_dir: Path,
    student_model: str,
    out_dir: Path,
    seed: int,
    on_progress: Callable[[dict], None] | None = None,
    teacher_cache_dir: Path | None = None,
    progress_every: float = DEFAULT_EVERY,
    runtime: Runtime = CPU_FP32,
    private_validation: private_selection.PrivateValidation | None = None,
    code_values: dict[str, dict[str, str]] | None = None,
) -> DistillResult:
    """Train `student_model` on the synthetic data against the teacher; the best student is saved.

    With two or more `cfg.candidates`, one student per candidate, and the one the selection
    criterion prefers is saved (`out_dir/model`); `selection.json` and the result's `selection`
    hold every candidate's figures. With `cfg.teacher_top_k` set, teacher logits come from a
    top-k cache in `teacher_cache_dir` (default `<synthetic dir>/teacher_topk_k<k>/`), built or
    reused. Progress lines (steps, steps/s, synthetic tokens/s, loss, ETA) come after the first
    step, then at least every `progress_every` seconds; the cache build logs its own.

    `runtime`: device and precision. The student keeps fp32 master weights and its forward
    runs under autocast; the frozen teacher is loaded in the run's precision; losses in fp32.

    `private_validation`: the private splits to score and the run's δ, read only with
    select_by=private_validation (the result's `selection_ledger` is then the release's entry).
    """
    runtime.apply_threads()
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    # Built and validated once, here; every candidate's training and the selection read these.
    candidates = cfg.candidate_configs() if len(cfg.candidates) > 1 else [("", _single(cfg))]
    setup = _setup(cfg, synthetic_path=synthetic_path, teacher_dir=teacher_dir, student_model=student_model,
                   out_dir=out_dir, teacher_cache_dir=teacher_cache_dir, progress_every=progress_every,
                   runtime=runtime)
    if setup.cache is not None:
        log.info("distillation: teacher top-%d logits from %s", setup.cache.k, setup.cache.path)
    try:
        setup = _kept(cfg, setup, synthetic_path=synthetic_path, teacher_dir=teacher_dir, out_dir=out_dir,
                      code_values=code_values, runtime=runtime, progress_every=progress_every)
        scorer = _private_scorer(cfg, setup, len(candidates), private_validation)
        totals = {name: _n_steps(c, len(_train_rows(c, setup, synthetic_path))) for name, c in candidates}
        progress = _Progress(sum(totals.values()), on_progress, progress_every)
        ckpts = {name: (out_dir / "candidates" / name / "model" if name else out_dir / "model") for name, _ in candidates}
        groups: dict[tuple, list[tuple[str, DistillConfig]]] = {}
        for name, c in candidates:
            groups.setdefault(lockstep_key(c), []).append((name, c))
        logs = {}
        for group in groups.values():
            students = [_Student(c, setup, name=name, student_model=student_model, synthetic_path=synthetic_path,
                                 ckpt=ckpts[name], seed=seed, runtime=runtime, progress=progress) for name, c in group]
            _train_together(students, seed)
            logs |= {s.name: s.result() for s in students}
            del students  # their weights are saved; the next group's students take the memory
        logs = {name: logs[name] for name, _ in candidates}
        selection = None
        if len(candidates) > 1:
            selection = _select(cfg, setup, logs, ckpts, settings=dict(candidates), teacher_dir=teacher_dir,
                                synthetic_path=synthetic_path, seed=seed, runtime=runtime, scorer=scorer)
    finally:
        shutil.rmtree(setup.scratch, ignore_errors=True)
    return _save(cfg, out_dir, logs, ckpts, selection, setup, synthetic_path=synthetic_path,
                 teacher_dir=teacher_dir, student_model=student_model,
                 selection_ledger=scorer.entry if scorer is not None else None)


def _single(cfg: DistillConfig) -> DistillConfig:
    """The one setting trained: the lone candidate's, or this section's without candidates."""
    return cfg.candidate_configs()[0][1] if cfg.candidates else cfg


class _Progress:
    """Steps over all candidates as one count: the progress lines and `on_progress` records."""

    def __init__(self, total: int, on_progress: Callable[[dict], None] | None, every: float):
        self.total, self.on_progress, self.done, self.tokens = total, on_progress, 0, 0
        self.lines = ProgressLog(log, "distillation", "steps", total, every=every)

    def __call__(self, record: dict) -> None:
        self.done += 1
        self.tokens += record.pop("tokens")
        values = {"loss": f"{record['loss']:.4f}"} | ({"candidate": record["candidate"]} if record["candidate"] else {})
        self.lines.update(self.done, counts={"tokens": self.tokens}, values=values)
        if self.on_progress:
            self.on_progress({**record, "done": self.done, "total": self.total})


def _save(cfg: DistillConfig, out_dir: Path, logs: dict[str, dict], ckpts: dict[str, Path], selection: dict | None,
          setup: _Setup, *, synthetic_path: Path, teacher_dir: Path, student_model: str,
          selection_ledger: LedgerEntry | None) -> DistillResult:
    """The chosen student to out_dir/model, the training log and the selection, manifest last."""
    ckpt = out_dir / "model"
    chosen = selection["chosen"] if selection else next(iter(ckpts))
    kept = None
    if selection:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(ckpts[chosen], ckpt)
        if cfg.keep_candidates:
            kept = dict(ckpts)
        else:
            shutil.rmtree(out_dir / "candidates", ignore_errors=True)
        atomic_write_json(out_dir / "selection.json", selection)
    run = logs[chosen]
    kept_samples = out_dir / KEPT_SAMPLES if cfg.keep_samples != "all" else None  # written by _kept
    atomic_write_json(out_dir / "training_log.json", {
        "history": run["history"], "validation": run["validation"], "stopped_early": run["stopped_early"],
        "seconds": sum(r["seconds"] for r in logs.values()), "chosen": chosen or None,
        "candidates": {name: r for name, r in logs.items()} if selection else None,
    })
    seconds = sum(r["seconds"] for r in logs.values()) + (selection["seconds"] if selection else 0.0)
    cache = setup.cache
    write_manifest(
        out_dir,
        stage="distillation",
        inputs={"synthetic": Path(synthetic_path), "teacher": Path(teacher_dir)},
        outputs={"model": ckpt} | ({"selection": out_dir / "selection.json"} if selection else {})
        | ({"kept_samples": kept_samples} if kept_samples else {}),
        extra={"student_model": student_model, "steps": sum(r["steps"] for r in logs.values()), "seconds": seconds,
               "best_validation_loss": run["best_validation_loss"], "teacher_top_k": cfg.teacher_top_k,
               "teacher_cache": str(cache.path) if cache else None,
               "teacher_cache_fingerprint": cache.fingerprint if cache else None,
               "teacher_cache_reused": cache.reused if cache else None,
               "train_samples": run["train_samples"], "available_samples": setup.available,
               "chosen": chosen or None,
               "selection_ledger": selection_ledger.model_dump(mode="json") if selection_ledger else None},
    )
    return DistillResult(checkpoint=ckpt, train_loss=[h["loss"] for h in run["history"]], seconds=seconds,
                         teacher_cache=cache.path if cache else None, train_samples=run["train_samples"],
                         available_samples=setup.available, selection=selection, candidates=kept,
                         selection_ledger=selection_ledger, kept_samples=kept_samples)
