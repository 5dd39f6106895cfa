"""What a top-k teacher cache costs the student (issue 22): test perplexity and time of students
distilled with the DP teacher's logits on the fly against the same students fed from a top-k
cache, in both of its forms, on one finished run's DP teacher and synthetic samples.

  on the fly    distill.teacher_top_k = null (the default): the dense KL at every step
  renormalised  top-k cache read without its logsumexp: the teacher renormalised over its k
                tokens (the cache as it was before the rest bucket)
  rest bucket   top-k cache with its logsumexp (today's teacher_top_k = k): the KL over the k
                tokens and the rest of the vocabulary as one bucket

Every student is one candidate (`--alphas`, each alone), the demo's distill settings (batch 16,
learning rate 3e-3, 2 epochs), trained per `--seeds` (the batches' order); its windowed test
perplexity is the evaluation stage's own `perplexity` on `--test` (the run's held-out records:
this reads private text, as the evaluation stage does; the figures are aggregates). Run from the
repository root on a finished demo run, e.g. `make demo` then:

    OMP_NUM_THREADS=1 .venv/bin/python experiments/teacher_cache_quality.py runs/demo-YYYYMMDD-HHMMSS   # ~25 min

The last line reads `rest_bucket_over_on_the_fly=R renormalised_over_on_the_fly=N` (ratios of
the mean windowed test perplexities, averaged over the α's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow.csv as pcsv  # noqa: E402
import torch  # noqa: E402

from pipeline.config import DistillConfig  # noqa: E402
from pipeline.models.base import load_causal_lm, load_tokenizer  # noqa: E402
from pipeline.models.losses import TopKLogits  # noqa: E402
from pipeline.stages import distill as distill_stage  # noqa: E402
from pipeline.stages import logit_cache  # noqa: E402
from pipeline.records import CODE_JOINER  # noqa: E402
from pipeline.stages.evaluate import perplexity  # noqa: E402

STUDENT = ROOT / "pipeline" / "models" / "builtin" / "student"
VARIANTS = ("on the fly", "renormalised", "rest bucket")


def _without_rest(batch):
    def read(self, rows, lengths):
        top = batch(self, rows, lengths)
        return TopKLogits(top.indices, top.logits, None)
    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished run: its teacher/model and synthetic/")
    parser.add_argument("--test", type=Path, default=ROOT / "data" / "yelp_sample" / "test.csv")
    parser.add_argument("--code-columns", nargs="+", default=["label1", "label2"])
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0, 0.4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    table = pcsv.read_csv(args.test)
    columns = [table[c].to_pylist() for c in args.code_columns]
    codes, texts = [CODE_JOINER.join(parts) for parts in zip(*columns)], table["text"].to_pylist()
    teacher, synthetic = args.run_dir / "teacher" / "model", args.run_dir / "synthetic"
    batch = logit_cache.CachedTopK.batch
    results: dict[tuple[float, str], list[float]] = {}
    print("| α | seed | teacher logits | wall s | training s | synthetic validation CE | test perplexity (windowed) |\n"
          "|---|---|---|---:|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for alpha in args.alphas:
                for variant in VARIANTS:
                    logit_cache.CachedTopK.batch = _without_rest(batch) if variant == "renormalised" else batch
                    cfg = DistillConfig(candidates=[], alpha=alpha, epochs=2, batch_size=16, learning_rate=3e-3,
                                        teacher_top_k=None if variant == "on the fly" else args.k)
                    out = Path(tmp) / "student"
                    shutil.rmtree(out, ignore_errors=True)
                    t0 = time.time()  # the first cached student builds the cache (once, in tmp)
                    distill_stage.distill(cfg, synthetic_path=synthetic, teacher_dir=teacher, student_model=str(STUDENT),
                                          out_dir=out, seed=seed, teacher_cache_dir=Path(tmp) / "cache")
                    wall = time.time() - t0
                    log = json.loads((out / "training_log.json").read_text())
                    with torch.inference_mode():
                        ppl = perplexity(load_causal_lm(str(out / "model")).eval(), load_tokenizer(str(out / "model")),
                                         codes, texts, 128, 16).windowed
                    results.setdefault((alpha, variant), []).append(ppl)
                    print(f"| {alpha} | {seed} | {variant} | {wall:.1f} | {log['seconds']:.1f} | "
                          f"{log['validation'][-1]['validation_loss']:.4f} | {ppl:.2f} |", flush=True)
    logit_cache.CachedTopK.batch = batch
    ratios = {}
    for variant in VARIANTS:
        for alpha in args.alphas:
            values = results[(alpha, variant)]
            print(f"α={alpha} {variant}: mean {statistics.mean(values):.2f} (min {min(values):.2f}, max {max(values):.2f})")
        ratios[variant] = statistics.mean(statistics.mean(results[(a, variant)]) / statistics.mean(results[(a, "on the fly")])
                                          for a in args.alphas)
    print(f"rest_bucket_over_on_the_fly={ratios['rest bucket']:.3f} "
          f"renormalised_over_on_the_fly={ratios['renormalised']:.3f}")


if __name__ == "__main__":
    main()
