"""The students `dpdistill models student` built, as tracked results (issue 59 item 5): each
cached student's build record (its manifest's `model` section: layers kept, parameters, the
healing budget and corpus, its public held-out perplexity before and after healing beside its
teacher's) appended to docs/results/students.jsonl, and the table of them.

    .venv/bin/python experiments/students.py --record smollm2-135m-8l   # after building it
    .venv/bin/python experiments/students.py --report-only

The model cache is not tracked and dies with its machine; the jsonl keeps what each build
measured. A student already recorded with the same build (teacher, layers, budget, corpus,
seed) is not appended again. The issue's bar: public held-out perplexity within 2.5× its
teacher's (`ratio`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.shared import append_result, read_results  # noqa: E402

RESULTS = ROOT / "docs" / "results" / "students.jsonl"

BAR = 2.5  # issue 59 item 5: the student's public held-out perplexity at most this × its teacher's


def record_of(model_dir: Path) -> dict:
    """A cached student's build record, from its manifest (no absolute paths: the corpus by name and hash)."""
    from pipeline.manifest import MANIFEST

    manifest = json.loads((model_dir / MANIFEST).read_text())
    model, build = manifest.get("model", {}), manifest.get("build")
    if not build or "layers_kept" not in model:
        raise SystemExit(f"experiments/students.py: {model_dir} is not a student built by `dpdistill models student`")
    corpus = dict(model["corpus"], path=Path(model["corpus"]["path"]).name)
    keys = ("name", "teacher", "layers_kept", "teacher_layers", "parameters", "non_embedding_parameters",
            "teacher_parameters", "budget", "seed", "teacher_perplexity", "perplexity_before", "perplexity_after",
            "healing", "seconds", "built_at", "source", "license", "device", "precision", "gpu",
            "perplexity_after_on_gpu")  # the last four: a student healed on a GPU (bench/gpu_students.py)
    return {**{k: model[k] for k in keys if k in model}, "corpus": corpus}


def _same_build(a: dict, b: dict) -> bool:
    keys = ("name", "teacher", "layers_kept", "budget", "seed")
    return all(a.get(k) == b.get(k) for k in keys) and a["corpus"].get("sha256") == b["corpus"].get("sha256")


def report(records: list[dict]) -> str:
    lines = ["| student | layers kept | parameters | healing | public held-out perplexity (before → after) "
             "| teacher | ratio | build |", "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in records:
        b, h = r["budget"], r["healing"]
        ratio = r["perplexity_after"] / r["teacher_perplexity"]
        lines.append(
            f"| {r['name']} | {len(r['layers_kept'])} of {r['teacher_layers']} | {r['parameters'] / 1e6:.1f} M "
            f"| {b['steps']} steps × {b['batch_size']} × {b['seq_len']} tokens of {' + '.join(r['corpus']['sha256'])} "
            f"({r['corpus']['training_tokens']:,} tokens) | {r['perplexity_before']:.0f} → {r['perplexity_after']:.1f} "
            f"| {r['teacher_perplexity']:.1f} | {ratio:.2f}× {'✓' if ratio <= BAR else '✗'} "
            + (f"| {r['seconds']:.0f} s on an {r['gpu']}, {r['precision']} |" if r.get("gpu") else
               f"| {r['seconds']:.0f} s, {h['threads']} thread{'s' if h['threads'] != 1 else ''} |"))
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", metavar="NAME", action="append", default=[],
                   help="append this cached student's build record (repeatable)")
    p.add_argument("--cache-dir", type=Path, help="the model cache (default: dpdistill's)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the tracked jsonl of builds (default: %(default)s)")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    path = args.results
    if not args.report_only:
        from pipeline.models.cache import cached_model_dir

        for name in args.record:
            record = record_of(cached_model_dir(name, args.cache_dir))
            if not any(_same_build(record, r) for r in read_results(path)):
                append_result(path, record)
    print(report(read_results(path)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
