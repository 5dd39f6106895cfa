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

from collections.abc import Callable

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
