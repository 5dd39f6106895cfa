"""Sampling from a GPT-2 with a decode loop of our own: a KV cache allocated once, continuous
batching, top-k / top-p / temperature as tensor ops. Generation's default engine
(`generate.engine: fast`); HF's `model.generate` stays the reference (`generate.engine: hf`).

Why not `model.generate` (issue 22): profiled on one busy CPU core, a `generate` step of the
builtin teacher (4 × 256, vocabulary 8192, 64 rows) took ~100 ms, ~25 ms of it the model's
matmuls and the rest around them: warpers over the whole vocabulary (a sort and an
exponential draw for each of the 8192 logits of each row), a KV cache grown by
concatenation; and rows that had finished rode along until the batch's longest one did.
Here a step takes ~40 ms, ~22 ms of it the same matmuls (so this CPU caps the gain near 3x):

- each of the `slots` rows has its own position and its own rows in a key/value cache of
  (slots, heads, max_length, head_dim) per layer, allocated once; a row attends to the
  positions it has fed so far and nothing else, so stale entries of a slot's previous
  sample are never read;
- when a row ends (eos or its budget) its slot takes the next pending prompt (continuous
  batching), so no row waits for the longest in its batch;
- prompts go through the same one-token step as sampled tokens. Every row has its own
  position, so prompts of any length share the batch with no padding, and no second
  (prefill) forward runs for each refill; only rows that sample this step pay for the
  vocabulary projection and the sampling;
- top-k / top-p / temperature act on the k largest logits (`torch.topk`): the distribution
  HF's warpers give (temperature → top-k → top-p, `sample_next`), on 50 values a row
  instead of 8192.

`torch.compile` is not used: compiling `_forward_one` (dynamic shapes) took 6.5 minutes
before the first step on this project's 2 busy cores and then decoded ~1.25x faster
(docs/benchmarks.md, "Measured once, by hand"): the step is bound by its matmuls, the vocabulary projection
alone a quarter of it, so it pays only for generations of over ~30 minutes, per process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def fast_decode_problem(model) -> str | None:
    """Why `sample` cannot decode `model` (None: it can): it runs GPT-2's blocks itself."""
    config = model.config
    if config.model_type != "gpt2" or not hasattr(model, "transformer"):
        return f"the fast decode loop knows GPT-2 models only, not {config.model_type!r}"
    if getattr(config, "add_cross_attention", False):
        return "the fast decode loop does not run cross-attention"
    return None


def truncated_logits(logits: torch.Tensor, top_k: int, top_p: float,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits HF's generate samples from, as HF's warpers leave them: temperature, then
    top-k (0: off), then top-p (1: off) over what is left, dropped tokens at -inf.
    logits (R, V) -> (values (R, k), their token ids (R, k)), or (values (R, V), None) when
    neither top-k nor top-p picks tokens.

    With top-k the rest runs on the k largest logits (sorted by topk) instead of all V. Top-p
    keeps a token when the mass of the tokens ranked above it is below top_p, which is HF's
    rule (drop where the ascending cumulative mass is <= 1 - top_p) written the other way
    round; the most likely token is always kept. (Ties at the k-th logit: HF keeps every tied
    token, topk exactly k; the same probability for each either way.)
    """
    values, ids = logits.float(), None  # (R, V)
    if top_k:
        values, ids = values.topk(min(top_k, values.shape[-1]), dim=-1)  # (R, k), descending
    values = values / temperature
    if top_p < 1.0:
        if ids is None:
            values, ids = values.sort(dim=-1, descending=True)
        probs = values.softmax(-1)
        mass_above = probs.cumsum(-1) - probs  # (R, k): mass of the tokens ranked higher
        values = values.masked_fill(mass_above >= top_p, float("-inf"))
    return values, ids


def sample_next(logits: torch.Tensor, top_k: int, top_p: float, temperature: float) -> torch.Tensor:
    """One token per row from `truncated_logits`' distribution. logits (R, V) -> (R,)."""
    values, ids = truncated_logits(logits, top_k, top_p, temperature)
    choice = torch.multinomial(values.softmax(-1), 1)  # (R, 1)
    return (choice if ids is None else ids.gather(-1, choice)).squeeze(-1)


def ban_repeated_ngrams(logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """HF's no_repeat_ngram_size for rows of different lengths: -inf for each token that
    would complete an n-gram the row already holds. logits (R, V), tokens (R, T) whose first
    `lengths` (R,) are the row's sequence (prompt included, as in HF)."""
    R, T = tokens.shape
    if n < 1 or T < n:
        return logits
    suffix_at = (lengths - (n - 1)).clamp(min=0).unsqueeze(1) + torch.arange(n - 1, device=tokens.device)  # (R, n-1)
    suffix = tokens.gather(1, suffix_at.clamp(max=T - 1))  # (R, n-1): the row's last n-1 tokens
    windows = tokens.unfold(1, n, 1)  # (R, T-n+1, n)
    starts = torch.arange(windows.shape[1], device=tokens.device)  # (T-n+1,)
    inside = starts.unsqueeze(0) + n <= lengths.unsqueeze(1)  # (R, T-n+1): window within the sequence
    matches = (windows[..., :-1] == suffix.unsqueeze(1)).all(-1) & inside  # (R, T-n+1)
    V = logits.shape[-1]
    banned = torch.zeros(R, V + 1, dtype=torch.bool, device=logits.device)  # column V: no ban
    banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=V), V), True)
    return logits.masked_fill(banned[:, :V], float("-inf"))


@dataclass
class _Slots:
    """The rows being decoded. tokens (S, T) holds each row's prompt and sampled tokens;
    `fed` (S,) of them are in the KV cache; `limit` (S,) is the prompt plus the budget."""

    tokens: torch.Tensor  # (S, T) long
    n_tokens: torch.Tensor  # (S,)
    fed: torch.Tensor  # (S,)
    limit: torch.Tensor  # (S,)
    sample: list[int]  # the prompt index each slot decodes, -1: idle
    prompt_len: list[int]
    keys: list[torch.Tensor]  # per layer (S, H, T, D)
    values: list[torch.Tensor]

    def keep(self, rows: torch.Tensor) -> None:
        """Only `rows` stay (the rest are idle): later steps compute nothing for them."""
        for name in ("tokens", "n_tokens", "fed", "limit"):
            setattr(self, name, getattr(self, name)[rows])
        kept = rows.tolist()
        self.sample = [self.sample[r] for r in kept]
        self.prompt_len = [self.prompt_len[r] for r in kept]
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]


def _empty_slots(model, slots: int, max_length: int) -> _Slots:
    cfg, param = model.config, next(model.parameters())
    heads, head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
    cache = lambda: [torch.zeros(slots, heads, max_length, head_dim, dtype=param.dtype, device=param.device)
                     for _ in range(cfg.n_layer)]
    zeros = lambda: torch.zeros(slots, dtype=torch.long, device=param.device)
    return _Slots(tokens=torch.zeros(slots, max_length, dtype=torch.long, device=param.device),
                  n_tokens=zeros(), fed=zeros(), limit=zeros(), sample=[-1] * slots, prompt_len=[1] * slots,
                  keys=cache(), values=cache())


def _forward_one(model, slots: _Slots) -> torch.Tensor:
    """Feed each row its next token (at position `fed`) through every block, writing its key
    and value into the cache; the last hidden states (S, E), before the final layer norm."""
    gpt = model.transformer
    rows = torch.arange(len(slots.fed), device=slots.fed.device)
    x = gpt.wte(slots.tokens[rows, slots.fed]) + gpt.wpe(slots.fed)  # (S, E)
    span = int(slots.fed.max()) + 1  # keys past every row's position are never read
    hidden = (torch.arange(span, device=x.device) > slots.fed.unsqueeze(1)).unsqueeze(1)  # (S, 1, span)
    for block, keys, values in zip(gpt.h, slots.keys, slots.values):
        attn = block.attn
        q, k, v = attn.c_attn(block.ln_1(x)).view(len(x), 3, -1, attn.head_dim).unbind(1)  # (S, H, D) each
        keys[rows, :, slots.fed] = k
        values[rows, :, slots.fed] = v
        x = x + attn.c_proj(_attend(q, keys[:, :, :span], values[:, :, :span], hidden, attn.scaling))
        x = x + block.mlp(block.ln_2(x))
    return x


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor, scale: float):
    """One query per row against its cached keys, as two batched matmuls: with a single query
    and a mask, CPU SDPA took ~5x longer (measured at 64 rows, 8 heads, 100 keys). q (S, H, D), keys/values
    (S, H, span, D), hidden (S, 1, span) True where a key is not the row's -> (S, H·D)."""
    S, H, span, D = keys.shape
    scores = torch.bmm(q.reshape(S * H, 1, D), keys.reshape(S * H, span, D).transpose(1, 2))  # (S·H, 1, span)
    scores = (scores.view(S, H, span) * scale).masked_fill_(hidden, float("-inf"))  # (S, H, span)
    out = torch.bmm(scores.softmax(-1).view(S * H, 1, span), values.reshape(S * H, span, D))  # (S·H, 1, D)
    return out.view(S, H * D)


@torch.no_grad()
def sample(model, prompts: list[list[int]], budgets: list[int], *, eos: int, slots: int, max_length: int,
           top_k: int, top_p: float, temperature: float, no_repeat_ngram_size: int = 0,
           ) -> Iterator[list[tuple[int, list[int], bool]]]:
    """Sample a continuation of each prompt, at most `budgets[i]` new tokens, stopping at eos,
    with `slots` rows decoded at a time. Yields after every step the rows that ended in it:
    (prompt index, new tokens without the eos, whether eos ended it). Draws from torch's
    global generator: seed it for a reproducible run (the order of prompts fixes the rest).
    """
    assert fast_decode_problem(model) is None, fast_decode_problem(model)
    assert all(len(p) + b <= max_length for p, b in zip(prompts, budgets)), "the caller caps budgets"
    if not prompts:
        return
    state = _empty_slots(model, min(slots, len(prompts)), max_length)
    refill = _Refill(model, prompts, budgets, max_length)
    for slot in range(len(state.sample)):
        refill(state, slot)
    while True:
        ended = _step(model, state, eos, top_k, top_p, temperature, no_repeat_ngram_size)
        for slot, _ in ended:
            refill(state, slot)
        yield [row for _, row in ended]
        busy = [s for s, i in enumerate(state.sample) if i >= 0]
        if not busy:
            return
        if len(busy) <= len(state.sample) // 2:  # idle rows would cost as much as busy ones
            state.keep(torch.tensor(busy, device=state.fed.device))


@torch.no_grad()
def steady_steps(model, rows: int, position: int, steps: int, *, max_length: int, top_k: int, top_p: float,
                 temperature: float, no_repeat_ngram_size: int = 0) -> None:
    """`steps` decode steps of `rows` rows that all sample, from `position` on (clamped to leave
    room in max_length and the model's positions): `sample`'s steady state once its rows have
    reached that depth, every step attending over `position` keys or more. What `dpdistill
    plan` times (pipeline/timing.py); the tokens and cached keys are random or zero: their
    values cost nothing."""
    position = max(0, min(position, min(max_length, model.config.n_positions) - steps - 1))
    state = _empty_slots(model, rows, max_length)
    state.tokens.random_(0, model.config.vocab_size)
    state.fed.fill_(position)
    state.n_tokens.fill_(position + 1)
    state.limit.fill_(max_length)
    state.sample = list(range(rows))
    for _ in range(steps):
        _step(model, state, -1, top_k, top_p, temperature, no_repeat_ngram_size)


class _Refill:
    """Gives a free slot the next pending prompt, its keys and values already in the cache.

    Prompts are control codes: a few distinct ones, each drawn many times. The keys and values
    of a prompt's tokens but the last are computed once (`_prefix`) and copied into each slot
    that takes it; the slot then feeds the last prompt token in the batched step, whose logits
    give the first sampled token. Without this, feeding ~25 prompt tokens one at a time took a
    quarter of the decode steps of the demo's ~70-token samples."""

    def __init__(self, model, prompts: list[list[int]], budgets: list[int], max_length: int):
        self.model, self.prompts, self.budgets, self.max_length = model, prompts, budgets, max_length
        self.pending = iter(range(len(prompts)))
        self.prefixes: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def __call__(self, state: _Slots, slot: int) -> None:
        i = next(self.pending, -1)
        state.sample[slot] = i
        if i < 0:  # nothing left: the slot idles, feeding one token at position 0
            state.tokens[slot, 0], state.n_tokens[slot], state.fed[slot], state.limit[slot] = 0, 1, 0, 1
            return
        prompt = self.prompts[i]
        keys, values = self._prefix(tuple(prompt))
        for layer, (k, v) in enumerate(zip(keys, values)):
            state.keys[layer][slot, :, : len(prompt) - 1] = k
            state.values[layer][slot, :, : len(prompt) - 1] = v
        state.prompt_len[slot] = len(prompt)
        state.tokens[slot, : len(prompt)] = torch.tensor(prompt, device=state.tokens.device)
        state.n_tokens[slot] = len(prompt)
        state.fed[slot] = len(prompt) - 1
        state.limit[slot] = len(prompt) + self.budgets[i]

    def _prefix(self, prompt: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the keys and values (H, P-1, D) of the prompt's tokens but the last."""
        if prompt not in self.prefixes:
            one = _empty_slots(self.model, 1, self.max_length)
            one.tokens[0, : len(prompt)] = torch.tensor(prompt, device=one.tokens.device)
            for _ in range(len(prompt) - 1):
                _forward_one(self.model, one)
                one.fed += 1
            n = len(prompt) - 1
            self.prefixes[prompt] = ([k[0, :, :n].clone() for k in one.keys], [v[0, :, :n].clone() for v in one.values])
        return self.prefixes[prompt]


def _step(model, state: _Slots, eos: int, top_k: int, top_p: float, temperature: float,
          no_repeat_ngram_size: int) -> list[tuple[int, tuple[int, list[int], bool]]]:
    """One token through every row; rows that have fed their whole sequence sample the next one.
    Returns the (slot, (prompt index, new tokens, finished)) of the rows that ended."""
    hidden = _forward_one(model, state)  # (S, E)
    state.fed += 1
    idle = torch.tensor([i < 0 for i in state.sample], device=state.fed.device)
    state.fed.masked_fill_(idle, 0)  # idle slots feed their one token again, harmlessly
    rows = ((state.fed == state.n_tokens) & ~idle).nonzero().squeeze(1)  # (R,) rows that sample now
    if len(rows) == 0:
        return []
    logits = model.lm_head(model.transformer.ln_f(hidden[rows]))  # (R, V)
    if no_repeat_ngram_size:
        logits = ban_repeated_ngrams(logits.float(), state.tokens[rows], state.n_tokens[rows], no_repeat_ngram_size)
    new = sample_next(logits, top_k, top_p, temperature)  # (R,)
    state.tokens[rows, state.n_tokens[rows]] = new
    state.n_tokens[rows] += 1
    ended = (new == eos) | (state.n_tokens[rows] >= state.limit[rows])  # (R,)
    out = []
    for slot, hit_eos in zip(rows[ended].tolist(), (new[ended] == eos).tolist()):
        start, stop = state.prompt_len[slot], int(state.n_tokens[slot]) - int(hit_eos)
        out.append((slot, (state.sample[slot], state.tokens[slot, start:stop].tolist(), hit_eos)))
    return out
