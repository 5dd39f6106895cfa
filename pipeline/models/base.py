"""Base models: build tiny GPT-2-style models offline from public text, and load checkpoints.

`builtin:teacher` / `builtin:student` in a config name two small GPT-2s and their
byte-level BPE tokenizer, pretrained on *public* text only:
- with no `base_models.corpus` (the default), the pair shipped in `pipeline/models/builtin/`
  (fp16 safetensors, pretrained on public-domain novels, see its README.md), copied into
  the cache with a manifest on first use;
- with `base_models.corpus` (a text file, or a directory of `*.txt` documents of which a
  few are held out as a public validation split), built here and cached by a hash of
  their config and the corpus.
`cache:NAME` names a real model fetched or built into the local model cache
(`dpdistill models fetch|student`, pipeline/models/cache.py). Anything else is handed to
`from_pretrained`: a local directory, or a hub name when the user has a hub cache. Never
train the tokenizer on private data: its vocabulary alone would leak rare words of the
private records (Ponomareva et al. 2023).

Build them on their own with `dpdistill build-base --config configs/builtin.yaml`, and
rebuild the shipped pair with `... --export pipeline/models/builtin`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from collections.abc import Iterable
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
from transformers.activations import GELUTanh, NewGELUActivation

from pipeline.config import BaseModelsConfig, TinyModelSpec
from pipeline.locks import file_lock
from pipeline.models.cache import CACHE_PREFIX, cached_model_dir, resolve_cache_name
from pipeline.manifest import MANIFEST, atomic_write_json, hash_paths, sha256_file, write_manifest
from pipeline.models.pretrain import VALIDATION_TOKENS, encode_paragraphs, train_on_blocks, validation_perplexity
from pipeline.privacy.dp_vocabulary import dp_word_counts, weighted_words
from pipeline.privacy.ledger import LedgerEntry

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
EOS = "<|endoftext|>"
SHIPPED = Path(__file__).parent / "builtin"  # the pretrained pair that ships with the package
BUILD_INFO = "build.json"  # how a pair was built, and its figures (tokens seen, validation perplexity)


class ModelError(ValueError):
    """A model or tokenizer cannot be used as configured; the message says how to fix it."""


@dataclass(frozen=True)
class BaseModels:
    teacher: Path
    student: Path
    ledger: LedgerEntry | None = None
    """base_models.tokenizer=dp: the DP release of the word histogram the vocabulary was learned from."""

    def releases(self) -> dict[str, LedgerEntry]:
        return {"": self.ledger} if self.ledger else {}


@dataclass(frozen=True)
class PrivateVocabulary:
    """What base_models.tokenizer=dp reads and how it is accounted: the private training split,
    the run's δ and accountant, and the run directory's folder the pair is built in (not the
    shared cache: it depends on the private split)."""
    train: Path
    delta: float
    accountant: str
    secure_mode: bool
    out: Path


def _clean_wikitext(text: str) -> str:
    """Undo WikiText's tokenisation artefacts (' @-@ ', ' , ') so the text reads like prose."""
    text = text.replace(" <unk>", "").replace("<unk>", "")
    text = re.sub(r" @(.)@ ", r"\1", text)
    text = re.sub(r" ([.,;:!?)\]'])", r"\1", text)
    text = re.sub(r"([(\[]) ", r"\1", text)
    text = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)
    return text


def _documents(corpus: Path, field: str = "base_models.corpus",
               fallback: str = " (or remove it to use the shipped builtin models)") -> list[Path]:
    if corpus.is_dir():
        docs = sorted(corpus.glob("*.txt"))
        if not docs:
            raise ModelError(
                f"{field} {str(corpus)!r} holds no *.txt files; point it at a public "
                "plain-text file or a directory of them"
            )
        return docs
    if not corpus.is_file():
        raise ModelError(
            f"{field} {str(corpus)!r} not found; point it at a public plain-text file or "
            f"a directory of *.txt files{fallback}"
        )
    return [corpus]


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, each joined into one line; WikiText's headings are dropped
    and its tokenisation undone (detected by its ' @-@ ' and '<unk>' marks)."""
    wikitext = " @-@ " in text or "<unk>" in text
    paras = []
    for block in re.split(r"\n\s*\n", text):
        p = " ".join(line.strip() for line in block.splitlines()).strip()
        if wikitext:
            if p.startswith("="):
                continue
            p = _clean_wikitext(p)
        if p:
            paras.append(p)
    return paras


def held_out_documents(docs: list[Path], k: int) -> list[Path]:
    """`k` documents spread evenly over the sorted list (never all of them): the public
    validation split. A single-file corpus has none."""
    k = min(k, len(docs) - 1)
    return [docs[int((i + 0.5) * len(docs) / k)] for i in range(k)] if k > 0 else []


def public_corpus(cfg: BaseModelsConfig) -> tuple[list[str], list[str]]:
    """(training, validation) paragraphs of the public corpus; `max_corpus_chars` caps the
    training text."""
    docs = _documents(Path(cfg.corpus))
    held = set(held_out_documents(docs, cfg.validation_documents))
    train, valid = [], []
    for doc in docs:
        (valid if doc in held else train).extend(_paragraphs(doc.read_text(encoding="utf-8")))
    if cfg.max_corpus_chars:
        kept, total = [], 0
        for p in train:
            if total >= cfg.max_corpus_chars:
                break
            kept.append(p[: cfg.max_corpus_chars - total])
            total += len(kept[-1])
        train = kept
    return train, valid


def corpus_paragraphs(corpus: Path, field: str) -> list[str]:
    """Every paragraph of a public text file, or of a directory's *.txt documents in name order,
    as `public_corpus` reads them; `field` names the setting in an error."""
    return [p for doc in _documents(Path(corpus), field, "") for p in _paragraphs(doc.read_text(encoding="utf-8"))]


def read_public_corpus(cfg: BaseModelsConfig) -> list[str]:
    """Training paragraphs of the public corpus (without its held-out documents)."""
    return public_corpus(cfg)[0]


def _cache_key(cfg: BaseModelsConfig) -> str:
    if cfg.corpus is None:  # the shipped pair: keyed by its files
        digests = sorted((n, d["sha256"]) for n, d in hash_paths({"shipped": SHIPPED}).items())
        return "shipped-" + hashlib.sha256(json.dumps(digests).encode()).hexdigest()[:16]
    spec = {k: v for k, v in cfg.cache_fields().items() if k != "corpus"}
    spec["corpus_sha256"] = {d.name: sha256_file(d) for d in _documents(Path(cfg.corpus))}
    spec["format"] = 3  # bump when the build procedure changes
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def train_tokenizer(texts: Iterable[str | list[str]], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE learned from `texts` (paragraphs, or batches of them: the DP tokenizer's
    weighted words, pipeline/privacy/dp_vocabulary.py)."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS)


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
    return fused_gelu(GPT2LMHeadModel(config))


def fused_gelu(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with each GPT-2 `gelu_new` activation (tanh-approximated GELU written as five
    elementwise ops, each a pass over the MLP's activations and, in training, a saved tensor)
    computed by torch's one fused kernel of the same formula (`gelu(x, approximate="tanh")`,
    transformers' `GELUTanh`): the same function up to float rounding (≤ 1.2e-7 apart in fp32).
    A small gain: gelu_new's step over the fused one's 1.00-1.09x per stage on the demo's shapes
    (bench/kernel_choices.py, 1 and 2 threads). Modules only: the config, and so a saved
    checkpoint, still says `gelu_new`."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is NewGELUActivation:
                setattr(parent, name, GELUTanh())
    return model


def _pretrain(model: GPT2LMHeadModel, blocks: torch.Tensor, spec: TinyModelSpec, name: str) -> dict:
    """Plain (non-private) next-token pretraining on public text; returns its figures."""
    return train_on_blocks(model, blocks, steps=spec.steps, batch_size=spec.batch_size,
                           learning_rate=spec.learning_rate, name=f"base {name}")


def base_models_built(cfg: BaseModelsConfig) -> bool:
    """Whether build_base_models would reuse its cache (`dpdistill plan` asks, building nothing)."""
    return (cfg.cache_dir / _cache_key(cfg) / MANIFEST).is_file()


def build_base_models(cfg: BaseModelsConfig, seed: int = 0, private: PrivateVocabulary | None = None) -> BaseModels:
    """Build (or reuse from the cache) the tokenizer and the tiny teacher and student; with no
    corpus, install the shipped pair into the cache. base_models.tokenizer=dp builds in
    `private.out`, its vocabulary a DP release of `private.train`'s words."""
    if cfg.tokenizer == "dp":
        if private is None:
            raise ModelError("base_models.tokenizer=dp learns the vocabulary from the private training split, "
                             "which only `dpdistill run` reads (and accounts); build this pair through a run, or "
                             "set base_models.tokenizer=public")
        return _build_dp_pair(cfg, seed, private)
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
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if cfg.corpus is None:
        if not (SHIPPED / BUILD_INFO).is_file():
            raise ModelError(
                f"the shipped builtin models are missing from {SHIPPED}; reinstall the package, or "
                "set base_models.corpus to build them from public text"
            )
        shutil.copytree(SHIPPED, tmp)
        info = json.loads((tmp / BUILD_INFO).read_text())
        inputs = {"shipped": SHIPPED}
    else:
        info = _pretrain_pair(cfg, seed, tmp)
        inputs = {"corpus": Path(cfg.corpus)}
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    write_manifest(out, stage="base_models", inputs=inputs,
                   outputs={"teacher": result.teacher, "student": result.student}, extra=info)
    return result


RELEASE = "release.json"  # the DP tokenizer's ledger entry, beside the tokenizer it made


def _build_dp_pair(cfg: BaseModelsConfig, seed: int, private: PrivateVocabulary) -> BaseModels:
    """The pair with a DP vocabulary, in `private.out`. The tokenizer is saved with its ledger
    entry before pretraining: a run stopped during pretraining reuses that release when it
    continues rather than making (and publishing part of) a second one."""
    out = Path(private.out)
    result = BaseModels(teacher=out / "teacher", student=out / "student")
    made = out / "tokenizer"
    if (out / MANIFEST).is_file():
        return BaseModels(teacher=result.teacher, student=result.student, ledger=_release(made)[0])
    if not (made / RELEASE).is_file():
        t0 = time.monotonic()
        words, entry = dp_word_counts(private.train, epsilon=cfg.tokenizer_epsilon, max_words=cfg.tokenizer_max_words,
                                      delta=private.delta, accountant=private.accountant,
                                      secure_mode=private.secure_mode)
        tok = train_tokenizer(weighted_words(words), cfg.vocab_size)
        tmp = made.with_name("tokenizer.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / RELEASE, entry.model_dump(mode="json") | {"seconds": round(time.monotonic() - t0, 1)})
        tmp.rename(made)
    entry, seconds = _release(made)
    tok = AutoTokenizer.from_pretrained(made)
    info = _pretrain_pair(cfg, seed, out, tok)
    info["tokenizer"] = {"kind": "dp", "vocabulary": len(tok), "seconds": seconds}
    write_manifest(out, stage="base_models", inputs={"corpus": Path(cfg.corpus)},  # not the split's hash
                   outputs={"teacher": result.teacher, "student": result.student, "tokenizer": made},
                   extra=info | {"ledger": entry.model_dump(mode="json")})
    return BaseModels(teacher=result.teacher, student=result.student, ledger=entry)


def _release(made: Path) -> tuple[LedgerEntry, float]:
    """The DP tokenizer's ledger entry and the seconds it took, as saved beside it."""
    release = json.loads((made / RELEASE).read_text())
    return LedgerEntry.model_validate({k: v for k, v in release.items() if k != "seconds"}), release["seconds"]


def _pretrain_pair(cfg: BaseModelsConfig, seed: int, dest: Path, tok=None) -> dict:
    """Train the tokenizer (unless given one) and both models on the public corpus into `dest`;
    their figures."""
    torch.manual_seed(seed)
    t0 = time.monotonic()
    train, valid = public_corpus(cfg)
    tok = tok if tok is not None else train_tokenizer(train, cfg.vocab_size)
    ids, valid_ids = encode_paragraphs(tok, train), encode_paragraphs(tok, valid)
    n_blocks = len(ids) // cfg.context_length
    if n_blocks < 1:
        raise ModelError(
            f"base_models.corpus {str(cfg.corpus)!r} holds {len(ids)} tokens, fewer than one "
            f"context of {cfg.context_length}; use a larger public corpus"
        )
    blocks = torch.tensor(ids[: n_blocks * cfg.context_length]).view(n_blocks, cfg.context_length)
    docs = _documents(Path(cfg.corpus))
    held = held_out_documents(docs, cfg.validation_documents)
    log.info("base models: tokenizer of %d tokens (%.0f s), %d public training tokens, %d validation "
             "tokens from %d held-out documents", len(tok), time.monotonic() - t0, len(ids),
             len(valid_ids), len(held))
    info = {
        "corpus": {
            "path": str(cfg.corpus), "documents": len(docs), "training_tokens": len(ids),
            "validation_documents": [d.name for d in held], "validation_tokens": min(len(valid_ids), VALIDATION_TOKENS),
        },
        "config": cfg.model_dump(mode="json", exclude={"cache_dir"}),
        "seed": seed,
        "tokenizer_seconds": round(time.monotonic() - t0, 1),
        "models": {},
    }
    for name, spec in (("teacher", cfg.teacher), ("student", cfg.student)):
        model = tiny_gpt2(spec, len(tok), cfg.context_length, tok.eos_token_id)
        figures = _pretrain(model, blocks, spec, name)
        figures["validation_perplexity"] = validation_perplexity(model, valid_ids, cfg.context_length, tok.eos_token_id)
        log.info("base %s: %s", name, figures)
        info["models"][name] = figures
        model.save_pretrained(dest / name)
        tok.save_pretrained(dest / name)
    info["seconds"] = round(time.monotonic() - t0, 1)
    atomic_write_json(dest / BUILD_INFO, info)
    return info


def export_base_models(base: BaseModels, dest: Path) -> Path:
    """Write a built pair to `dest` as the shipped pair is stored: fp16 safetensors, the
    tokenizer, build.json (how it was built and its figures) and the attribution README."""
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name in ("teacher", "student"):
        src = Path(getattr(base, name))
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16)
        model.save_pretrained(tmp / name)  # safetensors
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp / name)
    info = json.loads((Path(base.teacher).parent / MANIFEST).read_text())
    info = {k: v for k, v in info.items() if k not in ("stage", "finished_at", "inputs", "outputs")}
    info["weights"] = "float16"
    atomic_write_json(tmp / BUILD_INFO, info)
    if (dest / "README.md").is_file():
        shutil.copy(dest / "README.md", tmp / "README.md")  # the attribution and what they can do
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def shipped_path(name: str) -> str:
    """`builtin:teacher|student` as the shipped pair's directory (the pair used when no
    `base_models.corpus` is set), `cache:NAME` as its directory in the model cache
    (pipeline/models/cache.py); any other name unchanged."""
    if name.startswith(CACHE_PREFIX):
        return str(cached_model_dir(name[len(CACHE_PREFIX):]))
    return str(SHIPPED / name[len(BUILTIN_PREFIX):]) if name.startswith(BUILTIN_PREFIX) else name


def resolve_model(name: str, base: BaseModels | None) -> str:
    """Map `builtin:teacher|student` to its built directory and `cache:NAME` to its directory in
    the model cache (refused, saying which command makes it, when it is not there); pass
    anything else through."""
    if name.startswith(CACHE_PREFIX):
        try:
            return str(resolve_cache_name(name))
        except ValueError as e:
            raise ModelError(str(e)) from e
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
        model = fused_gelu(AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype))
    except OSError as e:
        raise ModelError(
            f"cannot load a causal LM from {name_or_path!r}: not a local directory and not in "
            "the hub cache; build the offline models (builtin:...) or name a local checkpoint"
        ) from e
    return model


def causal_lm_from_config(name_or_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A causal LM of `name_or_path`'s shape with random weights in `dtype` (no weights read).

    The dtype is always passed: `from_config` otherwise takes the config's own `dtype`, and the
    shipped pair's says float16 (how its weights are stored). An fp16 model on a CPU ran each
    step ~20x slower than the fp32 a run trains in, and `dpdistill plan` timed that (issue 22)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except OSError as e:
        raise ModelError(
            f"cannot read a model config from {name_or_path!r}: not a local directory and not in "
            "the hub cache; build the offline models (builtin:...) or name a local checkpoint"
        ) from e
    return fused_gelu(AutoModelForCausalLM.from_config(config, dtype=dtype))


def head_is_tied(model: torch.nn.Module) -> bool:
    """Whether the model's output head and input embedding are one weight."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def untie_lm_head(model: torch.nn.Module) -> int:
    """Give `lm_head` its own weight; returns the parameters that adds (0 when it had its own).

    DP-SGD clips each example's whole gradient, and a weight shared by the input embedding and
    the head has one gradient from two uses: bk and ghost clipping compute a norm per use and
    would miss the cross term (Opacus refuses it). Every family that ties them (GPT-2, Llama
    3.2, Qwen2.5, SmolLM2, Gemma) trains and saves an untied head: vocabulary × width more
    parameters (28.3 M on SmolLM2-135M), said in the log, the plan and the model card."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    added = 0
    if head_is_tied(model):
        head.weight = torch.nn.Parameter(emb.weight.detach().clone())
        added = head.weight.numel()
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):  # composite configs keep the flag on the text part
        model.config.get_text_config().tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None
    return added


def model_positions(config, unlimited: int | None = None) -> int:
    """The longest sequence a model of `config` takes: GPT-2's n_positions, the other families'
    max_position_embeddings (of the text part of a composite config). A config that names
    neither (positions from ALiBi, say) gives `unlimited`, or a ModelError when none is given."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "n_positions", None) or getattr(text, "max_position_embeddings", None) or unlimited
    if positions is None:
        raise ModelError(f"the {getattr(config, 'model_type', type(config).__name__)!r} config names no position "
                         "limit (n_positions or max_position_embeddings)")
    return positions


def tied_head_parameters(config) -> int:
    """What `untie_lm_head` will add to a model of `config`, read from the config alone."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.vocab_size * text.hidden_size if getattr(text, "tie_word_embeddings", False) else 0


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id
