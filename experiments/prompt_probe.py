"""A public probe of how a prompt names Yelp's stars (issue 59; docs/utility.md, P20): the base
SmolLM2-135M-Instruct, no private record read, writes 48 reviews per star value under each prompt
form (top-k 50, top-p 0.9, 60 new tokens, torch seed 0, one thread), and a fixed public word list
counts positive and negative words a sample. A prompt the model reads puts the one-star reviews'
net (positive minus negative) below the five-star ones'.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/prompt_probe.py

Needs `dpdistill models fetch smollm2-135m`. Prints one line per form and star value.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.utility import STAR_VALUES, STARS, overrides  # noqa: E402

SAMPLES = 48
CATEGORY = "Business Category: Restaurants"
# each form: the utility study's row whose prompt it is, and the star value's code under it
FORMS = {"shipped": ("ours", lambda raw: raw), "words": ("ours-words", STARS.get)}
POSITIVE = set("great amazing excellent best love loved delicious friendly perfect wonderful fantastic awesome "
               "recommend".split())
NEGATIVE = set("not never bad worst terrible rude horrible awful disappointing disappointed cold slow dirty "
               "overpriced wait waited poor mediocre".split())


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import load_config
    from pipeline.models.cache import model_cache_dir
    from pipeline.prompts import CODE_JOINER, PromptFormat

    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = model_cache_dir() / "smollm2-135m"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for form, (row, code) in FORMS.items():
        cfg = load_config(ROOT / "configs/smollm2_yelp.yaml", overrides(row, "smollm2-yelp", 1))
        prompt = PromptFormat.of(cfg.data)  # as DP training and generation render it
        for stars, raw in enumerate(STAR_VALUES, start=1):
            ids = prompt.ids(tok, f"{CATEGORY}{CODE_JOINER}{code(raw)}")
            batch = torch.tensor([ids] * SAMPLES)
            with torch.no_grad():
                out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, top_k=50,
                                     top_p=0.9, max_new_tokens=60, pad_token_id=tok.eos_token_id)
            pos = neg = 0
            for text in tok.batch_decode(out[:, len(ids):], skip_special_tokens=True):
                words = re.findall(r"[a-z']+", text.lower())
                pos += sum(w in POSITIVE for w in words)
                neg += sum(w in NEGATIVE for w in words)
            print(f"probe form={form} stars={stars} positive={pos / SAMPLES:.2f} negative={neg / SAMPLES:.2f} "
                  f"net={(pos - neg) / SAMPLES:+.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
