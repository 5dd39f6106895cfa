"""Generation and distillation speed (issue 22): the new implementations against the reference,
side by side in one process, alternating in rounds so that background load hits both alike.

Generation: the builtin teacher samples `--gen-samples` texts (max_length 128, top-k 50, top-p
0.9, Yelp-like control codes) with `generate.engine=hf` (transformers' generate on batches of
64 equal-length prompts, the reference as shipped) and `generate.engine=fast`
(pipeline/models/decoding.py) at 64 rows and at 256 (the default since 2026-11-24).
Compared: new tokens per second (the engines sample one distribution, so samples/s follows);
`generation_x` is the fast engine at 256 rows over the reference.

Distillation: two builtin students (candidates α = 0.4 and α = 1, as the studies ran) learn from
`--distill-samples` synthetic samples of the builtin teacher (written first by the fast
engine), teacher logits on the fly, the same shuffled batches and steps. The reference is
the stage as it was: one candidate after the other, each step as `_padded_step` below (each
batch padded to its longest sample through both models, heads and losses on every padded
position), with glibc's allocator as it comes (every tensor over 32 MB mapped afresh). The new one steps the candidates together, the teacher's forward once per batch
for both (`distill._train_together`), each batch in `distill.length_groups` groups of
similar length, the heads and losses on the real targets only, with freed memory reused
(`pipeline.devices.reuse_freed_memory`, as every stage sets it). Each recipe runs in a fresh
process of its own (the allocator's setting is per process). Compared: training samples
per second over both students (the selection after them, the same in both, is not
counted), and the synthetic-validation loss each student reaches (the same batches and the
same loss: equal up to float rounding).

Teacher: the demo teacher's shape (4 layers × 256, vocabulary 8192, 32 × 128 tokens) stepped
by bench/teacher_modes.py, non-private AdamW against the book-keeping DP step, each in its own
process, alternating: `teacher_ratio` is the DP step's median time over the non-private one's.

Plan and demo: `dpdistill plan --config configs/demo.yaml` (`plan_s`) and, with `--parts ...
demo`, `dpdistill run --config configs/demo.yaml` in a temporary run_root (`demo_s`, ~16 min
at one thread on 2 idle cores), each a fresh process timed from start to exit, as a user waits for it; then
the plan's estimate of each stage beside the run's stages.json. `--config` and `--set` plan and
run another config instead (the plan's accuracy on a second one).

Run from the repository root (`OMP_NUM_THREADS=1`: one core each, the ratio is per core):

    OMP_NUM_THREADS=1 .venv/bin/python bench/pipeline_speed.py            # ~8 min on 2 busy cores
    OMP_NUM_THREADS=1 .venv/bin/python bench/pipeline_speed.py --parts generation distillation teacher plan demo
    OMP_NUM_THREADS=1 .venv/bin/python bench/pipeline_speed.py --parts plan demo --config configs/airline.yaml \
        --set teacher.epochs=1 generate.num_samples=2000                  # tweets, user-level DP: ~15 min

The last line reads `generation_x=G distillation_x=D teacher_ratio=T plan_s=P demo_s=S`
(nan for a part not run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.batching import IGNORE  # noqa: E402
from pipeline.config import DistillConfig, GenerateConfig  # noqa: E402
from pipeline.models.base import load_causal_lm, load_tokenizer  # noqa: E402
from pipeline.stages import distill as distill_stage  # noqa: E402
from pipeline.stages.generate import generate_synthetic  # noqa: E402
from pipeline.stages.sampling import sample_shard  # noqa: E402

TEACHER = ROOT / "pipeline" / "models" / "builtin" / "teacher"
STUDENT = ROOT / "pipeline" / "models" / "builtin" / "student"
CATEGORIES = ["Restaurants", "Bars", "Shopping", "Beauty & Spas", "Hotels & Travel"]
CODES = {f"Business Category: {c}\tReview Stars: {s}.0": 1 + (i * 7 + s) % 5
         for i, c in enumerate(CATEGORIES) for s in range(1, 6)}


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


GENERATION_RECIPES = (("hf", 64), ("fast", 64), ("fast", 256))  # (engine, rows): the reference as shipped first


def bench_generation(samples: int, rounds: int) -> float:
    """New tokens/s of the fast engine at the default 256 rows over the hf engine's at the 64 it
    shipped with, summed over alternating rounds; the fast engine at 64 rows beside them."""
    model, tok = load_causal_lm(str(TEACHER)).eval(), load_tokenizer(str(TEACHER))
    per_round = samples // rounds
    totals = {recipe: [0, 0.0, 0] for recipe in GENERATION_RECIPES}  # new tokens, seconds, samples
    print("| round | engine | rows | samples | new tokens | s | new tokens/s | load |\n|---|---|---|---|---|---|---|---|")
    for r in range(rounds):
        for engine, rows in GENERATION_RECIPES:
            cfg = GenerateConfig(num_samples=per_round, batch_size=rows, top_k=50, top_p=0.9, max_length=128,
                                 validation_fraction=0.0, engine=engine)
            t0 = time.perf_counter()
            _, stats = sample_shard(model, tok, cfg, CODES, 0, per_round, shard_seed=r, keep_empty=True)
            seconds = time.perf_counter() - t0
            for i, value in enumerate((stats["new_tokens"], seconds, per_round)):
                totals[engine, rows][i] += value
            print(f"| {r} | {engine} | {rows} | {per_round} | {stats['new_tokens']} | {seconds:.1f} | "
                  f"{stats['new_tokens'] / seconds:.0f} | {_load()} |", flush=True)
    rate = {recipe: t[0] / t[1] for recipe, t in totals.items()}
    reference = rate["hf", 64]
    print("generation: " + ", ".join(f"{engine} at {rows} rows {rate[engine, rows]:.0f} new tokens/s "
                                     f"({rate[engine, rows] / reference:.2f}x)" for engine, rows in GENERATION_RECIPES))
    return rate["fast", 256] / reference


def _padded_step(cfg, teacher, vocab, student, projection, cached, ids, lengths, skip, runtime, shared=None):
    """distill.step_loss as it was before issue 22 (the reference): both models' heads and the
    losses on the padded (B, L-1, V) batch, the losses as pipeline/models/losses.py had them."""
    from pipeline.batching import lm_batch
    from pipeline.models.losses import prompt_mask

    device = runtime.device
    batch = {k: v.to(device) for k, v in lm_batch(ids, lengths).items()}
    labels = batch.pop("labels")  # (B, L-1)
    kl_mask = prompt_mask(labels.shape[1], skip).to(device) & (labels != IGNORE)  # (B, L-1)
    with torch.no_grad(), runtime.autocast():
        teacher_logits = teacher(**batch).logits[:, :-1, :vocab].float()  # (B, L-1, V)
    with runtime.autocast():
        student_logits = student(**batch).logits[:, :-1, :vocab].float()  # (B, L-1, V)
    return _reference_loss(student_logits, teacher_logits, labels, kl_mask, cfg.alpha, cfg.temperature)


def _reference_loss(student_logits, teacher_logits, labels, kl_mask, alpha: float, temperature: float):
    """The dense (1-α)·CE + α·T²·KL as pipeline/models/losses.py computed it before issue 22."""
    import torch.nn.functional as F

    from pipeline.models.losses import DistillLoss

    def masked_mean(values, mask):
        mask = mask.to(values.dtype)
        return (values * mask).sum() / mask.sum().clamp(min=1.0)

    nll = F.cross_entropy(student_logits.reshape(-1, student_logits.shape[-1]).float(),
                          labels.reshape(-1).clamp(min=0), reduction="none").view(labels.shape)  # (B, T)
    ce = masked_mean(nll, labels != IGNORE)
    log_p_s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, T, V)
    log_p_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (B, T, V)
    kl = masked_mean((log_p_t.exp() * (log_p_t - log_p_s)).sum(-1), kl_mask)  # (B, T) -> ()
    loss = (1 - alpha) * ce + alpha * temperature**2 * kl
    return DistillLoss(loss=loss, ce=ce, kl=kl, mse=ce.new_zeros(()))


def distill_child(recipe: str, epochs: int, tmp: Path) -> dict:
    """One recipe's training in this (fresh) process: the reference as the stage was (glibc's
    allocator as it comes, each candidate after the other, padded steps), or the stage now."""
    import pipeline.devices as devices

    if recipe == "reference":
        devices.reuse_freed_memory = lambda: False  # the stage before 2026-11-24 left glibc as it is
        distill_stage.step_loss, distill_stage.lockstep_key = _padded_step, id  # id: one candidate after the other
    cfg = DistillConfig(candidates=[{"alpha": 0.4}, {"alpha": 1.0}], epochs=epochs, batch_size=16,
                        learning_rate=3e-3, eval_every=10_000, log_every=10_000, selection_samples=8,
                        length_groups=1 if recipe == "reference" else 4)
    out = tmp / f"{recipe}-{time.time_ns()}"
    distill_stage.distill(cfg, synthetic_path=tmp / "synthetic", teacher_dir=TEACHER, student_model=str(STUDENT),
                          out_dir=out, seed=0)
    log = json.loads((out / "training_log.json").read_text())  # seconds: the candidates' training
    runs = list(log["candidates"].values())
    return {"seconds": log["seconds"], "steps": sum(len(run["history"]) for run in runs),
            "trained": sum(epochs * run["train_samples"] for run in runs),
            "losses": ", ".join(f"{run['validation'][-1]['validation_loss']:.4f}" for run in runs)}


def bench_distillation(samples: int, epochs: int, rounds: int, tmp: Path) -> float:
    """Training samples/s of the new recipe over the reference's, summed over alternating rounds:
    two candidates (α = 0.4 and α = 1, as the studies ran), each a student trained on every sample; each
    recipe in a fresh process of its own (`distill_child`)."""
    codes = tmp / "codes.json"
    codes.write_text(json.dumps({"counts": CODES}))
    generate_synthetic(GenerateConfig(num_samples=samples, batch_size=64, max_length=128, validation_fraction=0.1),
                       teacher_dir=TEACHER, control_codes_path=codes, ledger=[], out_dir=tmp / "synthetic", seed=0)
    totals = {"reference": [0.0, 0], "new": [0.0, 0]}
    losses = {}
    print("| round | recipe | steps | samples | s | samples/s | validation loss (α = 0.4, 1) | load |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in range(rounds):
        for recipe in ("reference", "new"):
            out = subprocess.run([sys.executable, __file__, "--distill-child", recipe, "--epochs", str(epochs),
                                  "--tmp", str(tmp)], cwd=ROOT, capture_output=True, text=True, check=True).stdout
            got = json.loads(re.search(r"^RESULT (.*)$", out, re.M).group(1))
            totals[recipe][0] += got["seconds"]
            totals[recipe][1] += got["trained"]
            losses[recipe] = got["losses"]
            print(f"| {r} | {recipe} | {got['steps']} | {got['trained']} | {got['seconds']:.1f} | "
                  f"{got['trained'] / got['seconds']:.1f} | {got['losses']} | {_load()} |", flush=True)
    rate = {k: n / s for k, (s, n) in totals.items()}
    print(f"distillation: reference {rate['reference']:.1f} samples/s, new {rate['new']:.1f}: "
          f"{rate['new'] / rate['reference']:.2f}x; validation loss at equal steps "
          f"{losses['reference']} vs {losses['new']}")
    return rate["new"] / rate["reference"]


def bench_teacher() -> float:
    """bk's median step time over the non-private step's at the demo teacher's shape and physical batch."""
    shape = ["--layers", "4", "--width", "256", "--heads", "8", "--vocab", "8192", "--seq", "128", "--batch", "32"]
    command = [sys.executable, str(ROOT / "bench" / "teacher_modes.py"), *shape, "--steps", "6",
               "--modes", "nonprivate", "full-bk"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    print("\n".join(line for line in out.splitlines() if line.startswith("|")))
    return float(re.search(r"mode=bk time_ratio=([0-9.]+)", out).group(1))


def _timed_cli(*args: str) -> tuple[float, str]:
    """Wall seconds and stdout of `dpdistill ARGS` in a fresh process, from start to exit."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"dpdistill {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def _estimates(plan_text: str) -> dict[str, float]:
    """Seconds per stage from the plan's time lines (`    teacher: ~11 min (...)`)."""
    unit = {"s": 1, "min": 60, "h": 3600}
    return {m[1]: round(float(m[2]) * unit[m[3]], 1)
            for m in re.finditer(r"^    ([a-z-]+): ~([0-9.]+) (s|min|h) ", plan_text, re.M)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen-samples", type=int, default=1024)
    ap.add_argument("--distill-samples", type=int, default=400)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    parts = ("generation", "distillation", "teacher", "plan", "demo")
    ap.add_argument("--parts", nargs="+", choices=parts, default=list(parts[:4]),
                    help="what to measure (default: all but the demo run)")
    ap.add_argument("--config", default="configs/demo.yaml", help="the plan's and the run's config")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for both (e.g. teacher.epochs=1)")
    ap.add_argument("--distill-child", choices=("reference", "new"), help=argparse.SUPPRESS)
    ap.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.distill_child:
        print("RESULT " + json.dumps(distill_child(args.distill_child, args.epochs, args.tmp)))
        return
    print(f"torch threads {torch.get_num_threads()}, load {_load()}")
    got = dict.fromkeys(parts, float("nan"))
    if "generation" in args.parts:
        got["generation"] = bench_generation(args.gen_samples, args.rounds)
    if "distillation" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            got["distillation"] = bench_distillation(args.distill_samples, args.epochs, args.rounds, Path(tmp))
    if "teacher" in args.parts:
        got["teacher"] = bench_teacher()
        print(f"teacher: bk step / non-private step {got['teacher']:.2f} (load {_load()})")
    estimate = {}
    if "plan" in args.parts:
        got["plan"], text = _timed_cli("plan", "--config", args.config, *args.set)
        estimate = _estimates(text)
        print(f"plan: {got['plan']:.1f} s (load {_load()}); its estimate: {estimate}")
    if "demo" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            got["demo"], _ = _timed_cli("run", "--config", args.config, *args.set, f"run_root={tmp}")
            (stages,) = Path(tmp).glob("*/stages.json")
            ran = {k: v["seconds"] for k, v in json.loads(stages.read_text()).items() if v.get("seconds")}
        print(f"demo: {got['demo']:.0f} s (load {_load()})\n| stage | run, s | plan, s | plan / run |\n|---|---:|---:|---:|")
        for stage, seconds in ran.items():
            planned = estimate.get(stage, float("nan"))
            print(f"| {stage} | {seconds:.1f} | {planned:.0f} | {planned / seconds:.2f} |")
    print(f"generation_x={got['generation']:.2f} distillation_x={got['distillation']:.2f} "
          f"teacher_ratio={got['teacher']:.2f} plan_s={got['plan']:.1f} demo_s={got['demo']:.0f}")


if __name__ == "__main__":
    main()
