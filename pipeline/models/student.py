"""`dpdistill models student TEACHER --layers K`: a small student that shares its teacher's
tokenizer, made from the teacher itself and healed on public text, into the model cache.

    path = build_student("smollm2-135m", layers=4)   # <cache>/smollm2-135m-4l; config: cache:smollm2-135m-4l

Distillation needs a student that speaks the teacher's vocabulary (pipeline/stages/distill.py
checks it), and no hub offers one here. So the student is the teacher cut in depth: K of
its decoder layers, evenly spaced with the first and the last kept (DistilBERT initialises
its student from every other layer of BERT, Sanh et al. 2019; Minitron prunes depth and
retrains by distillation, Sreenivas et al. 2024), the embeddings, final norm and head copied.
Cut out, the layers no longer fit together (a 4-of-30 SmolLM2 scored 2,035 test perplexity
in the preview of issue 36), so the student is *healed*: trained on public text to match the
teacher's next-token distribution, KL(teacher ‖ student) on every token (Minitron's
logit-only distillation), with the loop and held-out perplexity that pretrain the builtin
models (pipeline/models/pretrain.py) and their corpus reading (pipeline/models/base.py). It reads no private data, like
`build-base`; the teacher is the public base model, never a DP one.

The corpus's last `eval_tokens` tokens are held out; its card (README.md) gives the
student's size, its perplexity there before and after healing beside the teacher's, the
build time and the corpus with its sha256.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pipeline.devices import resolve_device
from pipeline.locks import file_lock
from pipeline.manifest import MANIFEST, sha256_file
from pipeline.models.base import ModelError, corpus_paragraphs, load_tokenizer
from pipeline.models.cache import (
    cache_problems, cached_model_dir, finish_cache_entry, how_to_make, model_cache_dir, student_name,
)
from pipeline.models.losses import distillation_loss
from pipeline.models.pretrain import encode_paragraphs, non_embedding_parameters, train_on_blocks, validation_perplexity

log = logging.getLogger(__name__)

# The public text the builder reads when none is named: WikiText-2's validation split, shipped
# in the repository (data/README.md), ~250k SmolLM2 tokens.
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "data" / "public" / "wikitext-2-valid.txt"


@dataclass(frozen=True)
class HealingBudget:
    """How long the student is healed. The default is sized for 30-60 min on 2 CPU cores for a
    4-layer SmolLM2-135M student: a step of 4 x 256 tokens took 7.1 CPU seconds (one thread,
    teacher forward and student forward and backward), so 500 steps are ~3,550 CPU seconds and
    ~0.5 M tokens, about two passes over the default corpus (docs/pipeline.md, "Real models
    offline"). 4 x 256 rather than 8 x 256: 3.8 GB peak memory instead of 5.8 GB, for 10 % more
    CPU per token. The learning rate is a usual AdamW one for a ~40 M model, not tuned here."""

    steps: int = 500
    seq_len: int = 256
    batch_size: int = 4
    learning_rate: float = 3e-4
    eval_tokens: int = 16_384  # held-out public tokens scored before and after

    def __post_init__(self):
        for field in ("steps", "seq_len", "batch_size", "eval_tokens"):
            if getattr(self, field) < (0 if field == "steps" else 2):
                raise ModelError(f"--{field.replace('_', '-')}={getattr(self, field)} is too small")
        if self.learning_rate <= 0:
            raise ModelError(f"--learning-rate={self.learning_rate} must be positive")


def pick_layers(n_layers: int, k: int) -> list[int]:
    """`k` of `n_layers` decoder layers, evenly spaced, the first and the last kept:
    4 of 30 -> [0, 10, 19, 29]."""
    if not 2 <= k < n_layers:
        raise ModelError(f"--layers {k}: keep between 2 and {n_layers - 1} of the teacher's {n_layers} layers")
    return [round(i * (n_layers - 1) / (k - 1)) for i in range(k)]


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The model's stack of decoder layers and its name in the state dict: the ModuleList with
    one entry per layer of the config (model.layers in Llama, transformer.h in GPT-2,
    model.decoder.layers in OPT, ...), found by what it is rather than by class name."""
    n = model.config.num_hidden_layers
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if len(found) != 1:
        raise ModelError(f"cannot find the decoder layers of {type(model).__name__} ({len(found)} lists of {n} "
                         "modules); depth pruning supports models with one stack of layers")
    return found[0]


def prune_layers(teacher: torch.nn.Module, keep: list[int]) -> torch.nn.Module:
    """A model of the teacher's family with only the decoder layers `keep` (their weights copied,
    in order) and every other weight (embeddings, final norm, head) copied as is."""
    prefix, layers = decoder_layers(teacher)
    if sorted(set(keep)) != list(keep) or not keep or keep[0] < 0 or keep[-1] >= len(layers):
        raise ModelError(f"--keep {keep}: name increasing layer indices between 0 and {len(layers) - 1}")
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(keep)
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (Qwen2, Gemma, ...)
        config.layer_types = [config.layer_types[i] for i in keep]
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = teacher.state_dict()
    state = {}
    for key in student.state_dict():
        if key.startswith(prefix + "."):
            j, rest = key[len(prefix) + 1:].split(".", 1)
            state[key] = source[f"{prefix}.{keep[int(j)]}.{rest}"]
        else:
            state[key] = source[key]
    student.load_state_dict(state, strict=True)
    student.generation_config = copy.deepcopy(teacher.generation_config)
    return student.eval()


def distillation_loss_of(teacher: torch.nn.Module):
    """`loss_of(student, batch)` for `train_on_blocks`: KL(teacher ‖ student) per next token of a
    (B, L) block of public text (α = 1, T = 1; pipeline/models/losses.py)."""
    teacher.eval()

    def loss_of(student: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # .float(): bf16 logits under autocast upcast (a no-op in fp32)
            teacher_logits = teacher(input_ids=batch).logits[:, :-1].float()  # (B, L-1, V)
        student_logits = student(input_ids=batch).logits[:, :-1].float()  # (B, L-1, V)
        labels = batch[:, 1:]  # (B, L-1)
        return distillation_loss(student_logits, teacher_logits, labels, torch.ones_like(labels, dtype=torch.bool),
                                 alpha=1.0, temperature=1.0).loss
    return loss_of


def _public_tokens(tok, corpus: Path, budget: HealingBudget) -> tuple[torch.Tensor, list[int], dict]:
    """(training blocks (N, seq_len), held-out ids, corpus figures): the corpus as one token
    stream, its last `eval_tokens` tokens held out."""
    paragraphs = corpus_paragraphs(corpus, "--corpus")
    ids = encode_paragraphs(tok, paragraphs)
    train, held = ids[:-budget.eval_tokens], ids[-budget.eval_tokens:]
    n_blocks = len(train) // budget.seq_len
    if n_blocks < 1:
        raise ModelError(f"--corpus {str(corpus)!r} holds {len(ids)} tokens, too few for --eval-tokens "
                         f"{budget.eval_tokens} and one block of --seq-len {budget.seq_len}; use a larger public text")
    files = sorted(corpus.glob("*.txt")) if corpus.is_dir() else [corpus]
    figures = {"path": str(corpus), "sha256": {f.name: sha256_file(f) for f in files},
               "training_tokens": len(train), "held_out_tokens": len(held)}
    return torch.tensor(train[: n_blocks * budget.seq_len]).view(n_blocks, budget.seq_len), held, figures


def _same_build(path: Path, build: dict) -> bool:
    try:
        return json.loads((path / MANIFEST).read_text()).get("build") == build
    except (OSError, ValueError):
        return False


def _healing_device(device: str, precision: str):
    """(the torch device, a context factory for the losses): bf16 is autocast, fp32 master weights."""
    if precision not in ("fp32", "bf16"):
        raise ModelError(f"--precision {precision}: use fp32 or bf16")
    on = resolve_device(device, precision)
    if precision == "bf16":
        return on, lambda: torch.autocast(on.type, dtype=torch.bfloat16)
    return on, contextlib.nullcontext


def build_student(
    teacher: str, layers: int | None = None, *, keep: list[int] | None = None, corpus: Path | None = None,
    budget: HealingBudget = HealingBudget(), name: str | None = None, force: bool = False, seed: int = 0,
    cache_dir: Path | None = None, device: str = "cpu", precision: str = "fp32",
) -> Path:
    """Prune cached model `teacher` to `layers` evenly spaced layers (or the layers `keep`), heal it
    on `corpus` by distillation from the teacher on `device` in `precision`, save it in the model
    cache with its card, and return its directory; one built with the same settings is reused."""
    cache_dir = Path(cache_dir if cache_dir is not None else model_cache_dir())
    teacher_dir = cached_model_dir(teacher, cache_dir)
    if cache_problems(teacher_dir):
        raise ModelError(f"the teacher {teacher!r} is not in the model cache {cache_dir}; {how_to_make(teacher)} first")
    corpus = Path(corpus) if corpus is not None else DEFAULT_CORPUS
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    n_layers = teacher_model.config.num_hidden_layers
    keep = list(keep) if keep is not None else pick_layers(n_layers, layers if layers is not None else 4)
    name = name or student_name(teacher, len(keep))
    out = cached_model_dir(name, cache_dir)
    build = {"teacher": teacher, "teacher_manifest_sha256": sha256_file(teacher_dir / MANIFEST), "keep": keep,
             "corpus": str(corpus.resolve()), "budget": asdict(budget), "seed": seed, "format": 1}
    on, autocast = _healing_device(device, precision)
    if (device, precision) != ("cpu", "fp32"):  # absent from the CPU builds' settings, which stay as they were
        build |= {"device": device, "precision": precision}
    with file_lock(cache_dir / f".{name}.lock"):
        if out.exists() and not cache_problems(out):
            if _same_build(out, build):
                log.info("student: %s is in the cache, built with these settings: %s", name, out)
                return out
            if not force:
                raise ModelError(f"{out} holds a student built with other settings; pass --name to build this one "
                                 "beside it, or --force to replace it")
        t0 = time.monotonic()
        torch.manual_seed(seed)
        tok = load_tokenizer(str(teacher_dir))
        blocks, held, corpus_info = _public_tokens(tok, corpus, budget)
        student = prune_layers(teacher_model, keep).to(on)
        teacher_model.to(on)
        log.info("student: layers %s of %d, %.1f M parameters; %d training tokens, %d held out (%.0f s)", keep, n_layers,
                 sum(p.numel() for p in student.parameters()) / 1e6, corpus_info["training_tokens"],
                 len(held), time.monotonic() - t0)

        def perplexity(model) -> float | None:
            return validation_perplexity(model, held, budget.seq_len, tok.pad_token_id,
                                         max_tokens=budget.eval_tokens, batch_size=4)

        figures = {"teacher_perplexity": perplexity(teacher_model), "perplexity_before": perplexity(student)}
        log.info("student: held-out perplexity: teacher %(teacher_perplexity)s, before healing %(perplexity_before)s",
                 figures)
        cpu = time.process_time()
        # Resumable: a killed build continues from its last 50 steps (the checkpoint is named by
        # the build's settings, so another build never reads it), to the same student.
        resume = cache_dir / f".{name}.{hashlib.sha256(json.dumps(build, sort_keys=True).encode()).hexdigest()[:12]}.heal"
        healing = train_on_blocks(student, blocks, steps=budget.steps, batch_size=budget.batch_size,
                                  learning_rate=budget.learning_rate, name="student healing",
                                  loss_of=distillation_loss_of(teacher_model), checkpoint=resume, autocast=autocast)
        # CPU seconds beside the wall time (on a shared machine the wall time is the neighbours' too)
        healing["cpu_seconds"] = round(time.process_time() - cpu, 1)
        healing["threads"] = torch.get_num_threads()
        figures["perplexity_after"] = perplexity(student)
        figures["healing"] = healing
        source = json.loads((teacher_dir / MANIFEST).read_text()).get("model", {})
        info = {
            "name": name, "teacher": teacher, "layers_kept": keep, "teacher_layers": n_layers,
            "parameters": sum(p.numel() for p in student.parameters()), "non_embedding_parameters": non_embedding_parameters(student),
            "teacher_parameters": sum(p.numel() for p in teacher_model.parameters()),
            "corpus": corpus_info, "budget": asdict(budget), "seed": seed, "device": str(on), "precision": precision,
            **figures,
            "seconds": round(time.monotonic() - t0, 1), "built_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "source": source.get("source"), "license": source.get("license")}
        log.info("student: held-out perplexity after healing %s (teacher %s), built in %.0f s",
                 figures["perplexity_after"], figures["teacher_perplexity"], info["seconds"])
        shutil.rmtree(tmp := cache_dir / f".{name}.build", ignore_errors=True)
        try:
            student.to("cpu").save_pretrained(tmp)
            tok.save_pretrained(tmp)
            finish_cache_entry(tmp, out, lambda hashes: _card(info, hashes), {"model": info, "build": build})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        resume.unlink(missing_ok=True)  # only once the student is in the cache
    return out


def _card(info: dict, hashes: dict[str, tuple[int, str]]) -> str:
    b, c, h = info["budget"], info["corpus"], info["healing"]
    size = sum(s for s, _ in hashes.values())
    rows = "\n".join(f"| {rel} | {s:,} | `{sha}` |" for rel, (s, sha) in sorted(hashes.items()))
    corpus_hashes = ", ".join(f"{n} `{d}`" for n, d in c["sha256"].items())
    return f"""# {info["name"]}

A student for `cache:{info["teacher"]}` that shares its tokenizer: layers {info["layers_kept"]} of the teacher's
{info["teacher_layers"]}, its embeddings, final norm and head copied, then healed by distillation from the
teacher (KL on every token) on public text. Built by `dpdistill models student {info["teacher"]} --layers
{len(info["layers_kept"])}`; reads no private data. Teacher: {info["source"]} (license {info["license"]}).

| | |
|---|---|
| parameters | {info["parameters"]:,} ({info["non_embedding_parameters"]:,} outside the embeddings; teacher {info["teacher_parameters"]:,}) |
| size on disk | {size / 1e6:.0f} MB (fp32 safetensors) |
| held-out perplexity, teacher | {info["teacher_perplexity"]} |
| held-out perplexity, student before healing | {info["perplexity_before"]} |
| held-out perplexity, student after healing | {info["perplexity_after"]} |
| healing | {b["steps"]} steps of {b["batch_size"]} x {b["seq_len"]} tokens ({h["tokens_seen"]:,} tokens), lr {b["learning_rate"]}, final KL {h["final_loss"]:.3f}, on {info["device"]} in {info["precision"]}, {h["seconds"]} s ({h["cpu_seconds"]} CPU s, {h["threads"]} threads) |
| build time | {info["seconds"]} s, built {info["built_at"]} |
| corpus | {c["path"]}: {c["training_tokens"]:,} training tokens, the last {c["held_out_tokens"]:,} held out (perplexity in windows of {b["seq_len"]}); sha256 {corpus_hashes} |

Use it in a config as `distill.student_model: cache:{info["name"]}`.

| file | bytes | sha256 |
|---|---:|---|
{rows}
"""
