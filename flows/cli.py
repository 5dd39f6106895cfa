"""`dpdistill`: the command line.

    dpdistill run --config configs/demo.yaml [key=value ...]   # the whole pipeline
    dpdistill build-base --config configs/demo.yaml           # only the offline base models
    dpdistill ledger show runs/demo-...                       # a run's privacy ledger

Overrides use dotted keys: `teacher.target_epsilon=4 generate.num_samples=500`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import flows  # noqa: F401  (sets up log routing before Prefect is imported)
from pipeline.config import ConfigError, load_config
from pipeline.data import DataError
from pipeline.distill import DistillError
from pipeline.generate import GenerateError
from pipeline.ledger import LEDGER, format_table, read_ledger
from pipeline.models import ModelError
from pipeline.teacher import TeacherError

USER_ERRORS = (ConfigError, DataError, TeacherError, GenerateError, DistillError, ModelError)


def quiet_libraries() -> None:
    """Keep the terminal to our progress lines: no per-load progress bars or advice."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("opacus").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="Secure RNG turned off")  # we log our own warning
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpdistill", description="Differentially private distillation of LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("run", "run the whole pipeline as a Prefect flow"),
        ("build-base", "build the offline tokenizer and tiny base models from public text"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", required=True, help="YAML config, e.g. configs/demo.yaml")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
        if name == "run":
            p.add_argument(
                "--run-dir",
                help="write into this run directory; an interrupted run resumes there "
                "(the teacher continues from its last checkpoint and accountant state)",
            )
    ledger = sub.add_parser("ledger", help="inspect a run's privacy ledger")
    ledger.add_argument("action", choices=["show"])
    ledger.add_argument("run_dir", help="a run directory (holding ledger.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "ledger":
        path = Path(args.run_dir) / LEDGER
        if not path.is_file():
            print(f"dpdistill: error: {path} not found; pass a run directory", file=sys.stderr)
            return 2
        print(format_table(read_ledger(path)))
        return 0
    quiet_libraries()
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "build-base":
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
            from pipeline.models import build_base_models

            base = build_base_models(cfg.base_models, seed=cfg.seed)
            print(f"teacher: {base.teacher}\nstudent: {base.student}")
            return 0
        from flows.pipeline_flow import dp_distill

        run_dir = dp_distill(cfg, run_dir=args.run_dir)
    except USER_ERRORS as e:
        print(f"dpdistill: error: {e}", file=sys.stderr)
        return 2
    print(f"\nrun directory: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
