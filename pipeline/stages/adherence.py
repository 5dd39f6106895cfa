"""Does the DP teacher recognise in its text the code it was prompted with? Code adherence.

For each of the first `n` synthetic training samples and each code column c with two or
more declared values V_c, the teacher scores the sample's continuation (the tokens it wrote
after the prompt, EOS included when it stopped) under the prompt built as generation builds
it (`PromptFormat.ids`), with column c set to each v in V_c and the other columns as requested:

    score(v) = log p(continuation | prompt with c = v)

The continuation is the same for every candidate, so the scores compare; the sample
"adheres" on c when the requested value scores strictly highest (a tie does not count).
Chance is 1/|V_c|: a teacher that ignores its codes lands near it.

What it measures (`MEASURES`): whether the DP teacher, which wrote the text, recognises in it
the code it was prompted with. A judge that wrote the text can recognise its own quirks in
text no reader would tell apart: on a news corpus this read 0.48-0.68 (chance 0.25) while a
classifier trained on the same text was at chance on real text (issue 37). Whether the text
carries what distinguishes the codes in real text is the downstream classifier's question
(pipeline/stages/downstream.py).

Cost: about sum_c |V_c| teacher forward passes per sample (candidates are batched).

Privacy: this reads the DP teacher, the synthetic shards and the declared or released code
values only, never a private record: post-processing of DP releases, no privacy cost.

    values = declared_values(cfg.data, cfg.control_codes.domain, codes_path)
    result = code_adherence(model, tok, synthetic_dir, values, n=500, batch_size=16)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.batching import IGNORE, TokenizedRecords, lm_batch
from pipeline.config import DataConfig
from pipeline.models.base import model_positions
from pipeline.models.losses import next_token_nll
from pipeline.prompts import HEADER, PromptFormat
from pipeline.records import CODE_JOINER, read_control_codes
from pipeline.stages.generate import synthetic_head

MEASURES = ("whether the DP teacher, which wrote the text, recognises in it the code it was prompted with "
            "(not whether the text carries what distinguishes the codes in real text: the downstream classifier)")


class AdherenceError(ValueError):
    """The synthetic shards do not fit the declared code values; the message says which sample and column."""


@dataclass(frozen=True)
class SampleOutcome:
    """One scored sample: the value it requested per scored column, and whether that value won."""

    requested: dict[str, str]
    won: dict[str, bool]
    sample_id: int | None = None


def _value_of(template: str, column: str, part: str) -> str:
    """The value inside one code part written with `template` ('{column}: {value}' -> 'red'),
    or the part itself when the template cannot be undone (it is still a distinct name)."""
    pieces = template.format(column=column, value="\0").split("\0")
    if len(pieces) == 2 and part.startswith(pieces[0]) and part.endswith(pieces[1]) \
            and len(part) > len(pieces[0]) + len(pieces[1]):
        return part[len(pieces[0]) : len(part) - len(pieces[1])]
    return part


def declared_values(data: DataConfig, domain: dict[str, list[str]] | None,
                    control_codes_path: Path | None) -> dict[str, dict[str, str]]:
    """Per code column, in prompt order: {value: its code part as prompts write it}.

    The declared `control_codes.domain` when there is one; otherwise the values of the
    released code distribution (what generation samples from: the only values it can ask for).
    """
    if domain is not None:
        return {c: {v: data.code_template.format(column=c, value=v) for v in domain[c]} for c in data.code_columns}
    if control_codes_path is None:
        raise ValueError("code adherence needs control_codes.domain or the released control codes")
    values: dict[str, dict[str, str]] = {c: {} for c in data.code_columns}
    for code in sorted(read_control_codes(control_codes_path)):
        parts = code.split(CODE_JOINER)
        assert len(parts) == len(data.code_columns), "the released codes have one part per code column"
        for c, part in zip(data.code_columns, parts):
            values[c][_value_of(data.code_template, c, part)] = part
    return values


def summarize(outcomes: list[SampleOutcome], values: dict[str, list[str]], skipped: int = 0,
              truncated: int = 0) -> dict:
    """The adherence figures from per-sample outcomes (pure: no model, no file).

    `values`: the declared values of each scored column. Per column: `share` of samples whose
    requested value won, `chance` = 1/|V_c|, `n` samples, and per value {share, n} over the
    samples that requested it (share None when none did). `overall`: share of (sample, column)
    pairs won; `all_columns`: share of samples that won on every scored column.
    """
    columns = {}
    for c, vals in values.items():
        mine = [o for o in outcomes if c in o.won]
        per_value = {}
        for v in vals:
            asked = [o.won[c] for o in mine if o.requested[c] == v]
            per_value[v] = {"share": sum(asked) / len(asked) if asked else None, "n": len(asked)}
        columns[c] = {"share": sum(o.won[c] for o in mine) / len(mine) if mine else None,
                      "chance": 1 / len(vals), "n": len(mine), "values": per_value}
    pairs = [w for o in outcomes for w in o.won.values()]
    return {
        "measures": MEASURES,
        "samples": len(outcomes),
        "skipped": skipped,
        "truncated": truncated,
        "columns": columns,
        "overall": sum(pairs) / len(pairs) if pairs else None,
        "all_columns": sum(all(o.won.values()) for o in outcomes) / len(outcomes) if outcomes else None,
    }


@torch.inference_mode()
def _continuation_logprobs(model, sequences: list[tuple[list[int], int]], pad_id: int) -> list[float]:
    """log p(ids[start:] | ids[:start]) of each (ids, start), in one right-padded batch
    (`lm_batch`, as every stage builds its LM inputs), the prompt's targets ignored.
    Logits are upcast to fp32 before the log-softmax (bf16 weights)."""
    device = next(model.parameters()).device
    rows = TokenizedRecords([ids for ids, _ in sequences], pad_id, max(len(ids) for ids, _ in sequences))
    batch = lm_batch(rows.ids, rows.lengths)
    starts = torch.tensor([start for _, start in sequences])
    # Label t predicts token t+1: only continuation tokens (t+1 >= start) are scored.
    in_prompt = torch.arange(1, rows.ids.shape[1]).unsqueeze(0) < starts.unsqueeze(1)  # (B, L-1)
    labels = batch.pop("labels").masked_fill(in_prompt, IGNORE).to(device)  # (B, L-1)
    nll = next_token_nll(model(**{k: v.to(device) for k, v in batch.items()}).logits, labels)  # (B, L-1)
    return (-nll.sum(dim=1)).tolist()


def code_adherence(
    model, tokenizer, synthetic_path: Path, values: dict[str, dict[str, str]], n: int, batch_size: int,
    on_batch: Callable[[int, int], None] | None = None, prompt: PromptFormat = HEADER,
) -> dict:
    """Adherence of the first `n` synthetic training samples (shards in order: deterministic),
    scored by `model` on its device and in its dtype (see the module doc); `summarize`'s dict.
    `on_batch(done, total)` counts the scored sequences (candidates), never a text.

    A sample whose longest candidate prompt plus continuation exceeds the model's positions has
    its continuation cut to fit that prompt, the same tokens for every candidate of every column,
    so its scores still compare (counted in `truncated`); one with no continuation token left
    is counted in `skipped`.
    """
    scored = {c: list(vals) for c, vals in values.items() if len(vals) >= 2}
    outcomes, skipped, truncated = score_samples(model, tokenizer, synthetic_path, values, n, batch_size, on_batch,
                                                 prompt)
    return summarize(outcomes, scored, skipped=skipped, truncated=truncated)


def adherent_samples(model, tokenizer, synthetic_path: Path, values: dict[str, dict[str, str]], n: int,
                     batch_size: int, prompt: PromptFormat = HEADER,
                     on_batch: Callable[[int, int], None] | None = None) -> set[int]:
    """The sample ids of the first `n` synthetic training samples that `model` (the DP teacher)
    recognises as written for their requested code on every scored column: post-processing of
    DP outputs (distill.keep_samples=code_adherent, issue 59 item 4)."""
    outcomes, _, _ = score_samples(model, tokenizer, synthetic_path, values, n, batch_size, on_batch, prompt)
    return {o.sample_id for o in outcomes if all(o.won.values())}


def score_samples(
    model, tokenizer, synthetic_path: Path, values: dict[str, dict[str, str]], n: int, batch_size: int,
    on_batch: Callable[[int, int], None] | None = None, prompt: PromptFormat = HEADER,
) -> tuple[list[SampleOutcome], int, int]:
    """Each scored sample's outcome (`code_adherence` says how), and the samples skipped and truncated."""
    model.eval()
    n_positions = model_positions(model.config)
    columns = list(values)
    scored = {c: list(vals) for c, vals in values.items() if len(vals) >= 2}
    if not scored:  # one declared value per column: nothing to choose between
        return [], 0, 0
    part_to_value = {c: {part: v for v, part in values[c].items()} for c in columns}
    head = synthetic_head(synthetic_path, n, "train", ("sample_id", "control_code", "n_prompt_tokens", "token_ids"))
    prompt_ids: dict[str, list[int]] = {}
    prompt_format = prompt

    def prompt(parts: list[str]) -> list[int]:
        code = CODE_JOINER.join(parts)
        if code not in prompt_ids:  # tokenized exactly as generation tokenizes its prompts
            prompt_ids[code] = prompt_format.ids(tokenizer, code)
        return prompt_ids[code]

    # Every (sample, column, candidate) sequence, then scored in batches of `batch_size`.
    jobs: list[tuple[int, str, list[str]]] = []  # (sample index, column, candidate values)
    sequences: list[tuple[list[int], int]] = []
    requested_values: list[dict[str, str]] = []
    sample_ids: list[int] = []
    skipped = truncated = 0
    for sample_id, code, n_prompt, token_ids in zip(*(head[k].to_pylist() for k in head.column_names)):
        parts = code.split(CODE_JOINER)
        if len(parts) != len(columns):
            raise AdherenceError(f"synthetic sample {sample_id}: its control_code has {len(parts)} part(s) for the "
                                 f"{len(columns)} code columns {columns}; regenerate with this run's data.code_columns")
        requested = {}
        for c, part in zip(columns, parts):
            if part not in part_to_value[c]:
                raise AdherenceError(
                    f"synthetic sample {sample_id}, column {c!r}: requested code {part!r} is not among the declared "
                    "values (control_codes.domain, else the released control codes); the shards were generated "
                    "with other codes: regenerate them with this run's control codes")
            requested[c] = part_to_value[c][part]
        candidates = {c: [prompt(parts[:j] + [values[c][v]] + parts[j + 1:]) for v in scored[c]]
                      for j, c in enumerate(columns) if c in scored}
        continuation = token_ids[n_prompt:]
        room = n_positions - max((len(p) for ps in candidates.values() for p in ps), default=0)
        if room < 1 or not continuation:
            skipped += 1
            continue
        if len(continuation) > room:
            truncated += 1
            continuation = continuation[:room]  # the same cut for every candidate: scores still compare
        index = len(requested_values)
        requested_values.append(requested)
        sample_ids.append(sample_id)
        for c, prompts in candidates.items():
            jobs.append((index, c, scored[c]))
            sequences.extend((p + continuation, len(p)) for p in prompts)

    scores: list[float] = []
    for start in range(0, len(sequences), batch_size):
        scores.extend(_continuation_logprobs(model, sequences[start : start + batch_size], tokenizer.pad_token_id))
        if on_batch:
            on_batch(len(scores), len(sequences))
    won: list[dict[str, bool]] = [{} for _ in requested_values]
    at = 0
    for index, c, candidates in jobs:
        mine = scores[at : at + len(candidates)]
        at += len(candidates)
        best = mine[candidates.index(requested_values[index][c])]
        won[index][c] = all(best > s for v, s in zip(candidates, mine) if v != requested_values[index][c])
    outcomes = [SampleOutcome({c: r[c] for c in scored}, w, i) for r, w, i in zip(requested_values, won, sample_ids)]
    return outcomes, skipped, truncated


def adherence_lines(result: dict) -> list[str]:
    """One line per scored column, for logs: aggregate shares only."""
    return [f"{c}: {col['share']:.3f} (chance {col['chance']:.3f}, {col['n']} samples)"
            for c, col in result["columns"].items() if col["share"] is not None]

