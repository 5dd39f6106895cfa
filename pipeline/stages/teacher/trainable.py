"""What the teacher trains: every weight (`full`), the bias terms (`bitfit`, DP-BiTFiT) or LoRA
adapters (`lora`, peft; merged into the saved checkpoint).

Keyed on what the layers compute, not on a family's names: LoRA adapts every linear map of the
decoder blocks (peft's "all-linear": attention's q/k/v/o and the MLP's projections, whatever a
family calls them, the output head excluded) unless `teacher.lora_target_modules` names some,
and GPT-2's Conv1D (a linear map stored as (in, out)) is found by its type, wherever it is.
"""

from __future__ import annotations

import torch
from transformers.pytorch_utils import Conv1D

from pipeline.config import TeacherConfig
from pipeline.privacy.dpsgd import TeacherError

ALL_LINEAR = "all-linear"  # peft: every nn.Linear / Conv1D but the output layer


def prepare_trainable(model: torch.nn.Module, cfg: TeacherConfig) -> torch.nn.Module:
    """Freeze what the mode does not train; wrap with LoRA adapters for mode=lora."""
    if cfg.mode == "full":
        return model
    if cfg.mode == "bitfit":
        if not any(name.endswith(".bias") for name, _ in model.named_parameters()):
            raise TeacherError(f"teacher.mode=bitfit trains bias terms only, and this {model.config.model_type} model "
                               "has none (Llama-shaped families use bias-free linear maps and RMSNorm); use "
                               "teacher.mode=lora or full")
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith(".bias"))
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules=cfg.lora_target_modules or ALL_LINEAR,
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),  # Conv1D stores W as (in, out)
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise TeacherError(f"teacher.mode=lora: {e}; set teacher.lora_target_modules") from e
