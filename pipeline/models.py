"""Base models: build tiny GPT-2-style models offline from public text, and load checkpoints.

`builtin:teacher` / `builtin:student` in a config name models built here from the
*public* corpus in `base_models.corpus` (a byte-level BPE tokenizer plus two small
GPT-2s, pretrained for a few hundred steps), cached by a hash of their config.
Anything else is handed to `from_pretrained`: a local directory, or a hub name when
the user has a hub cache. Never train the tokenizer on private data: its vocabulary
alone would leak rare words of the private records (Ponomareva et al. 2023).

Build them on their own with `dpdistill build-base --config configs/demo.yaml`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

from pipeline.config import BaseModelsConfig, TinyModelSpec
from pipeline.locks import file_lock
from pipeline.manifest import MANIFEST, sha256_file, write_manifest

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
EOS = "<|endoftext|>"


class ModelError(ValueError):
    """A model or tokenizer cannot be used as configured; the message says how to fix it."""


@dataclass(frozen=True)
class BaseModels:
    teacher: Path
    student: Path


def _clean_wikitext(text: str) -> str:
    """Undo WikiText's tokenisation artefacts (' @-@ ', ' , ') so the text reads like prose."""
    text = text.replace(" <unk>", "").replace("<unk>", "")
    text = re.sub(r" @(.)@ ", r"\1", text)
    text = re.sub(r" ([.,;:!?)\]'])", r"\1", text)
    text = re.sub(r"([(\[]) ", r"\1", text)
    text = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)
    return text


def read_public_corpus(cfg: BaseModelsConfig) -> list[str]:
    """Paragraphs of the public corpus (headings and blank lines dropped)."""
    if not cfg.corpus.is_file():
        raise ModelError(
            f"base_models.corpus {str(cfg.corpus)!r} not found; point it at a public plain-text "
            "file (the repository ships data/public/wikitext-2-valid.txt)"
        )
    text = cfg.corpus.read_text(encoding="utf-8")
    if cfg.max_corpus_chars:
        text = text[: cfg.max_corpus_chars]
    paras = [_clean_wikitext(p.strip()) for p in text.splitlines()]
    return [p for p in paras if p and not p.startswith("=")]


def _cache_key(cfg: BaseModelsConfig) -> str:
    spec = cfg.model_dump(mode="json", exclude={"cache_dir", "corpus"})
    spec["corpus_sha256"] = sha256_file(cfg.corpus)
    spec["format"] = 2  # bump when the build procedure changes
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def train_tokenizer(paragraphs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        paragraphs, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS
    )
    return tok


def tiny_gpt2(spec: TinyModelSpec, vocab_size: int, context_length: int, eos_id: int) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=context_length,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return GPT2LMHeadModel(config)


def _pretrain(model: GPT2LMHeadModel, blocks: torch.Tensor, spec: TinyModelSpec, name: str) -> float:
    """Plain (non-private) next-token pretraining on public text; returns the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    warmup = max(1, spec.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup)
        * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, spec.steps)))),
    )
    model.train()
    loss_value, t0 = float("nan"), time.time()
    for step in range(spec.steps):
        idx = torch.randint(0, blocks.shape[0], (spec.batch_size,))
        batch = blocks[idx]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if (step + 1) % 50 == 0 or step + 1 == spec.steps:
            log.info(
                "base %s: step %d/%d loss %.3f (%.1f s)",
                name, step + 1, spec.steps, loss_value, time.time() - t0,
            )
    model.eval()
    return loss_value


def base_models_built(cfg: BaseModelsConfig) -> bool:
    """Whether build_base_models would reuse its cache (`dpdistill plan` asks, building nothing)."""
    return (cfg.cache_dir / _cache_key(cfg) / MANIFEST).is_file()


def build_base_models(cfg: BaseModelsConfig, seed: int = 0) -> BaseModels:
    """Build (or reuse from the cache) the tokenizer and the tiny teacher and student."""
    # Runs with different run_roots can share cache_dir: one builds (through a fixed temp
    # name), the others wait for it and then reuse what it built (pipeline/locks.py).
    with file_lock(Path(cfg.cache_dir) / f".{_cache_key(cfg)}.lock"):
        return _build_base_models(cfg, seed)


def _build_base_models(cfg: BaseModelsConfig, seed: int) -> BaseModels:
    out = cfg.cache_dir / _cache_key(cfg)
    result = BaseModels(teacher=out / "teacher", student=out / "student")
    if (out / MANIFEST).is_file():
        log.info("base models: reusing %s", out)
        return result
    torch.manual_seed(seed)
    paragraphs = read_public_corpus(cfg)
    tok = train_tokenizer(paragraphs, cfg.vocab_size)
    ids: list[int] = []
    for p in paragraphs:
        ids.extend(tok.encode(p, add_special_tokens=False) + [tok.eos_token_id])
    n_blocks = len(ids) // cfg.context_length
    if n_blocks < 1:
        raise ModelError(
            f"base_models.corpus {str(cfg.corpus)!r} holds {len(ids)} tokens, fewer than one "
            f"context of {cfg.context_length}; use a larger public corpus"
        )
    blocks = torch.tensor(ids[: n_blocks * cfg.context_length]).view(n_blocks, cfg.context_length)
    log.info("base models: tokenizer of %d tokens, %d public tokens", len(tok), len(ids))

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    losses = {}
    for name, spec in (("teacher", cfg.teacher), ("student", cfg.student)):
        model = tiny_gpt2(spec, len(tok), cfg.context_length, tok.eos_token_id)
        losses[name] = _pretrain(model, blocks, spec, name)
        model.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    write_manifest(
        out,
        stage="base_models",
        inputs={"corpus": cfg.corpus},
        outputs={"teacher": result.teacher, "student": result.student},
        extra={"final_pretraining_loss": losses, "public_tokens": len(ids)},
    )
    return result


def resolve_model(name: str, base: BaseModels | None) -> str:
    """Map `builtin:teacher|student` to its built directory; pass anything else through."""
    if not name.startswith(BUILTIN_PREFIX):
        return name
    which = name[len(BUILTIN_PREFIX):]
    if which not in ("teacher", "student"):
        raise ModelError(f"unknown builtin model {name!r}; use 'builtin:teacher' or 'builtin:student'")
    if base is None:
        raise ModelError(f"{name!r} needs the base models built first (build_base_models)")
    return str(getattr(base, which))


def load_tokenizer(name_or_path: str):
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except OSError as e:
        raise ModelError(
            f"cannot load a tokenizer from {name_or_path!r}: not a local directory and not in "
            "the hub cache; build the offline models (builtin:...) or name a local checkpoint"
        ) from e
    if tok.eos_token_id is None:
        raise ModelError(f"tokenizer of {name_or_path!r} has no eos token; set one before use")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name_or_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A causal LM with weights in `dtype`: fp32 for training (master weights), the run's
    precision for inference (pipeline/devices.py)."""
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    except OSError as e:
        raise ModelError(
            f"cannot load a causal LM from {name_or_path!r}: not a local directory and not in "
            "the hub cache; build the offline models (builtin:...) or name a local checkpoint"
        ) from e
    return model


def untie_lm_head(model: torch.nn.Module) -> None:
    """Give `lm_head` its own weight. Opacus ghost clipping computes one norm per parameter
    use; a weight shared by the embedding and the head would be counted wrongly, and
    Opacus refuses it (see the developers' guide)."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is emb.weight:
        head.weight = torch.nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id
