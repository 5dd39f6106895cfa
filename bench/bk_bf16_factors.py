"""bk with bf16 factors against bk with fp32 factors, on the same bf16 forward (pipeline/privacy/bk.py, point 3).

On a CUDA GPU a linear layer run in bf16 keeps its factors in bf16 and bk's products run on the
16-bit units; the clipped sums are one Triton product each (pipeline/privacy/bk_kernel.py: the
same arithmetic as fp32 factors, so the factors differ from theirs by rounding only, either way),
or, without Triton, the rescaled factor is split into two bf16 terms whose bound is added to each
example's norm (factors smaller by up to the bound). This prints, for a Llama of SmolLM2-135M's
width (random init, head untied): how far the clipped sums are from the fp32 factors'
(relative), how much smaller the clipping factors are (relative), and the largest clipped part
of one example run alone, which must stay within C (to fp32 rounding). On a CPU the split path
is forced (its products upcast: the same arithmetic, for a check without a GPU). Run from the
repository root:

    .venv/bin/python bench/bk_bf16_factors.py                        # CPU, 1 layer: ~40 s
    bash bench/device_run.sh python3 bench/bk_bf16_factors.py --device cuda --layers 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    a = p.parse_args()

    import torch
    import transformers

    from pipeline.batching import lm_batch
    from pipeline.models.base import untie_lm_head
    from pipeline.models.losses import per_sequence_loss
    from pipeline.privacy import bk_layers
    from pipeline.privacy.bk import GradSampleModuleBookKeeping

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=576, num_hidden_layers=a.layers, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True))
    untie_lm_head(model)
    model.to(a.device).train()
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))
    batch = {k: v.to(a.device) for k, v in lm_batch(ids, torch.full((a.batch,), a.seq)).items()}
    labels = batch.pop("labels")

    def clipped(split: bool, clip: float, rows=slice(None)):
        bk_layers.SPLIT_DEVICES = {a.device} if split else set()
        for q in model.parameters():
            q.grad = None
        dp_model = GradSampleModuleBookKeeping(model, max_grad_norm=clip)
        with torch.autocast(a.device, dtype=torch.bfloat16):
            logits = dp_model(**{k: v[rows] for k, v in batch.items()}).logits
        coef = dp_model.backward_clipped(per_sequence_loss(logits, labels[rows]))
        dp_model._close()
        return torch.cat([q.grad.flatten() for q in model.parameters()]).double(), coef

    print(f"Llama {a.layers} x 576, vocabulary {a.vocab}, {a.batch} x {a.seq} tokens, {a.device}, bf16 autocast")
    for clip in (1.0, 1e-3):
        g32, c32 = clipped(False, clip)
        g16, c16 = clipped(True, clip)
        print(f"C = {clip:g}: clipped sums {((g16 - g32).norm() / g32.norm()).item():.2e} apart (relative); "
              f"factors smaller by at most {((c32 - c16) / c32).max().item():.2e} (relative), "
              f"never larger: {bool((c16 <= c32).all())}")
    clip = 1e-3
    worst = max(clipped(True, clip, slice(i, i + 1))[0].norm().item() for i in range(a.batch))
    print(f"each example alone, C = {clip:g}: largest clipped part {worst:.9f}, within C: {worst <= clip * (1 + 1e-6)}")


if __name__ == "__main__":
    main()
