"""Can the run's models go through every stage as configured? Checked before any stage runs.

    problems = model_problems(cfg)   # [] when they can
    require_models(cfg)              # or one PreflightError naming every problem and its fix

pipeline/preflight.py checks that the models exist without importing torch; this reads their
configs and builds each on the meta device (no weights read, no memory), untied and wrapped as
the DP-SGD stage will, and asks the code that will run it: the clipping mode, on every layer and
through one traced forward and one DP-SGD step on the meta device
(pipeline/privacy/clipping_modes.py), bitfit for bias terms, the fast decode engine for the
teacher, one tokenizer for teacher and student (the KL and the evaluation compare their
tokens), the teacher's positions for `teacher.max_length`. A model the user chose is refused
here, naming the module, its class and the settings that can run it (a clipping mode that clips
it exactly, or none), never minutes later by an error from inside a stage (issues 35, 62).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import PipelineConfig, TeacherConfig
from pipeline.methods import method_spec
from pipeline.models import decoding
from pipeline.models.base import (BUILTIN_PREFIX, load_tokenizer, model_positions, same_tokenizer, shipped_path,
                                  untie_lm_head)
from pipeline.preflight import PreflightError
from pipeline.privacy.clipping_modes import MODES, advice, mode_problems
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
    if t.unties_head:
        untie_lm_head(model)
    try:  # bitfit without biases, LoRA target modules the model lacks
        model = prepare_trainable(model, t)
    except TeacherError as e:
        return [f"{field} {name!r}: {e}"]
    return clipping_problems(field, name, model, t)


def clipping_problems(field: str, name: str, model: torch.nn.Module, t: TeacherConfig) -> list[str]:
    """What `t.grad_sample_mode` cannot clip exactly in `model` (as the DP-SGD stage will wrap it),
    in one line with a mode that can, or none. The other modes are checked only to advise, and
    only those the config allows beside `t`'s settings (ghost and hooks need lm_head untied)."""
    mode = t.grad_sample_mode
    problems = mode_problems(model, [mode])[mode]
    if not problems:
        return []
    others = [m for m in MODES if m != mode and (t.untie_lm_head or m == "bk")]
    found = mode_problems(model, others) if others else {}
    clipping = "book-keeping clipping" if mode == "bk" else f"Opacus' {mode} clipping"
    clipping += f" (teacher.grad_sample_mode={mode})"
    more = f" (and {len(problems) - MAX_NAMED} more)" if len(problems) > MAX_NAMED else ""
    return [f"{field} {name!r}: {clipping} cannot train {'; '.join(problems[:MAX_NAMED])}{more}; "
            f"{advice(found, mode)}"]


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
