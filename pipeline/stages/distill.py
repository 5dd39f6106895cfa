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
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.batching import lm_batch
from pipeline.models.scoring import mean_token_nll
from pipeline.config import DistillConfig
from pipeline.devices import CPU_FP32, Runtime
from pipeline.stages.generate import synthetic_ids
from pipeline.stages.logit_cache import CachedTopK, build_teacher_cache
from pipeline.models.losses import distillation_loss, prompt_mask
from pipeline.manifest import atomic_write_json, write_manifest
from pipeline.models.base import load_causal_lm, load_tokenizer, same_tokenizer
from pipeline.progress import DEFAULT_EVERY, ProgressLog
from pipeline.tokenized import TokenIds

log = logging.getLogger(__name__)


SCRATCH = ".synthetic_ids"  # out_dir's memory-mapped copy of the synthetic ids, while the stage runs


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


def _n_positions(model) -> int:
    return getattr(model.config, "n_positions", None) or model.config.max_position_embeddings


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
) -> DistillResult:
    """Train `student_model` on the synthetic data against the teacher; the best student is saved.

    With `cfg.teacher_top_k` set, teacher logits come from a top-k cache in
    `teacher_cache_dir` (default `<synthetic dir>/teacher_topk_k<k>/`), built or reused.
    Progress lines (steps, steps/s, synthetic tokens/s, loss, ETA) come after the first step,
    then at least every `progress_every` seconds; the cache build logs its own.

    `runtime`: device and precision. The student keeps fp32 master weights and its forward
    runs under autocast; the frozen teacher is loaded in the run's precision; losses in fp32.
    """
    runtime.apply_threads()
    device = runtime.device
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    teacher_tok, student_tok = load_tokenizer(str(teacher_dir)), load_tokenizer(student_model)
    if not same_tokenizer(teacher_tok, student_tok):
        raise DistillError(
            f"the student {student_model!r} and the teacher use different tokenizers; the KL needs "
            "one vocabulary: pick a student of the teacher's family (e.g. gpt2 teacher, distilgpt2 student)"
        )
    teacher = cache = None
    if cfg.teacher_top_k is None:
        teacher = load_causal_lm(str(teacher_dir), dtype=runtime.dtype).eval().to(device)
        teacher_positions = _n_positions(teacher)
    elif cfg.beta > 0:
        raise DistillError(f"distill.beta={cfg.beta} needs teacher hidden states, which the top-k cache "
                           "does not hold; set distill.beta=0 or distill.teacher_top_k=null")
    else:
        cache = build_teacher_cache(Path(teacher_dir), Path(synthetic_path), k=cfg.teacher_top_k,
                                    cache_dir=teacher_cache_dir, batch_size=cfg.batch_size,
                                    progress_every=progress_every, runtime=runtime)
        teacher_positions = cache.max_length
    student = load_causal_lm(student_model).to(device)  # fp32 master weights
    vocab = len(student_tok)
    # β > 0 with different widths: a learned linear map from the student's hidden size to
    # the teacher's (FitNets-style); it trains with the student and is not saved with it.
    h_s = student.config.hidden_size
    h_t = teacher.config.hidden_size if teacher is not None else h_s
    projection = torch.nn.Linear(h_s, h_t, device=device) if cfg.beta > 0 and h_s != h_t else None

    max_len = min(_n_positions(student), teacher_positions)
    # The shards' ids copied, a batch at a time, into memory-mapped Arrow files: random access
    # for shuffled epochs without the synthetic set in memory. Public; removed at the end.
    scratch = out_dir / SCRATCH
    train_table = synthetic_ids(synthetic_path, "train", scratch / "train.arrow").data.table
    val_table = synthetic_ids(synthetic_path, "validation", scratch / "validation.arrow").data.table
    if train_table.num_rows == 0:
        raise DistillError(f"synthetic data {str(synthetic_path)!r} has no train samples; generate samples first")
    available = train_table.num_rows
    if cfg.num_synthetic is not None:
        if cfg.num_synthetic > available:
            shutil.rmtree(scratch, ignore_errors=True)
            raise DistillError(
                f"distill.num_synthetic={cfg.num_synthetic} exceeds the {available} synthetic train samples in "
                f"{str(synthetic_path)!r} (generation keeps fewer than generate.num_samples: the validation "
                f"split and empty samples); set distill.num_synthetic to at most {available} or raise "
                "generate.num_samples"
            )
        # The first n in the shards' order (sample_id order): each size is a prefix of the next.
        train_table = train_table.slice(0, cfg.num_synthetic)
    log.info("distillation: training on %d of the %d synthetic train samples%s", train_table.num_rows, available,
             "" if cfg.num_synthetic is None else " (distill.num_synthetic)")
    data = TokenIds(train_table["token_ids"], max_len, student_tok.pad_token_id)
    prompt_lengths = torch.from_numpy(train_table["n_prompt_tokens"].to_numpy().astype("int64"))  # (N,)
    validation = TokenIds(val_table["token_ids"], max_len, student_tok.pad_token_id)
    if len(validation) == 0:  # generate.validation_fraction=0, or shards of a single kept sample
        log.warning(
            "distillation: the synthetic data has no validation samples, so the student is never evaluated "
            "during training and the last one is kept (no early stopping); raise generate.num_samples or "
            "generate.validation_fraction"
        )
    cached = CachedTopK(cache, train_table["sample_id"].to_pylist()) if cache is not None else None
    if cached is not None:
        log.info("distillation: teacher top-%d logits of %d train samples from %s (%.1f MB in memory)",
                 cache.k, len(data), cache.path, cached.nbytes() / 2**20)

    params = list(student.parameters()) + (list(projection.parameters()) if projection else [])
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(data) / cfg.batch_size)
    total = cfg.epochs * steps_per_epoch
    warmup = max(1, int(cfg.warmup_fraction * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, (total - s) / max(1, total - warmup))
    )
    generator = torch.Generator().manual_seed(seed)
    want_hidden = cfg.beta > 0
    ckpt = out_dir / "model"
    history: list[dict] = []
    evals: list[dict] = []
    best, since_best = float("inf"), 0

    def evaluate_and_keep_best(step: int) -> bool:
        """Validation CE; saves the student when it improves. Returns True to stop early."""
        nonlocal best, since_best
        if len(validation) == 0:
            return False
        with runtime.autocast():  # mean_token_nll upcasts the logits
            loss = mean_token_nll(student, validation, cfg.batch_size)
        student.train()
        evals.append({"step": step, "validation_loss": loss})
        if loss < best:
            best, since_best = loss, 0
            student.save_pretrained(ckpt)
            student_tok.save_pretrained(ckpt)
        else:
            since_best += 1
        log.info("distillation: step %d validation loss %.4f (best %.4f)", step, loss, best)
        return cfg.patience is not None and since_best >= cfg.patience

    t0, step, stopped_early = time.time(), 0, False
    steps_log, tokens = ProgressLog(log, "distillation", "steps", total, every=progress_every), 0
    student.train()
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(data), generator=generator)
        for start in range(0, len(data), cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            ids, lengths = data.collate([data[i] for i in idx])  # padded to this batch's longest
            batch = {k: v.to(device) for k, v in lm_batch(ids, lengths).items()}
            labels = batch.pop("labels")  # (B, L-1)
            skip = (
                prompt_lengths[idx] if cfg.kl_skip_tokens is None
                else torch.full((len(idx),), cfg.kl_skip_tokens)
            )
            kl_mask = prompt_mask(labels.shape[1], skip).to(device)  # (B, L-1)
            if cached is not None:
                top = cached.batch(idx, lengths)  # (B, L-1, k)
                teacher_logits, teacher_hidden = type(top)(*(t.to(device) for t in top)), None
            else:
                with torch.no_grad(), runtime.autocast():
                    t_out = teacher(**batch, output_hidden_states=want_hidden)
                teacher_logits = t_out.logits[:, :-1, :vocab].float()  # (B, L-1, V)
                teacher_hidden = t_out.hidden_states[-1][:, :-1].float() if want_hidden else None  # (B, L-1, H_t)
            with runtime.autocast():  # forward only; the losses below run in fp32
                s_out = student(**batch, output_hidden_states=want_hidden)
                s_hidden = s_out.hidden_states[-1][:, :-1] if want_hidden else None  # (B, L-1, H_s)
                if projection is not None:
                    s_hidden = projection(s_hidden)  # (B, L-1, H_t)
            parts = distillation_loss(
                s_out.logits[:, :-1, :vocab].float(),
                teacher_logits,
                labels,
                kl_mask,
                alpha=cfg.alpha,
                temperature=cfg.temperature,
                beta=cfg.beta,
                student_hidden=None if s_hidden is None else s_hidden.float(),
                teacher_hidden=teacher_hidden,
            )
            parts.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            record = {"step": step, "epoch": epoch, **{k: v.detach().item() for k, v in parts._asdict().items()}}
            history.append(record)
            tokens += int(lengths.sum())  # synthetic tokens: public
            steps_log.update(step, counts={"tokens": tokens}, values={"loss": f"{record['loss']:.4f}"})
            if step % cfg.log_every == 0 or step == total:
                log.info(
                    "distillation: step %d/%d loss %.4f (ce %.4f, kl %.4f, mse %.4f) (%.0f s)",
                    step, total, record["loss"], record["ce"], record["kl"], record["mse"], time.time() - t0,
                )
            if on_progress:
                on_progress({**record, "done": step, "total": total})
            if (step % cfg.eval_every == 0 or step == total) and evaluate_and_keep_best(step):
                stopped_early = True
                log.info("distillation: no improvement in %d evaluations, stopping at step %d", cfg.patience, step)
                break
        if stopped_early:
            break
    seconds = time.time() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    if not evals:  # no validation split: the last student is the result
        student.save_pretrained(ckpt)
        student_tok.save_pretrained(ckpt)
    atomic_write_json(
        out_dir / "training_log.json",
        {"history": history, "validation": evals, "stopped_early": stopped_early, "seconds": seconds},
    )
    write_manifest(
        out_dir,
        stage="distillation",
        inputs={"synthetic": Path(synthetic_path), "teacher": Path(teacher_dir)},
        outputs={"model": ckpt},
        extra={"student_model": student_model, "steps": step, "seconds": seconds,
               "best_validation_loss": best if evals else None, "teacher_top_k": cfg.teacher_top_k,
               "teacher_cache": str(cache.path) if cache else None,
               "teacher_cache_fingerprint": cache.fingerprint if cache else None,
               "teacher_cache_reused": cache.reused if cache else None,
               "train_samples": len(data), "available_samples": available},
    )
    return DistillResult(checkpoint=ckpt, train_loss=[h["loss"] for h in history], seconds=seconds,
                         teacher_cache=cache.path if cache else None, train_samples=len(data),
                         available_samples=available)
