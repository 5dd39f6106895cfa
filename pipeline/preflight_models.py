"""Can the run's models go through every stage as configured? Checked before any stage runs.

    problems = model_problems(cfg)   # [] when they can
    require_models(cfg)              # or one PreflightError naming every problem and its fix

pipeline/preflight.py checks that the models exist without importing torch; this reads their
configs and builds each on the meta device (no weights read, no memory), untied and wrapped as
the DP-SGD stage will, and asks the code that will run it: book-keeping clipping for every
parameterised layer (pipeline/privacy/bk_layers.py), bitfit for bias terms, the fast decode engine for
the teacher, one tokenizer for teacher and student (the KL and the evaluation compare their
tokens), the teacher's positions for `teacher.max_length`. A model the user chose is refused
here, naming the module, its class and the settings that can run it, never minutes later by an
error from inside a stage (issue 35).
"""

from __future__ import annotations

import inspect

import torch
from opacus.utils.module_utils import trainable_modules
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import PipelineConfig, TeacherConfig
from pipeline.methods import method_spec
from pipeline.models import decoding
from pipeline.models.base import (BUILTIN_PREFIX, load_tokenizer, model_positions, same_tokenizer, shipped_path,
                                  untie_lm_head)
from pipeline.preflight import PreflightError
from pipeline.privacy.bk_layers import bk_problems
from pipeline.privacy.dpsgd import TeacherError
from pipeline.stages.teacher.trainable import prepare_trainable

MAX_NAMED = 5  # modules named per model in one message; the count says how many more


def require_models(cfg: PipelineConfig) -> None:
    """Raise one PreflightError listing every problem `model_problems` finds."""
    if problems := model_problems(cfg):
        raise PreflightError(f"pre-flight check of the models failed ({len(problems)} problem(s)): "
                             + "; ".join(problems))


def model_problems(cfg: PipelineConfig) -> list[str]:
    """Every reason the configured models cannot run the configured stages (no weights read)."""
    spec = method_spec(cfg.distill.method)
    teacher = _config(cfg, cfg.teacher.model)
    student = _config(cfg, cfg.distill.student_model)
    problems = []
    if teacher is not None and spec.dp_teacher:
        problems += _dp_sgd_problems("teacher.model", cfg.teacher.model, teacher, cfg.teacher)
        positions = model_positions(teacher, unlimited=cfg.teacher.max_length)
        if cfg.teacher.max_length > positions:
            problems.append(f"teacher.max_length={cfg.teacher.max_length} exceeds the teacher's {positions} "
                            f"positions; set teacher.max_length <= {positions}")
    if student is not None and spec.dp_student:
        problems += _dp_sgd_problems("distill.student_model", cfg.distill.student_model, student, cfg.teacher)
    if teacher is not None and spec.generates and cfg.generate.engine == "fast":
        if problem := decoding.fast_decode_problem(teacher, max_length=cfg.generate.max_length):
            problems.append(f"generate.engine=fast cannot decode teacher.model {cfg.teacher.model!r}: {problem}; "
                            "set generate.engine=hf")
    if (problem := _tokenizer_problem(cfg)) is not None:
        problems.append(problem)
    return problems


def _config(cfg: PipelineConfig, name: str):
    """The model's config, or None for builtin models still to be built from a public corpus
    (GPT-2s of base_models' shapes, which every stage runs)."""
    if name.startswith(BUILTIN_PREFIX) and cfg.base_models.corpus is not None:
        return None
    return AutoConfig.from_pretrained(shipped_path(name))


def _dp_sgd_problems(field: str, name: str, config, t: TeacherConfig) -> list[str]:
    """What DP-SGD cannot train in this model as teacher.mode and teacher.grad_sample_mode say."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError:  # transformers: no causal-LM class for this config (T5, BERT, ...)
        return [f"{field} {name!r} is a {config.model_type!r} model, not a causal language model; "
                "name a decoder-only model (GPT-2, Llama, Qwen2, Mistral, Gemma, ...)"]
    if t.untie_lm_head:
        untie_lm_head(model)
    try:  # bitfit without biases, LoRA target modules the model lacks
        model = prepare_trainable(model, t)
    except TeacherError as e:
        return [f"{field} {name!r}: {e}"]
    if t.grad_sample_mode == "bk":
        problems, clipping = bk_problems(model), "book-keeping clipping (teacher.grad_sample_mode=bk)"
    else:
        problems = [f"{n} ({type(m).__name__}): {why}; use teacher.grad_sample_mode=bk"
                    for n, m in trainable_modules(model) if (why := _opacus_problem(m))]
        clipping = f"Opacus' {t.grad_sample_mode} clipping (teacher.grad_sample_mode={t.grad_sample_mode})"
    if not problems:
        return []
    more = f" (and {len(problems) - MAX_NAMED} more)" if len(problems) > MAX_NAMED else ""
    return [f"{field} {name!r}: {clipping} cannot train {'; '.join(problems[:MAX_NAMED])}{more}"]


def _opacus_problem(module: torch.nn.Module) -> str | None:
    """Why Opacus' hooks (ghost and hooks clipping) cannot wrap this trainable layer. They compute
    per-sample gradients of any layer (functorch for unknown ones), but refuse a layer holding
    buffers (Gemma's scaled embedding), and detach every positional input of the layer, so one
    whose forward takes numbers (OPT's learned positions: a mask and an int offset) fails."""
    if next(module.buffers(), None) is not None:
        return "a trainable layer holding buffers, which Opacus refuses"
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    if any(p.annotation in (int, float, bool, "int", "float", "bool") for p in params):
        return "its forward takes numbers beside tensors, which Opacus' hooks cannot detach"
    return None


def _tokenizer_problem(cfg: PipelineConfig) -> str | None:
    """Teacher and student must share one tokenizer: the KL compares their next-token
    distributions and the evaluation their perplexities over the same tokens."""
    names = [cfg.teacher.model, cfg.distill.student_model]
    if any(n.startswith(BUILTIN_PREFIX) for n in names) and cfg.base_models.corpus is not None:
        return None  # built together, on one tokenizer
    teacher, student = (load_tokenizer(shipped_path(n)) for n in names)
    if same_tokenizer(teacher, student):
        return None
    return (f"teacher.model {names[0]!r} and distill.student_model {names[1]!r} use different tokenizers "
            f"({len(teacher)} and {len(student)} tokens); the KL and the evaluation compare their tokens: "
            "pick a student of the teacher's family (e.g. a smaller model sharing its tokenizer)")
