"""Tiny random-init causal LMs of every decoder family the project supports, for tests.

CONVENTIONS.md 15: code that touches a model's layers is tested on a matrix of families, as
PEFT and Opacus test theirs. Each builder makes the family's own transformers config class
at a tiny size (no download, nothing saved) and returns the randomly initialised causal LM:

    from families import FAMILIES
    model = FAMILIES["llama"](len(tiny_tokenizer))   # seed first (tests/conftest.py's autouse fixture does)

Every model: hidden size 64, 2 layers, 4 heads of 16 with grouped-query attention (2
key/value heads) where the family has it, MLP 128, 128 positions,
dropout off, eager attention (deterministic, and plain tensor code that torch.func can
vmap over). `tie_word_embeddings` is the family's real default for its small checkpoints:
tied for GPT-2, OPT, Gemma, and for Llama and Qwen2 as SmolLM2 / Llama-3.2-1B and
Qwen2.5-0.5B ship them; untied for Mistral, GPT-NeoX and Phi-3. Code that needs the head
untied (DP clipping) calls `pipeline.models.base.untie_lm_head`, as the pipeline does.

What each exercises: GPT-2 Conv1D and LayerNorm; Llama/Qwen2/Mistral/Phi-3 RMSNorm (w·x̂),
rotary positions, gated MLPs, no biases (Qwen2: q/k/v biases; Phi-3: fused qkv and
gate_up projections); Gemma RMSNorm with (1+w)·x̂ and an embedding scaled by √hidden;
GPT-NeoX LayerNorm with biases and a separate output embedding; OPT learned positional
embeddings (an nn.Embedding subclass with its own forward) and an embedding padding_idx.
`eos_id` is every special token's id (the tests' tokenizer has one: EOS = pad = bos).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

HIDDEN, HEADS, KV_HEADS, LAYERS, POSITIONS = 64, 4, 2, 2, 128
_GQA = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, intermediate_size=2 * HIDDEN,
            max_position_embeddings=POSITIONS, attention_dropout=0.0)


def _build(model_cls, config) -> PreTrainedModel:
    config._attn_implementation = "eager"
    return model_cls(config)


def gpt2(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:
    return _build(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=vocab_size, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=2 * HIDDEN, n_positions=POSITIONS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, tie_word_embeddings=True))


def llama(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # SmolLM2 / Llama-3.2 style: tied
    return _build(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=vocab_size, **_GQA, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True))


def qwen2(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # Qwen2.5-0.5B style: tied
    return _build(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        vocab_size=vocab_size, **_GQA, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True))


def mistral(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:
    return _build(transformers.MistralForCausalLM, transformers.MistralConfig(
        vocab_size=vocab_size, **_GQA, sliding_window=None,
        bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=False))


def gemma(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # pad_token_id: Gemma's embedding has a padding_idx
    return _build(transformers.GemmaForCausalLM, transformers.GemmaConfig(
        vocab_size=vocab_size, **_GQA, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        tie_word_embeddings=True))


def gpt_neox(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:
    return _build(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=POSITIONS, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=False))


def phi3(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:
    return _build(transformers.Phi3ForCausalLM, transformers.Phi3Config(
        vocab_size=vocab_size, **_GQA, resid_pdrop=0.0, embd_pdrop=0.0, sliding_window=None,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, tie_word_embeddings=False))


def opt(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # OPT's own padding_idx (pad = 1), tied
    return _build(transformers.OPTForCausalLM, transformers.OPTConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, ffn_dim=2 * HIDDEN, max_position_embeddings=POSITIONS, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=1, tie_word_embeddings=True))


FAMILIES: dict[str, Callable[[int], PreTrainedModel]] = {
    "gpt2": gpt2, "llama": llama, "qwen2": qwen2, "mistral": mistral, "gemma": gemma,
    "gpt_neox": gpt_neox, "phi3": phi3, "opt": opt,
}


# --- the families whose layers clipping must handle besides (issue 62): the clipping and preflight
# matrix (tests/privacy/test_clipping_families.py), not yet every stage (tests/stages/test_families.py)

def falcon(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # Falcon-7B style: tied
    """FalconLinear (an nn.Linear subclass computing x Wᵀ + b its own way), multi-query attention,
    attention and MLP in parallel, the MLP's output added to in place (`mlp_output += ...`)."""
    return _build(transformers.FalconForCausalLM, transformers.FalconConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        multi_query=True, parallel_attn=True, bias=False, ffn_hidden_size=2 * HIDDEN, max_position_embeddings=POSITIONS,
        hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True))


def stablelm(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # StableLM-2 style: untied
    """LayerNorm with biases, q/k/v biases, a quarter of each head rotated, and (as StableLM-2-12B)
    a LayerNorm per head on q and k (a ModuleList of LayerNorms over head slices)."""
    return _build(transformers.StableLmForCausalLM, transformers.StableLmConfig(
        vocab_size=vocab_size, **_GQA, use_qkv_bias=True, qk_layernorm=True, partial_rotary_factor=0.25,
        hidden_dropout=0.0, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=False))


def cohere(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # Command-R style: tied
    """CohereLayerNorm (mean-centred, no bias), attention and MLP in parallel, logits scaled."""
    return _build(transformers.CohereForCausalLM, transformers.CohereConfig(
        vocab_size=vocab_size, **_GQA, logit_scale=0.25, bos_token_id=eos_id, eos_token_id=eos_id,
        pad_token_id=eos_id, tie_word_embeddings=True))


def olmo2(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:
    """Norms after attention and MLP (not before), RMSNorm on the whole q and k projections."""
    return _build(transformers.Olmo2ForCausalLM, transformers.Olmo2Config(
        vocab_size=vocab_size, **_GQA, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        tie_word_embeddings=False))


def granite(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # Granite-3 style: tied
    """Llama's layers with Granite-3's scalars on the embedding, the residuals, attention and logits."""
    return _build(transformers.GraniteForCausalLM, transformers.GraniteConfig(
        vocab_size=vocab_size, **_GQA, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0625, logits_scaling=8.0, bos_token_id=eos_id, eos_token_id=eos_id,
        pad_token_id=eos_id, tie_word_embeddings=True))


def starcoder2(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # tied
    """LayerNorm with biases, biases on every linear map, a plain (c_fc, c_proj) MLP."""
    return _build(transformers.Starcoder2ForCausalLM, transformers.Starcoder2Config(
        vocab_size=vocab_size, **_GQA, use_bias=True, residual_dropout=0.0, embedding_dropout=0.0,
        bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True))


def qwen3(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # Qwen3-0.6B style: tied
    """RMSNorm per head on q and k (a weight of the head size on (B, T, heads, head_dim))."""
    return _build(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        vocab_size=vocab_size, **_GQA, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True))


def gemma2(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # tied
    """Gemma's (1+w)·x̂ norms before and after attention and MLP, soft-capped attention and
    logits, sliding-window layers (a window of 4, shorter than the test records)."""
    return _build(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        vocab_size=vocab_size, **_GQA, query_pre_attn_scalar=HIDDEN // HEADS, sliding_window=4,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, tie_word_embeddings=True))


def gemma3(vocab_size: int = 300, eos_id: int = 0) -> PreTrainedModel:  # Gemma-3-1B style: text only, tied
    """Gemma2's layout with per-head q/k norms and local/global rotary bases."""
    return _build(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        vocab_size=vocab_size, **_GQA, query_pre_attn_scalar=HIDDEN // HEADS, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, tie_word_embeddings=True))


MORE_FAMILIES: dict[str, Callable[[int], PreTrainedModel]] = {
    "falcon": falcon, "stablelm": stablelm, "cohere": cohere, "olmo2": olmo2, "granite": granite,
    "starcoder2": starcoder2, "qwen3": qwen3, "gemma2": gemma2, "gemma3": gemma3,
}
CLIPPING_FAMILIES = FAMILIES | MORE_FAMILIES  # every family clipping and preflight are checked on


def save_pair(name: str, tokenizer, root: Path) -> dict[str, Path]:
    """A teacher of family `name` (seeded) and a student of its family, one layer and half as
    wide (the head size kept), saved with `tokenizer` under root/name/{teacher,student}."""
    torch.manual_seed(0)
    teacher = FAMILIES[name](len(tokenizer), tokenizer.eos_token_id)
    text = teacher.config.get_text_config()
    fields = {k: v for k, v in text.to_dict().items() if k != "layer_types"}  # rebuilt for one layer
    narrow = {"n_embd": 32, "n_layer": 1, "n_head": 2} if text.model_type == "gpt2" else {
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        **({"num_key_value_heads": 1} if hasattr(text, "num_key_value_heads") else {}),
        **({"word_embed_proj_dim": 32} if text.model_type == "opt" else {})}
    student = type(teacher)(type(text)(**{**fields, **narrow}))
    dirs = {}
    for role, model in (("teacher", teacher), ("student", student)):
        dirs[role] = root / name / role
        model.save_pretrained(dirs[role])
        tokenizer.save_pretrained(dirs[role])
    return dirs


# Opacus' hooks cannot wrap Gemma's and OPT's embeddings: preflight refuses ghost for them (its test)
NO_GHOST = ("gemma", "opt")
STEP = {"target_epsilon": 8.0, "epochs": 1, "batch_size": 50, "physical_batch_size": 25, "max_length": 48,
        "learning_rate": 1e-3}


def every_stage(family: str, dirs: dict[str, Path], splits, out: Path, runtime) -> dict[str, float]:
    """The family's teacher through every stage on `runtime` (device, precision), checked:
    one DP-SGD step in bk (also with the head kept tied), ghost (where Opacus can) and LoRA with its ledger entry, 16 samples
    with the fast engine and the hf reference, one distillation epoch of the student (the
    teacher's logits and the hidden-state MSE across widths), evaluation. Returns each
    part's wall seconds (tests/stages/test_families.py; bench/family_matrix.py on a GPU)."""
    from pipeline.config import DistillConfig, EvalConfig, GenerateConfig, TeacherConfig
    from pipeline.models.base import load_causal_lm
    from pipeline.stages.distill import distill
    from pipeline.stages.evaluate import evaluate_models
    from pipeline.stages.generate import generate_synthetic, read_synthetic
    from pipeline.stages.teacher.recipe import train_teacher

    seconds, results = {}, {}
    modes = {"bk": {}, "bk-tied": {"untie_lm_head": False}, "ghost": {"grad_sample_mode": "ghost"},
             "lora": {"mode": "lora"}}
    for label, extra in modes.items():
        if label == "ghost" and family in NO_GHOST:
            continue
        t0 = time.perf_counter()
        results[label] = train_teacher(TeacherConfig(**STEP, **extra), train_path=splits.train,
                                       validation_path=splits.validation, base_model=str(dirs["teacher"]),
                                       out_dir=out / f"teacher-{label}", seed=0, runtime=runtime)
        seconds[f"teacher_{label}"] = time.perf_counter() - t0
        entry = results[label].ledger
        assert entry.private and entry.steps >= 1 and 0 < entry.epsilon <= 8.0, (label, entry)
        assert entry.mechanism == "subsampled_gaussian" and entry.history
    tied = load_causal_lm(str(results["bk-tied"].checkpoint))  # teacher.untie_lm_head=false: saved as the family ties
    assert (tied.get_output_embeddings().weight is tied.get_input_embeddings().weight) == bool(
        tied.config.tie_word_embeddings) and results["bk-tied"].ledger.untied_parameters == 0
    assert results["lora"].ledger.untied_parameters == 0  # LoRA freezes the head: the tie stays
    teacher = results["bk"].checkpoint
    codes = out / "codes.json"
    codes.write_text(json.dumps({"counts": {"Category: A": 3, "Category: B": 1}}))
    synthetic = {}
    for engine in ("fast", "hf"):  # empty samples are dropped: up to 16
        t0 = time.perf_counter()
        synthetic[engine] = generate_synthetic(
            GenerateConfig(num_samples=16, batch_size=8, max_length=32, validation_fraction=0.25, engine=engine),
            teacher_dir=teacher, control_codes_path=codes, ledger=[], out_dir=out / f"synthetic-{engine}", seed=0,
            runtime=runtime)
        seconds[f"generation_{engine}"] = time.perf_counter() - t0
        samples = read_synthetic(synthetic[engine].path)
        assert 0 < samples.num_rows <= 16 and set(samples["control_code"].to_pylist()) <= {"Category: A", "Category: B"}
    t0 = time.perf_counter()
    student = distill(DistillConfig(candidates=[], epochs=1, batch_size=8, learning_rate=1e-3, teacher_top_k=None,
                                    beta=0.5, eval_every=2),
                      synthetic_path=synthetic["fast"].path, teacher_dir=teacher, student_model=str(dirs["student"]),
                      out_dir=out / "student", seed=0, runtime=runtime)
    seconds["distillation"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    metrics = evaluate_models(EvalConfig(window=32, batch_size=8),
                              models={"dp_teacher": str(teacher), "student": str(student.checkpoint)},
                              test_path=splits.test, out_dir=out / "evaluation", seed=0,
                              synthetic_path=synthetic["fast"].path, runtime=runtime)
    seconds["evaluation"] = time.perf_counter() - t0
    for name in ("dp_teacher", "student"):
        assert math.isfinite(metrics["perplexity"][name]["windowed"]), (name, metrics["perplexity"])
    return seconds


# --- models no family ships, which a user's own code could make (issue 62 items 9-13) -------------

class ToyConfig(transformers.PretrainedConfig):
    model_type = "dpdistill_toy"

    def __init__(self, vocab_size: int = 50, hidden_size: int = 16, kind: str = "plain",
                 max_position_embeddings: int = POSITIONS, **kwargs):
        self.vocab_size, self.hidden_size, self.kind = vocab_size, hidden_size, kind
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**{"tie_word_embeddings": False, **kwargs})


class _Gate(torch.nn.Module):
    """A ReZero-style gate y = w·x, one weight (shape (1,)) over every feature."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((1,), 0.3))

    def forward(self, x):
        return x * self.weight


class ToyLM(PreTrainedModel):
    """A tiny causal LM whose middle does what `config.kind` says: "outside" also uses lin.weight
    through F.linear in its own forward (items 9, 10), "twice" calls lin twice (item 13), "gate"
    adds a 1-element ReZero gate (item 11). Registered with transformers' Auto classes, so a
    saved one goes through preflight from its directory like any family."""

    config_class = ToyConfig

    def __init__(self, config: ToyConfig):
        super().__init__(config)
        d = config.hidden_size
        self.embed = torch.nn.Embedding(config.vocab_size, d)
        self.lin = torch.nn.Linear(d, d)
        self.gate = _Gate() if config.kind == "gate" else None
        self.lm_head = torch.nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        h = self.embed(input_ids)  # (B, T, d)
        if self.config.kind == "outside":
            h = self.lin(h) + torch.nn.functional.linear(h, self.lin.weight)
        elif self.config.kind == "twice":
            h = self.lin(torch.tanh(self.lin(h)))
        elif self.config.kind == "gate":
            h = h + self.gate(torch.tanh(self.lin(h)))
        else:
            h = self.lin(h)
        return transformers.modeling_outputs.CausalLMOutput(logits=self.lm_head(h))  # (B, T, V)


transformers.AutoConfig.register(ToyConfig.model_type, ToyConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(ToyConfig, ToyLM, exist_ok=True)
