"""What the teacher trains: every weight (`full`), the bias terms (`bitfit`, DP-BiTFiT) or LoRA
adapters (`lora`, peft; merged into the saved checkpoint)."""

from __future__ import annotations

import torch

from pipeline.config import TeacherConfig
from pipeline.privacy.dpsgd import TeacherError


def prepare_trainable(model: torch.nn.Module, cfg: TeacherConfig) -> torch.nn.Module:
    """Freeze what the mode does not train; wrap with LoRA adapters for mode=lora."""
    if cfg.mode == "full":
        return model
    if cfg.mode == "bitfit":
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith(".bias"))
        if not any(p.requires_grad for p in model.parameters()):
            raise TeacherError("teacher.mode=bitfit: the model has no bias terms; use mode=full or lora")
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules=cfg.lora_target_modules,
        fan_in_fan_out=model.config.model_type == "gpt2",  # GPT-2's Conv1D stores W as (in, out)
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise TeacherError(f"teacher.mode=lora: {e}; set teacher.lora_target_modules") from e
