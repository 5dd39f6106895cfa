"""`dpdistill`: the command line.

    dpdistill run --config configs/demo.yaml [key=value ...]   # the whole pipeline
    dpdistill run --config C --from generation                 # rerun generation and later stages
    dpdistill run --config C --force teacher                   # rerun one stage
    dpdistill status runs/demo-...                             # stages done, durations, ε
    dpdistill report runs/demo-...                             # (re)write its report.html
    dpdistill serve --config C --cron "0 3 * * *"              # a scheduled deployment
    dpdistill build-base --config configs/builtin.yaml        # only the offline base models
    dpdistill build-base --config configs/builtin.yaml --export pipeline/models/builtin   # rebuild the shipped pair
    dpdistill plan --config C [key=value ...]                 # N, q, σ, steps, ε and time; trains nothing
    dpdistill ledger show runs/demo-...                       # a run's privacy ledger
    dpdistill audit runs/demo-... [--span 10]                 # published files vs training records
    dpdistill audit --canaries 8 --config C [key=value ...]   # canary exposure of a fresh run
    dpdistill audit --empirical runs/demo-...                # empirical ε, membership, extraction
    dpdistill models fetch smollm2-135m                      # a real model into the model cache (cache:smollm2-135m)
    dpdistill models student smollm2-135m --layers 4         # a pruned, healed student of it (flows/cli_models.py)

Overrides use dotted keys: `teacher.target_epsilon=4 generate.num_samples=500`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Only light modules here: `--help`, `status`, `ledger show`, `report` and config errors
# must answer without importing torch, transformers, Opacus or Prefect (tens of seconds on a
# loaded machine; issue 10). The commands that need them import them in their handlers.
from flows.cli_audit import add_audit_parser, run_audit
from flows.cli_inspect import DamagedFileError, print_status, show_ledger, write_run_report
from flows.cli_models import add_models_parser, run_models
from flows.cli_run import quiet_libraries, run_pipeline
from flows.run_info import STAGES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpdistill", description="Differentially private distillation of LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("run", "run the whole pipeline as a Prefect flow"),
        ("serve", "serve the flow on a cron schedule against a Prefect server (blocks)"),
        ("build-base", "build the offline tokenizer and base models from public text (base_models.corpus)"),
        ("plan", "print N, batch size, q, σ, steps, ε (each stage and total) and a time estimate; "
                 "trains and writes nothing"),
        ("join-teacher", "on node 1..nnodes-1: run this node's ranks of the data-parallel teacher that "
                         "node 0's flow starts (teacher.nnodes > 1; set teacher.node_rank)"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", required=True, help="YAML config, e.g. configs/demo.yaml")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
        if name == "run":
            p.add_argument(
                "--run-dir",
                help="write into this run directory; an interrupted run resumes there "
                "(the teacher continues from its last checkpoint and accountant state). Without it, "
                "a killed or failed run with the same config is continued, else a new directory is made",
            )
            p.add_argument("--from", dest="rerun_from", choices=STAGES, metavar="STAGE",
                           help=f"rerun this stage and every later one even if cached ({', '.join(STAGES)})")
            p.add_argument("--force", action="append", choices=STAGES, metavar="STAGE", default=[],
                           help="rerun this stage even if cached (repeatable)")
        if name == "build-base":
            p.add_argument("--export", metavar="DIR",
                           help="also write the pair as the shipped one is stored (fp16 safetensors, "
                           "tokenizer, build.json): --export pipeline/models/builtin replaces the shipped pair")
        if name == "serve":
            p.add_argument("--cron", required=True, help='cron schedule, e.g. "0 3 * * *" (03:00 every day)')
            p.add_argument("--timezone", default="UTC", help="time zone of the schedule (default UTC)")
            p.add_argument("--name", help="deployment name (default: <config name>-scheduled)")
    status = sub.add_parser("status", help="which stages of a run are done, their durations and ε")
    status.add_argument("run_dir", help="a run directory")
    report = sub.add_parser("report", help="(re)write a run's report.html")
    report.add_argument("run_dir", help="a run directory")
    ledger = sub.add_parser("ledger", help="inspect a run's privacy ledger")
    ledger.add_argument("action", choices=["show"])
    ledger.add_argument("run_dir", help="a run directory (holding ledger.json)")
    add_audit_parser(sub)
    add_models_parser(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `key=value` overrides anywhere on it: argparse gives a positional
    `nargs="*"` only the words before the first option, so `run --config c.yaml a=1 --force
    generation b=2` left b=2 "unrecognized" (issue 37). The rest of the line's key=value words
    join the overrides, in order; an unknown option, or an override given to a command that
    takes none, is still an error."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    late = [word for word in rest if "=" in word and not word.startswith("-")]
    unknown = [word for word in rest if word not in late] + (late if not hasattr(args, "overrides") else [])
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "status":
            return print_status(Path(args.run_dir))
        if args.command == "report":
            return write_run_report(Path(args.run_dir))
        if args.command == "ledger":
            return show_ledger(Path(args.run_dir))
    except DamagedFileError as e:
        print(f"dpdistill: error: {e}", file=sys.stderr)
        return 2
    if args.command == "audit":
        return run_audit(args)
    if args.command == "models":
        quiet_libraries()
        return run_models(args)
    return run_pipeline(args)


if __name__ == "__main__":
    sys.exit(main())
