"""The fast engine (pipeline/models/decoding.py) on every decoder family of issue 35: tiny random
models built from transformers' own config classes (no download), grouped-query attention where
the family has it.

Per family: (a) every logit the continuous-batching loop computes (refills with prompts of
other lengths into slots holding a longer sample's stale keys, positions restarting, idle rows
dropped) equals the plain full-sequence forward of that sample's tokens; (b) the first and
second sampled tokens follow the model's own softmax by a chi-square goodness-of-fit test; (c)
`fast_decode_problem` accepts the family from its config alone. (a) also for Bloom (ALiBi, no
position ids) and GPT-BigCode (one key/value head). Then what the engine refuses, by config,
with the model type and the `generate.engine=hf` fix in the message, and the first-step check
that stops a loop feeding wrong positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    BartConfig, GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM,
    LlamaConfig, LlamaForCausalLM, MambaConfig, MistralConfig, MistralForCausalLM, OPTConfig, OPTForCausalLM,
    Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, T5Config,
)

from pipeline.models import decoding

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, POSITIONS = 32, 2, 4, 2, 64, 64
_SHAPES = {
    "gpt2": (GPT2Config, GPT2LMHeadModel,
             dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=MLP, n_positions=POSITIONS)),
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=POSITIONS)),  # a window the loop spans
    "gemma": (GemmaConfig, GemmaForCausalLM, dict(head_dim=HIDDEN // HEADS)),
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM, dict(num_key_value_heads=HEADS)),  # partial rotary, no GQA
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),
    "opt": (OPTConfig, OPTForCausalLM, dict(ffn_dim=MLP, word_embed_proj_dim=HIDDEN, num_key_value_heads=HEADS)),
}
_COMMON = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
               intermediate_size=MLP, max_position_embeddings=POSITIONS)
FAMILIES = list(_SHAPES)


def _tiny(family: str, vocab: int, eos: int):
    """A random-init model of `family`, hidden 32, 2 layers, 4 query heads (2 key/value heads
    where the family groups them), on a vocabulary of `vocab` tokens."""
    config_class, model_class, own = _SHAPES[family]
    shape = own if family == "gpt2" else {**_COMMON, **own}
    ids = dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    config = config_class(vocab_size=vocab, **shape, **ids)
    torch.manual_seed(0)
    return model_class(config).eval()


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer), tiny_tokenizer.eos_token_id


def _assert_every_cached_logit_is_the_full_forwards(model, vocab_size: int, monkeypatch) -> None:
    """12 samples of 3 prompts (1, 4 and 9 tokens), budgets 2-13, through 4 slots: every logit
    the loop computes for a sample, at every step, equals the full forward of the sample's
    tokens at that position (float32 rounding)."""
    seen: list[tuple[int, int, torch.Tensor]] = []  # (prompt index, position, logits (V,))
    forward = decoding._forward_one

    def spy(model, slots):
        samples, positions = list(slots.sample), slots.fed.tolist()
        logits = forward(model, slots)
        seen.extend((i, p, logits[r]) for r, (i, p) in enumerate(zip(samples, positions)) if i >= 0)
        return logits

    monkeypatch.setattr(decoding, "_forward_one", spy)
    generator = torch.Generator().manual_seed(1)
    shared = [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in (9, 1, 4)]
    prompts = [shared[i % 3] for i in range(12)]
    budgets = [2 + (5 * i) % 12 for i in range(12)]  # rows end at different steps: refills, then idle rows
    torch.manual_seed(2)
    samples = {}
    for ended in decoding.sample(model, prompts, budgets, eos=-1, slots=4, max_length=24, top_k=0, top_p=1.0,
                                 temperature=1.0):
        samples.update({i: new for i, new, _ in ended})
    assert sorted(samples) == list(range(12)) and all(len(samples[i]) == budgets[i] for i in range(12))
    checked = 0
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            tokens = prompt + samples[i]
            want = model(torch.tensor([tokens])).logits[0]  # (T, V)
            mine = [(p, logits) for j, p, logits in seen if j == i]
            assert [p for p, _ in mine] == list(range(len(prompt) - 1, len(tokens) - 1))
            for p, logits in mine:
                torch.testing.assert_close(logits, want[p], atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked == sum(budgets)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_cached_logit_is_the_full_forwards(family, vocab, monkeypatch):
    _assert_every_cached_logit_is_the_full_forwards(_tiny(family, *vocab), vocab[0], monkeypatch)


@pytest.mark.parametrize("family", ["bloom", "gpt_bigcode"])
def test_and_beyond_the_matrix(family, vocab, monkeypatch):
    """Two other ways of placing tokens: Bloom has no position ids at all (ALiBi biases built
    from the 2-D mask's cumulative sum, which the loop's mask gives each row's positions), and
    GPT-BigCode keeps one key/value head for all queries."""
    from transformers import BloomConfig, BloomForCausalLM, GPTBigCodeConfig, GPTBigCodeForCausalLM

    torch.manual_seed(0)
    model = (BloomForCausalLM(BloomConfig(vocab_size=vocab[0], hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS))
             if family == "bloom" else
             GPTBigCodeForCausalLM(GPTBigCodeConfig(vocab_size=vocab[0], n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                                    n_positions=POSITIONS, multi_query=True)))
    assert decoding.fast_decode_problem(model.config, max_length=POSITIONS) is None
    _assert_every_cached_logit_is_the_full_forwards(model.eval(), vocab[0], monkeypatch)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plans_steady_steps_run_every_family(family, vocab, monkeypatch):
    """decoding.steady_steps (what `dpdistill plan` times a token with) on every family: each
    step feeds every row at the asked depth, clamped to the model's positions."""
    model = _tiny(family, *vocab)
    seen = []
    forward = decoding._forward_one

    def spy(model, slots):
        seen.append(slots.fed.tolist())
        return forward(model, slots)

    monkeypatch.setattr(decoding, "_forward_one", spy)
    decoding.steady_steps(model, 3, 200, 4, max_length=128, top_k=50, top_p=0.9, temperature=1.0)
    assert seen == [[POSITIONS - 5 + i] * 3 for i in range(4)]  # the last step at POSITIONS - 2


N, ALPHA = 3000, 1e-3


def _draws(model, prompt: list[int], temperature: float) -> np.ndarray:
    """(N, 2): the first two tokens of N samples of `prompt`, top-k and top-p off."""
    torch.manual_seed(3)
    rows = []
    for ended in decoding.sample(model, [prompt] * N, [2] * N, eos=-1, slots=500, max_length=len(prompt) + 2,
                                 top_k=0, top_p=1.0, temperature=temperature):
        rows += [new for _, new, _ in ended]
    return np.array(rows)


def _model_probabilities(model, prompt: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The model's own distribution of the first token (V,) and of the second (V,): the first
    token's softmax times each continuation's, summed over the first (one batched forward)."""
    with torch.no_grad():
        first = (model(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)  # (V,)
        V = len(first)
        both = torch.cat([torch.tensor([prompt]).expand(V, -1), torch.arange(V).unsqueeze(1)], 1)  # (V, P + 1)
        second = (model(both).logits[:, -1] / temperature).softmax(-1)  # (V, V): row x is p(· | prompt, x)
    return first.double().numpy(), (first.double() @ second.double()).numpy()


def _p_value(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of N drawn tokens to `probs`, tokens expected fewer than 10
    times pooled into one cell (the approximation wants ~5 a cell)."""
    observed = np.bincount(tokens, minlength=len(probs)).astype(float)
    expected = probs / probs.sum() * len(tokens)
    rare = expected < 10
    observed = np.append(observed[~rare], observed[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("family", FAMILIES)
def test_first_and_second_tokens_follow_the_models_softmax(family, vocab):
    """3000 samples of two tokens, at a temperature that makes the random model's next-token
    distribution peaked (its logits' spread / 2: a wrong logit shows): each position's token
    frequencies fit the model's own probabilities (p >= ALPHA / 2, Bonferroni over the two
    positions), and the same draws are rejected against a 20 % hotter temperature."""
    model = _tiny(family, *vocab)
    prompt = torch.randint(1, vocab[0], (5,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        temperature = float(model(torch.tensor([prompt])).logits[0, -1].std()) / 2
    draws = _draws(model, prompt, temperature)
    first, second = _model_probabilities(model, prompt, temperature)
    assert _p_value(draws[:, 0], first) >= ALPHA / 2
    assert _p_value(draws[:, 1], second) >= ALPHA / 2
    hotter, _ = _model_probabilities(model, prompt, 1.2 * temperature)
    assert _p_value(draws[:, 0], hotter) < ALPHA / 2


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_accepted_from_its_config(family, vocab):
    config = _tiny(family, *vocab).config
    assert decoding.fast_decode_problem(config, max_length=POSITIONS) is None


@pytest.mark.parametrize(("config", "words"), [
    (T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8), ["'t5'", "encoder-decoder"]),
    (BartConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32), ["'bart'", "encoder-decoder"]),
    (MambaConfig(hidden_size=16, num_hidden_layers=1), ["'mamba'", "recurrent state"]),
    (GPT2Config(n_embd=16, n_layer=1, n_head=2, add_cross_attention=True), ["'gpt2'", "cross-attention"]),
    (MistralConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=32, sliding_window=16), ["'mistral'", "sliding window of 16", "max_length=32"]),
])
def test_what_the_engine_cannot_decode_is_refused_by_config(config, words):
    """From the config alone (what a run checks before any stage), each with what is wrong; and
    `sample` raises the same with the generate.engine=hf fix."""
    problem = decoding.fast_decode_problem(config, max_length=32)
    assert problem is not None and all(w in problem for w in words), problem


def test_sample_refuses_a_model_it_cannot_decode(vocab):
    config = MistralConfig(vocab_size=vocab[0], sliding_window=8, **_COMMON)
    model = MistralForCausalLM(config).eval()
    with pytest.raises(decoding.FastDecodeError, match="'mistral'.*sliding window of 8.*generate.engine=hf"):
        next(decoding.sample(model, [[1, 2]], [4], eos=-1, slots=1, max_length=16, top_k=0, top_p=1.0,
                             temperature=1.0))


def test_a_loop_that_feeds_wrong_positions_is_caught_at_its_first_step(vocab, monkeypatch):
    """The first step's check against the model's own forward: positions off by one (as a
    family reading its positions some other way would see them) stop the run."""
    model = _tiny("llama", *vocab)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, position_ids=None, **kw: forward(
        *a, position_ids=None if position_ids is None else position_ids + 1, **kw))
    with pytest.raises(decoding.FastDecodeError, match="'llama' model wrongly.*generate.engine=hf"):
        next(decoding.sample(model, [[5, 6, 7]], [4], eos=-1, slots=1, max_length=16, top_k=0, top_p=1.0,
                             temperature=1.0))
