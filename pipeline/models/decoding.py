"""Sampling from any causal LM with a decode loop of our own around the model's own forward: a
KV cache allocated once, continuous batching, top-k / top-p / temperature as tensor ops.
Generation's default engine (`generate.engine: fast`); HF's `model.generate` stays the
reference (`generate.engine: hf`).

Why not `model.generate` (issue 22): profiled on one busy CPU core, a `generate` step of the
builtin teacher (4 × 256, vocabulary 8192, 64 rows) took ~100 ms, ~25 ms of it the model's
matmuls and the rest around them: warpers over the whole vocabulary (a sort and an
exponential draw for each of the 8192 logits of each row), a KV cache grown by
concatenation; and rows that had finished rode along until the batch's longest one did.

How (issue 35: every family transformers loads, through its own forward and cache API, no copy
of any family's blocks):

- each step is one call of the model's forward, one token per row, with `position_ids` (S, 1)
  (every row at its own position: RoPE, learned or offset positions all come from them), a 2-D
  `attention_mask` (S, columns) and `past_key_values` a `_SlotCache`: per layer a key and a
  value tensor (S, kv heads, max_length, head dim) allocated once (a transformers
  `CacheLayerMixin`), where row r's token at position p sits in column p. A row attends to
  columns 0..p and nothing else (the mask), so a slot's stale columns from its previous sample
  are never read, and the cache never needs compacting: a row's columns are its positions;
- when a row ends (eos or its budget) its slot takes the next pending prompt (continuous
  batching), so no row waits for the longest in its batch;
- prompts are control codes, a few distinct ones: the keys and values of a prompt's tokens but
  the last come from one forward of the model per distinct prompt (`_Refill`), copied into
  the slot's columns 0..P-2; the slot feeds its last prompt token in the batched step;
- top-k / top-p / temperature act on the k largest logits (`torch.topk`): the distribution
  HF's warpers give (temperature → top-k → top-p, `sample_next`), on 50 values a row
  instead of the whole vocabulary.

The first step of every `sample` checks the loop against the model itself: the logits the
cached step gives its first row must be those of the plain forward of that row's prompt, else
`FastDecodeError` (a family whose forward reads positions or masks in a way the loop does not
feed stops there, instead of sampling from a wrong distribution).

`torch.compile` is not used: compiling the GPT-2 step (dynamic shapes) took 6.5 minutes
before the first step on this project's 2 busy cores and then decoded ~1.25x faster
(docs/benchmarks.md, "Measured once, by hand"): the step is bound by its matmuls, the vocabulary projection
alone a quarter of it, so it pays only for generations of over ~30 minutes, per process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, get_layer_types_and_kwargs

from pipeline.models.base import model_positions


class FastDecodeError(ValueError):
    """The fast engine cannot decode this model; the message names it and the fix."""


_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def fast_decode_problem(config_or_model, max_length: int | None = None) -> str | None:
    """Why `sample` cannot decode this model (None: it can), from its config alone (or a
    model), so that a run can refuse it before any stage. `max_length`: the longest sequence
    the run decodes (a sliding window shorter than it is refused: the loop attends to every
    column of a row)."""
    config = getattr(config_or_model, "config", config_or_model)
    kind = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False):
        return f"{kind!r} is an encoder-decoder model; the fast engine decodes causal LMs"
    if isinstance(config_or_model, torch.nn.Module):
        model_class = type(config_or_model)
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        except KeyError:
            return f"{kind!r} has no causal-LM class in transformers"
    if getattr(model_class, "_is_stateful", False) or not model_class._supports_default_dynamic_cache():
        return f"{kind!r} ({model_class.__name__}) keeps a recurrent state, not a key/value cache"
    text = config.get_text_config(decoder=True)
    if getattr(text, "add_cross_attention", False):
        return f"{kind!r} is configured with cross-attention (add_cross_attention=True)"
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    except (AttributeError, TypeError, ValueError) as e:
        return f"{kind!r}'s layer types cannot be read ({e})"
    if other := sorted(set(layer_types) - _ATTENTION_LAYERS):
        return f"{kind!r} has layers of type {', '.join(other)} (the fast engine runs attention layers only)"
    windows = [kw["sliding_window"] for kw in layer_kwargs if kw.get("sliding_window")]
    if max_length is not None and windows and min(windows) < max_length:
        return (f"{kind!r} attends over a sliding window of {min(windows)} tokens, shorter than "
                f"max_length={max_length} (or lower generate.max_length to {min(windows)})")
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


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values, (S, kv heads, max_length, head dim) each, allocated once:
    row r's token at position p is written to column p (`_SlotCache.positions`), and the layer
    returns columns 0..span-1, which the model's attention reads under our mask."""

    is_sliding = False

    def __init__(self, owner: _SlotCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner, self.keys, self.values = owner, keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated in __init__: the prefix cache is copied in before the first forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states (S, kv heads, 1, D): one token a row, each at its own position
        rows, columns, span = self.owner.rows, self.owner.positions, self.owner.span
        self.keys[rows, :, columns] = key_states[:, :, -1]
        self.values[rows, :, columns] = value_states[:, :, -1]
        return self.keys[:, :, :span], self.values[:, :, :span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.span, 0  # the mask's columns: those `update` returns

    def get_seq_length(self) -> int:
        # The query's offset in transformers' causal mask: the last column, so that causality
        # hides nothing and our 2-D mask alone says which columns each row reads.
        return self.owner.span - 1

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _SlotCache(Cache):
    """The rows' key/value cache handed to the model's forward as `past_key_values`. Before
    each forward, `at(positions)` says where each row writes (its position) and how many
    columns the step reads (`span`, one past the deepest row)."""

    def __init__(self, shapes: list[tuple[int, int, int]], rows: int, max_length: int, dtype, device):
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.rows = torch.arange(rows, device=device)
        self.span = 1
        zeros = lambda heads, dim: torch.zeros(rows, heads, max_length, dim, dtype=dtype, device=device)
        super().__init__(layers=[_SlotLayer(self, zeros(h, dk), zeros(h, dv)) for h, dk, dv in shapes])

    def at(self, positions: torch.Tensor) -> None:
        self.positions, self.span = positions, int(positions.max()) + 1

    def keep(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        self.rows = torch.arange(len(rows), device=rows.device)


def _kv_shapes(model) -> list[tuple[int, int, int]]:
    """(kv heads, key dim, value dim) of each layer's cache, read off one token through the
    model's own forward and cache (no per-family arithmetic on head counts)."""
    device = next(model.parameters()).device
    cache = DynamicCache()
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
    shapes = []
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "keys", None) is None or layer.keys.dim() != 4:
            raise FastDecodeError(f"{model.config.model_type!r}'s layer {i} keeps no key/value cache the fast "
                                  "engine can hold; set generate.engine=hf")
        shapes.append((layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3]))
    return shapes


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
    cache: _SlotCache

    def keep(self, rows: torch.Tensor) -> None:
        """Only `rows` stay (the rest are idle): later steps compute nothing for them."""
        for name in ("tokens", "n_tokens", "fed", "limit"):
            setattr(self, name, getattr(self, name)[rows])
        kept = rows.tolist()
        self.sample = [self.sample[r] for r in kept]
        self.prompt_len = [self.prompt_len[r] for r in kept]
        self.cache.keep(rows)


def _empty_slots(model, slots: int, max_length: int) -> _Slots:
    param = next(model.parameters())
    zeros = lambda: torch.zeros(slots, dtype=torch.long, device=param.device)
    return _Slots(tokens=torch.zeros(slots, max_length, dtype=torch.long, device=param.device),
                  n_tokens=zeros(), fed=zeros(), limit=zeros(), sample=[-1] * slots, prompt_len=[1] * slots,
                  cache=_SlotCache(_kv_shapes(model), slots, max_length, param.dtype, param.device))


def _forward_one(model, slots: _Slots) -> torch.Tensor:
    """Feed each row its next token (at position `fed`) through the model's forward, which
    writes its keys and values into the cache; the next-token logits (S, V)."""
    rows = slots.cache.rows
    slots.cache.at(slots.fed)
    columns = torch.arange(slots.cache.span, device=slots.fed.device)
    visible = (columns <= slots.fed.unsqueeze(1)).long()  # (S, span): a row reads its own positions only
    out = model(input_ids=slots.tokens[rows, slots.fed].unsqueeze(1), position_ids=slots.fed.unsqueeze(1),
                attention_mask=visible, past_key_values=slots.cache, use_cache=True)
    return out.logits[:, -1]  # (S, V)


@torch.no_grad()
def sample(model, prompts: list[list[int]], budgets: list[int], *, eos: int, slots: int, max_length: int,
           top_k: int, top_p: float, temperature: float, no_repeat_ngram_size: int = 0,
           ) -> Iterator[list[tuple[int, list[int], bool]]]:
    """Sample a continuation of each prompt, at most `budgets[i]` new tokens, stopping at eos,
    with `slots` rows decoded at a time. Yields after every step the rows that ended in it:
    (prompt index, new tokens without the eos, whether eos ended it). Draws from torch's
    global generator: seed it for a reproducible run (the order of prompts fixes the rest).
    Raises FastDecodeError for a model it cannot decode (`fast_decode_problem`), or whose
    first cached step is not its plain forward.
    """
    if problem := fast_decode_problem(model, max_length):
        raise FastDecodeError(f"generate.engine=fast cannot decode this model: {problem}; set generate.engine=hf")
    assert all(len(p) + b <= max_length for p, b in zip(prompts, budgets)), "the caller caps budgets"
    if not prompts:
        return
    state = _empty_slots(model, min(slots, len(prompts)), max_length)
    refill = _Refill(model, prompts, budgets)
    for slot in range(len(state.sample)):
        refill(state, slot)
    logits = _forward_one(model, state)
    _check_first_step(model, logits[0], refill.last_logits[tuple(prompts[state.sample[0]])])
    while True:
        ended = _step(model, state, eos, top_k, top_p, temperature, no_repeat_ngram_size, logits)
        logits = None
        for slot, _ in ended:
            refill(state, slot)
        yield [row for _, row in ended]
        busy = [s for s, i in enumerate(state.sample) if i >= 0]
        if not busy:
            return
        if len(busy) <= len(state.sample) // 2:  # idle rows would cost as much as busy ones
            state.keep(torch.tensor(busy, device=state.fed.device))


def _check_first_step(model, got: torch.Tensor, want: torch.Tensor) -> None:
    """The cached step's logits for a prompt's last token against the plain forward's (V,):
    equal to float rounding when the loop feeds the model as its own forward expects."""
    # fp32 rounding of a batched against a single forward: ~1e-7 of the logits' size in the
    # tests' tiny models, while a row one position off moved a random tiny Llama's by 1.6e-3
    # of it; bf16/fp16 weights round to ~1e-2, so there the check catches gross errors only.
    scale = 1e-4 if want.dtype == torch.float32 else 1e-1
    error = float((got.float() - want.float()).abs().max())
    if error > scale * (1.0 + float(want.float().abs().max())):
        raise FastDecodeError(
            f"generate.engine=fast decodes this {model.config.model_type!r} model wrongly: its first cached step's "
            f"logits differ from the model's own forward by {error:.3g}; set generate.engine=hf (and report it)")


@torch.no_grad()
def steady_steps(model, rows: int, position: int, steps: int, *, max_length: int, top_k: int, top_p: float,
                 temperature: float, no_repeat_ngram_size: int = 0) -> None:
    """`steps` decode steps of `rows` rows that all sample, from `position` on (clamped to leave
    room in max_length and the model's positions): `sample`'s steady state once its rows have
    reached that depth, every step attending over `position` keys or more. What `dpdistill
    plan` times (pipeline/timing.py); the tokens and cached keys are random or zero: their
    values cost nothing."""
    config = model.config.get_text_config(decoder=True)
    n_positions = model_positions(config, unlimited=max_length)
    position = max(0, min(position, min(max_length, n_positions) - steps - 1))
    state = _empty_slots(model, rows, max_length)
    state.tokens.random_(0, config.vocab_size)
    state.fed.fill_(position)
    state.n_tokens.fill_(position + 1)
    state.limit.fill_(max_length)
    state.sample = list(range(rows))
    for _ in range(steps):
        _step(model, state, -1, top_k, top_p, temperature, no_repeat_ngram_size)


class _Refill:
    """Gives a free slot the next pending prompt, its keys and values already in the cache.

    Prompts are control codes: a few distinct ones, each drawn many times. The keys and values
    of a prompt's tokens but the last come from one plain forward of the prompt (`_prefix`),
    once per distinct prompt, copied into each slot that takes it; the slot then feeds the
    last prompt token in the batched step, whose logits give the first sampled token (and
    must equal that forward's last logits: `last_logits`, `_check_first_step`). Without this,
    feeding ~25 prompt tokens one at a time took a quarter of the decode steps of the demo's
    ~70-token samples."""

    def __init__(self, model, prompts: list[list[int]], budgets: list[int]):
        self.model, self.prompts, self.budgets = model, prompts, budgets
        self.pending = iter(range(len(prompts)))
        self.prefixes: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.last_logits: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, state: _Slots, slot: int) -> None:
        i = next(self.pending, -1)
        state.sample[slot] = i
        if i < 0:  # nothing left: the slot idles, feeding one token at position 0
            state.tokens[slot, 0], state.n_tokens[slot], state.fed[slot], state.limit[slot] = 0, 1, 0, 1
            return
        prompt = self.prompts[i]
        n = len(prompt) - 1
        for layer, (k, v) in zip(state.cache.layers, self._prefix(tuple(prompt))):
            layer.keys[slot, :, :n] = k
            layer.values[slot, :, :n] = v
        state.prompt_len[slot] = len(prompt)
        state.tokens[slot, : len(prompt)] = torch.tensor(prompt, device=state.tokens.device)
        state.n_tokens[slot] = len(prompt)
        state.fed[slot] = n
        state.limit[slot] = len(prompt) + self.budgets[i]

    def _prefix(self, prompt: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values (kv heads, P-1, D) of the prompt's tokens but the last."""
        if prompt not in self.prefixes:
            device = next(self.model.parameters()).device
            cache = DynamicCache()
            ids = torch.tensor([prompt], device=device)
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
            n = len(prompt) - 1
            self.prefixes[prompt] = [(layer.keys[0, :, :n].clone(), layer.values[0, :, :n].clone())
                                     for layer in cache.layers]
            self.last_logits[prompt] = out.logits[0, -1]
        return self.prefixes[prompt]


def _step(model, state: _Slots, eos: int, top_k: int, top_p: float, temperature: float, no_repeat_ngram_size: int,
          logits: torch.Tensor | None = None) -> list[tuple[int, tuple[int, list[int], bool]]]:
    """One token through every row (`logits`: this step's forward, when the caller ran it);
    rows that have fed their whole sequence sample the next one. Returns the (slot, (prompt
    index, new tokens, finished)) of the rows that ended."""
    if logits is None:
        logits = _forward_one(model, state)  # (S, V)
    state.fed += 1
    idle = torch.tensor([i < 0 for i in state.sample], device=state.fed.device)
    state.fed.masked_fill_(idle, 0)  # idle slots feed their one token again, harmlessly
    rows = ((state.fed == state.n_tokens) & ~idle).nonzero().squeeze(1)  # (R,) rows that sample now
    if len(rows) == 0:
        return []
    if len(rows) < len(logits):  # at the tail (idle rows); indexing all rows copied (S, V) for nothing
        logits = logits.index_select(0, rows)  # (R, V)
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
