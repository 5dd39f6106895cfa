"""Wall time and peak accelerator memory of each stage of a config (issue 36 item 6), in one process.

The stages run in the flow's order (flows/pipeline_flow.py, method `distil`) through the same
library calls as flows/tasks.py: the builtin models where named, data, control codes, DP teacher, generation (one worker),
distillation, evaluation. Prefect is left out (the GPU machines this was written for have none),
and with it the stage cache, the records' budget and the run directory's bookkeeping: every
stage computes, in a fresh temporary directory. The plan's estimate (`dpdistill plan`) is the
flow's; this says what each stage costs on the machine at hand.

Per stage: wall seconds, and on CUDA `torch.cuda.max_memory_allocated` over the stage (the
counter is reset before each), on CPU the process' peak RSS so far. The last line reads
`stages name=seconds/GiB ...`.

`--shape-of DIR` (a model directory's config.json and tokenizer; no weights needed) runs
random-init models of that shape instead of the config's: the teacher, and a student of
`--student-layers` of its layers (pipeline/models/student.py's pick_layers and prune_layers,
not healed). Times and memory follow the shapes; the samples of a random teacher run to
max_length (it rarely samples eos), so generation is its slowest case, and the perplexities
mean nothing. That is how a GPU machine with no copy of the weights measures a config.
Run from the repository root:

    .venv/bin/python bench/stage_costs.py --config configs/smollm2_gpu.yaml [dotted.key=value ...]
    .venv/bin/python bench/stage_costs.py --config configs/smollm2_gpu.yaml --shape-of DIR teacher.epochs=4
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.devices import Runtime  # noqa: E402
from pipeline.models.base import build_base_models, resolve_model  # noqa: E402
from pipeline.methods import method_spec  # noqa: E402
from pipeline.plan import dp_sgd_budgets  # noqa: E402
from pipeline.privacy.control_codes import release_control_codes  # noqa: E402
from pipeline.records import split_key  # noqa: E402
from pipeline.stages.adherence import declared_values  # noqa: E402
from pipeline.stages.data import prepare_data  # noqa: E402
from pipeline.stages.distill import distill  # noqa: E402
from pipeline.stages.evaluate import evaluate_models  # noqa: E402
from pipeline.stages.generate import generate_synthetic  # noqa: E402
from pipeline.stages.teacher.recipe import train_teacher  # noqa: E402


def random_models(shape_of: Path, out: Path, layers: int) -> None:
    """A seeded random-init model of `shape_of`'s config and a `layers`-layer cut of it, saved
    with its tokenizer under out/teacher and out/student."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.models.base import load_tokenizer
    from pipeline.models.student import pick_layers, prune_layers

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(shape_of)
    teacher = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    student = prune_layers(teacher, pick_layers(config.num_hidden_layers, layers))
    tok = load_tokenizer(str(shape_of))
    for name, model in (("teacher", teacher), ("student", student)):
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="dotted.key=value, as `dpdistill run` takes them")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the evaluation's metrics here")
    ap.add_argument("--shape-of", metavar="DIR", help="random-init teacher and student of this model's shape")
    ap.add_argument("--student-layers", type=int, default=4, help="with --shape-of: the student's layers")
    a = ap.parse_args()
    # the stages' own progress lines (what a run logs), so a slow stage shows where its time goes
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", force=True)
    overrides = list(a.overrides)
    if a.shape_of:
        shaped = Path(tempfile.mkdtemp(prefix="shape-"))
        overrides += [f"teacher.model={shaped / 'teacher'}", f"distill.student_model={shaped / 'student'}"]
        random_models(Path(a.shape_of), shaped, a.student_layers)
    cfg = load_config(a.config, overrides)
    if not method_spec(cfg.distill.method).ours:
        sys.exit("stage_costs.py runs method=distil (the pipeline's own) only")
    rt = Runtime.from_config(cfg)
    rt.apply_threads()
    cuda = rt.device.type == "cuda"
    where = torch.cuda.get_device_name(rt.device) if cuda else f"CPU, {rt.threads_for()} thread(s)"
    print(f"{a.config} {' '.join(a.overrides)} | {where}, {cfg.precision} | torch {torch.__version__}", flush=True)
    rows: list[dict] = []

    def timed(name: str, fn):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
        rows.append({"stage": name, "seconds": round(time.perf_counter() - t0, 1), "peak_gib": round(peak, 2)})
        print(f"{name}: {rows[-1]['seconds']} s, peak {rows[-1]['peak_gib']} GiB", flush=True)
        return result

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        base = None
        if any(m.startswith("builtin:") for m in (cfg.teacher.model, cfg.distill.student_model)):
            base = timed("base-models", lambda: build_base_models(cfg.base_models, seed=cfg.seed))
        data = timed("data", lambda: prepare_data(cfg.data, out / "data", cfg.control_codes.domain, split_key(out)))
        codes = timed("control-codes", lambda: release_control_codes(
            cfg.control_codes, cfg.data, train_path=data.train, out_dir=out / "control_codes",
            delta=cfg.teacher.target_delta, accountant=cfg.teacher.accountant, secure_mode=cfg.teacher.secure_mode))
        teacher_cfg = cfg.teacher.model_copy(update={"target_epsilon": dp_sgd_budgets(cfg)["teacher"]})
        teacher = timed("teacher", lambda: train_teacher(
            teacher_cfg, train_path=data.train, validation_path=data.validation,
            base_model=resolve_model(cfg.teacher.model, base), out_dir=out / "teacher", seed=cfg.seed, runtime=rt))
        synthetic = timed("generation", lambda: generate_synthetic(
            cfg.generate, teacher_dir=teacher.checkpoint, control_codes_path=codes.path,
            ledger=[codes.ledger, teacher.ledger], out_dir=out / "synthetic", seed=cfg.seed, runtime=rt))
        student_model = resolve_model(cfg.distill.student_model, base)
        student = timed("distillation", lambda: distill(
            cfg.distill, synthetic_path=synthetic.path, teacher_dir=teacher.checkpoint, student_model=student_model,
            out_dir=out / "student", seed=cfg.seed, runtime=rt))
        models = {"base_student": student_model, "base_teacher": resolve_model(cfg.teacher.model, base),
                  "dp_teacher": str(teacher.checkpoint), "student_distil": str(student.checkpoint)}
        metrics = timed("evaluation", lambda: evaluate_models(
            cfg.evaluate, models=models, test_path=data.test, out_dir=out / "evaluation", seed=cfg.seed,
            synthetic_path=synthetic.path, runtime=rt, adherence_model="dp_teacher",
            code_values=declared_values(cfg.data, cfg.control_codes.domain, codes.path),
            code_columns=cfg.data.code_columns, selection=student.selection))
    facts = {"train_records": data.n_train, "teacher_steps": teacher.ledger.steps, "epsilon": teacher.ledger.epsilon,
             "samples": synthetic.n_samples, "new_tokens_per_second": synthetic.tokens_per_second,
             "perplexity": {name: p.get("windowed") for name, p in metrics["perplexity"].items()}}
    print(json.dumps(facts))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "facts": facts, "metrics": metrics}, indent=1, default=str))
    print("stages " + " ".join(f"{r['stage']}={r['seconds']}s/{r['peak_gib']}GiB" for r in rows))


if __name__ == "__main__":
    main()
