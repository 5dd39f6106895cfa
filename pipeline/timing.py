"""What one step of each stage costs on this machine: the measurements behind `dpdistill plan`'s time.

    timer = StepTimer(cfg, Runtime.from_config(cfg))
    timer.teacher_step("builtin:teacher", records=128, length=128)   # seconds of one logical DP step

Each model is built from its config with random weights, in the run's precision (fp32 master
weights for training, the run's dtype for inference), on the run's device, with the run's
thread count, and fed random token ids (public: timing never touches a private record). The
code timed is the stages' own: the DP step goes through the same Opacus engine and clipping
function (`teacher.CLIPPING`), distillation through `distillation_loss` and AdamW.

A full-size step of a real model takes seconds on a CPU, so a shape is first timed on a few
sequences (`PROBE_SEQUENCES`); when that predicts a cheap full step, the full batch is timed
too (tiny models, where fixed per-call costs dominate), otherwise the cost is scaled by the
batch (large models, where it is linear in the sequences). The fastest of a few repeats
counts (the first also pays one-off costs): another process's burst of work only ever slows
one down. No Prefect here.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from pipeline.batching import lm_batch
from pipeline.config import PipelineConfig
from pipeline.devices import Runtime, adamw
from pipeline.models import decoding
from pipeline.models.base import (BUILTIN_PREFIX, causal_lm_from_config, model_positions, shipped_path, tiny_gpt2,
                                  untie_lm_head)
from pipeline.models.losses import TopKLogits
from pipeline.models.scoring import nll_by_owner
from pipeline.privacy import noise
from pipeline.stages.distill import step_loss
from pipeline.privacy.dpsgd import CLIPPING, make_private
from pipeline.models.losses import per_sequence_loss
from pipeline.stages.teacher.trainable import prepare_trainable
from pipeline.tokenized import ListIds

PROBE_SEQUENCES = 4  # sequences of a first, cheap timing of each shape on a CPU
TEACHER_PROBE_SEQUENCES = 16  # the DP step's probe: 4 priced the demo teacher's step 1.35x its run (below)
FULL_BATCH_SECONDS = 0.25  # a shape predicted to run faster than this is timed at its real batch too
REPEATS = 3  # calls per shape; the fastest counts (the first also pays one-off costs: allocation, lazy imports)
NEW_TOKENS_TIMED = 16  # generation: new tokens whose time, less one token's, gives the cost of a new token


def spread(values: list[int], b: int) -> list[int]:
    """`b` of `values`, sorted, at evenly spread quantiles (the (2i+1)/2b-th): a batch of b as a
    run's will typically be, its longest near the expected longest of b draws."""
    ordered = sorted(values)
    return [ordered[(2 * i + 1) * len(ordered) // (2 * b)] for i in range(b)]


class StepTimer:
    """Times the configured models' steps; models are built once and reused across stages."""

    def __init__(self, cfg: PipelineConfig, runtime: Runtime, say: Callable[[str], None] | None = None,
                 clock: str = "wall", repeats: int = REPEATS):
        """`clock`: 'wall' (what a run will take on this machine as busy as it is now) or 'cpu'
        (this process's CPU seconds: the same on an idle machine, and steady under load, which
        tests that compare it with a stage's own CPU seconds need)."""
        self.cfg, self.runtime, self.say, self.clock = cfg, runtime, say or (lambda line: None), clock
        self.repeats = repeats
        self._models: dict[tuple, object] = {}  # models, and the DP model with its optimizer
        self._timed: dict[tuple, float] = {}
        self.wall_seconds = self.cpu_seconds = 0.0  # of the fastest repeats: how busy the machine is
        self.threads = runtime.apply_threads()  # the run's threads: a step's cost depends on them

    def cpu_share(self) -> float | None:
        """CPU seconds the timed steps got per wall second and thread asked for: ~1 on an idle
        CPU (less where threads contend for cores), lower when other processes take the cores."""
        if self.runtime.device.type != "cpu" or self.wall_seconds <= 0:
            return None
        return self.cpu_seconds / (self.wall_seconds * self.threads)

    # --- models -------------------------------------------------------------------------

    def _build(self, name: str) -> torch.nn.Module:
        """Random weights of the configured shape, fp32 (the run trains fp32 master weights)."""
        b = self.cfg.base_models
        if name.startswith(BUILTIN_PREFIX) and b.corpus is not None:  # built by the run: its spec is the shape
            spec = getattr(b, name[len(BUILTIN_PREFIX):])
            return tiny_gpt2(spec, b.vocab_size, b.context_length, eos_id=0)
        return causal_lm_from_config(shipped_path(name), dtype=torch.float32)

    def model(self, name: str, inference: bool = False) -> torch.nn.Module:
        """The training copy (fp32) or the inference copy (the run's dtype, as the stages load it)."""
        key = (name, inference and self.runtime.dtype != torch.float32)
        if key not in self._models:
            if key[1]:
                self._models[key] = copy.deepcopy(self.model(name)).to(self.runtime.dtype).eval()
            else:
                self.say(f"plan: building {name} with random weights ({self.runtime.precision}, {self.runtime.device})")
                self._models[key] = self._build(name).to(self.runtime.device)
        return self._models[key].train(not inference)

    def _ids(self, model, batch: int, length: int) -> torch.Tensor:
        length = min(length, model_positions(model.config))
        return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0)).to(
            self.runtime.device)

    def _batch(self, model, batch: int, length: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Inputs and labels as the stages build them (`lm_batch`: attention mask and position
        ids too), so that a probe runs the code path the stage runs."""
        ids = self._ids(model, batch, length).cpu()
        inputs = lm_batch(ids, torch.full((batch,), ids.shape[1]))
        labels = inputs.pop("labels").to(self.runtime.device)  # (B, L-1)
        return {k: v.to(self.runtime.device) for k, v in inputs.items()}, labels

    # --- timing -------------------------------------------------------------------------

    def _fastest(self, fn: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
        """The fastest of `repeats` runs of fn (after `setup`, untimed, before each)."""
        # The run's threads again: a stage run in this process since (a test's, or a caller's)
        # may have set others, and a step on two threads costs ~1.5-3x the CPU seconds of one.
        self.runtime.apply_threads()
        sync = torch.cuda.synchronize if self.runtime.device.type == "cuda" else (lambda: None)
        best = (float("inf"), float("inf"))
        for _ in range(self.repeats):
            if setup is not None:
                setup()
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
        self.wall_seconds += best[0]
        self.cpu_seconds += best[1]
        return best[1] if self.clock == "cpu" else best[0]

    def _once(self, key: tuple, measure: Callable[[], float]) -> float:
        """A shape's seconds, timed once however many stages ask (validation and evaluation
        batches share shapes)."""
        if key not in self._timed:
            self._timed[key] = measure()
        return self._timed[key]

    def _scaled(self, seconds_of: Callable[[int], float], batch: int, probe: int = PROBE_SEQUENCES) -> float:
        """Seconds of `seconds_of(batch)`, timed at the real batch when that is cheap (always on
        a GPU, whose time is flat in small batches), else scaled from `probe` sequences."""
        probe = batch if self.runtime.device.type == "cuda" else min(batch, probe)
        seconds = seconds_of(probe)
        if probe == batch:
            return seconds
        if seconds * batch / probe <= FULL_BATCH_SECONDS:
            return seconds_of(batch)
        return seconds * batch / probe

    def forward(self, name: str, batch: int, length: int) -> float:
        """Seconds of one no-grad forward of batch × length in the inference dtype (generation's
        logit passes, evaluation, code adherence); none to run (an empty split) costs nothing."""
        if batch < 1:
            return 0.0
        model = self.model(name, inference=True)

        def seconds(b: int) -> float:
            inputs, _ = self._batch(model, b, length)
            with torch.no_grad():
                return self._once(("forward", name, b, length), lambda: self._fastest(lambda: model(**inputs)))
        return self._scaled(seconds, batch)

    def score(self, name: str, batch: int, length: int) -> float:
        """Seconds of scoring batch × length tokens in the inference dtype: the stages' own
        `scoring.nll_by_owner` (a forward and each token's NLL over the vocabulary: evaluation's
        perplexity, code adherence, the distillation's validation and selection, the teacher's
        monitor). The NLL is a quarter of a demo evaluation batch; `forward` alone priced the
        demo's evaluation at 0.73 of its run."""
        if batch < 1:
            return 0.0
        model = self.model(name, inference=True)

        def seconds(b: int) -> float:
            ids = self._ids(model, b, length).cpu()
            data = ListIds(ids.tolist(), 0)
            return self._once(("score", name, b, length),
                              lambda: self._fastest(lambda: nll_by_owner(model, data, [0] * b, 1, b)))
        return self._scaled(seconds, batch)

    def teacher_step(self, name: str, records: float, length: int) -> float:
        """Seconds of one logical DP-SGD step over `records` (expected) sequences, as the stage
        runs it: physical batches of forward and clipped backward whose optimizer steps are
        skipped (Opacus accumulates the clipped sums), then one update (the noise from the run's
        kind of generator, the scaling, AdamW). The update is timed apart because it is paid
        once a step whatever the batch: with secure_mode's ChaCha20 noise it is seconds for a
        large model, and timing it with every pass counted it once per physical batch."""
        dp_model, optimizer, clip = self._dp_model(name)
        shape = self.model(name)  # Opacus' wrapper hides the config

        def backward(batch: dict, labels: torch.Tensor) -> None:
            with self.runtime.autocast():
                logits = dp_model(**batch).logits  # (B, L, V)
            clip(dp_model, optimizer, per_sequence_loss(logits, labels))  # (B,)

        def step(skip: bool) -> None:
            optimizer.signal_skip_step(do_skip=skip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def one_pass(b: int) -> float:
            inputs = self._batch(shape, b, length)
            return self._fastest(lambda: (backward(*inputs), step(skip=True)))

        physical = self.cfg.teacher.physical_batch_size
        # The probe: since the stages reuse freed memory (devices.reuse_freed_memory), a
        # 32-sequence pass no longer pays to fault its large tensors in, and the demo teacher's
        # step priced from 4 sequences came out 7.1-7.4 s against 5.1-5.4 s from 32 and 5.3-5.5
        # from 16 (2 threads, idle, 2026-11-24; the run stepped 5.3 s). 16 costs ~2 s of plan.
        passes = records / physical * self._scaled(one_pass, min(physical, max(1, round(records))),
                                                   TEACHER_PROBE_SEQUENCES)
        one = self._batch(shape, 1, length)
        update = self._fastest(lambda: step(skip=False), setup=lambda: backward(*one))
        return passes + update

    def _dp_model(self, name: str):
        """The model behind the run's Opacus engine and clipping mode, on random public ids."""
        key = ("dp", name)
        if key in self._models:
            return self._models[key]
        t = self.cfg.teacher
        model = copy.deepcopy(self.model(name))
        if t.untie_lm_head:
            untie_lm_head(model)
        model = prepare_trainable(model, t).to(self.runtime.device).train()
        optimizer = adamw([p for p in model.parameters() if p.requires_grad], t.learning_rate, t.weight_decay)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2, dtype=torch.long)),
                                             batch_size=4)
        _, dp_model, dp_optimizer, _ = make_private(  # the stage's own wiring: this noise only costs time
            t, model, optimizer, loader, sigma=1.0,
            noise_generator=noise.generator("noise", secure=t.secure_mode, device=self.runtime.device))
        self._models[key] = (dp_model, dp_optimizer, CLIPPING[t.grad_sample_mode])
        return self._models[key]

    def distill_step(self, student: str, teacher: str | None, lengths: list[int], prompt: int) -> float:
        """Seconds of one distillation step over a batch of samples of `lengths` tokens: the
        stage's own `step_loss` (the models in `distill.length_groups` passes, the heads and
        losses on the real tokens only), the backward, clipping and AdamW. `teacher` None: no
        teacher forward (a top-k cache's logits, read from memory, or no KL). A probe of a few
        of the lengths, spread over them, runs in proportionally fewer groups (one, padded to
        its longest), so that scaling it keeps the batch's number of passes. (Tried and
        reverted, 2026-11-24: the batch's middle length group as the probe. Where most samples
        reach max_length, as the demo's, that group is all full-length, and the demo's
        distillation was planned ~1.6x its run, against 1.25x with this probe.)"""
        d = self.cfg.distill
        s_model = self.model(student)
        t_model = self.model(teacher, inference=True) if teacher else None
        optimizer = adamw(s_model.parameters(), d.learning_rate, d.weight_decay)
        vocab, batch = s_model.config.vocab_size, len(lengths)

        def seconds(b: int) -> float:
            part = spread(lengths, b)
            cfg = d.model_copy(update={"length_groups": max(1, round(d.length_groups * b / batch)),
                                       **({} if teacher else {"alpha": 0.0, "beta": 0.0})})
            ids = self._ids(s_model, b, max(part))
            lens, skip = torch.tensor(part).clamp(max=ids.shape[1]), torch.full((b,), prompt)  # the models' positions
            k = d.teacher_top_k or 1
            cached = None if teacher else TopKLogits(  # as the stage reads them from a top-k cache
                torch.zeros(b, ids.shape[1] - 1, k, dtype=torch.long, device=ids.device),
                torch.zeros(b, ids.shape[1] - 1, k, device=ids.device), torch.zeros(b, ids.shape[1] - 1, device=ids.device))

            def step():
                parts = step_loss(cfg, t_model, vocab, s_model, None, cached, ids, lens, skip, self.runtime)
                parts.loss.backward()
                torch.nn.utils.clip_grad_norm_(s_model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # Candidates that differ only in α or the KL's tokens step alike: timed once.
            return self._once(("distill", student, teacher, tuple(part), prompt, cfg.length_groups),
                              lambda: self._fastest(step))
        return self._scaled(seconds, batch)

    def generate_batch(self, name: str, batch: int, prompt: int, new_tokens: int, longest: int | None = None) -> float:
        """Seconds of one sampled batch of `batch` prompts × new tokens with the run's engine
        (`generate.engine`: our KV-cache loop, or transformers' `generate`) and sampling
        settings: the prompt pass plus one new token timed, and the cost of each further token.
        For `generate`, that is the difference to `NEW_TOKENS_TIMED` more, scaled to `new_tokens`.
        (The plan timed `generate` for both engines until 2026-11-23, ~3x over the fast engine's
        runs; a difference over 2 new tokens gave 0.5-20 ms a token where 16 give 19-21 ms.) Our
        loop's rows run at mixed depths and each step attends as far as its deepest row, a typical
        batch's `longest` new tokens past the prompt (default `new_tokens`): its token cost is timed
        there (`decoding.steady_steps`). Timed after the prompt, it came out 13.8 ms a step against
        the demo run's 18.9 (64 rows, 2 idle threads; 13.3 ms at 20 keys, 17.4 at 127)."""
        g = self.cfg.generate
        model = self.model(name, inference=True)
        ids = self._ids(model, batch, prompt)
        few = min(new_tokens, 1 + NEW_TOKENS_TIMED)
        engine_fast = g.engine == "fast" and decoding.fast_decode_problem(model) is None

        def call(n: int):
            if engine_fast:  # the stage's engine: `batch` rows of the KV-cache loop, none ending early
                for _ in decoding.sample(model, [ids[0].tolist()] * batch, [n] * batch, eos=-1, slots=batch,
                                         max_length=g.max_length, top_k=g.top_k, top_p=g.top_p,
                                         temperature=g.temperature, no_repeat_ngram_size=g.no_repeat_ngram_size):
                    pass
                return
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=g.top_k,
                               top_p=g.top_p, temperature=g.temperature, max_new_tokens=n, min_new_tokens=n,
                               no_repeat_ngram_size=g.no_repeat_ngram_size or None, use_cache=True,
                               pad_token_id=0)
        def timed(n: int) -> float:  # the selection's samples share generation's shape
            return self._once(("generate", name, batch, prompt, n), lambda: self._fastest(lambda: call(n)))
        first = timed(1)
        if new_tokens == 1:
            return first
        if not engine_fast:
            return first + (new_tokens - 1) * max(timed(few) - first, 0.0) / max(few - 1, 1)
        depth = prompt + (new_tokens if longest is None else longest) - few

        def steps() -> None:
            decoding.steady_steps(model, batch, depth, few, max_length=g.max_length, top_k=g.top_k, top_p=g.top_p,
                                  temperature=g.temperature, no_repeat_ngram_size=g.no_repeat_ngram_size)
        per_token = self._once(("steady", name, batch, depth, few), lambda: self._fastest(steps)) / few
        return first + (new_tokens - 1) * per_token

