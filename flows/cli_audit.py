"""`dpdistill audit`'s options, and its `--empirical` mode (pipeline/audits/empirical_run.py):

    dpdistill audit --empirical runs/demo-... [--canaries 1000] [--noise-off] [teacher.KEY=VALUE ...]

Light at import, like flows/cli.py: torch, Opacus and the pipeline load in the handler.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from flows.cli_run import quiet_libraries, user_errors
from pipeline.config import load_config

AUDIT_INCOMPLETE = 3
"""`dpdistill audit`'s exit status when nothing was found but not everything could be read."""


def add_audit_parser(sub) -> None:
    audit = sub.add_parser(
        "audit",
        help="scan what a run publishes for verbatim spans of its training records (exit 1 on a leak, 3 when "
        "something it publishes could not be read), with --canaries measure canary exposure of a new run, or "
        "with --empirical put an empirical ε (one-run audit), membership inference and extraction figures "
        "beside the ledger's ε",
    )
    audit.add_argument("run_dir", nargs="?", help="a run directory (not with --canaries alone)")
    audit.add_argument("overrides", nargs="*", metavar="key=value",
                       help="dotted overrides (with --canaries); teacher.KEY=VALUE only (with --empirical)")
    audit.add_argument("--span", type=int, default=10, help="words in a matched span (default 10)")
    audit.add_argument("--canaries", type=int, metavar="N", help="insert N secret canaries and run the pipeline "
                       "(with --empirical: N canaries each included with probability 1/2, default 1000)")
    audit.add_argument("--config", help="YAML config of the canary run (with --canaries)")
    audit.add_argument("--repetitions", default="1,1,4,16",
                       help="copies of each canary, cycled over the canaries (default 1,1,4,16)")
    audit.add_argument("--candidates", type=int, default=1000, help="random candidates per canary (default 1000)")
    audit.add_argument("--work-dir", help="a new directory for the secret data copy, 0700 and deleted when the audit "
                       "ends (default <run_root>/canaries-<time>); the run itself goes under run_root")
    audit.add_argument("--empirical", action="store_true",
                       help="train the run's teacher again on its private split (kept with "
                       "data.keep_private_copies=true) with secret canaries, with DP (charged to the records' "
                       "budget, checked against privacy.max_epsilon); write the figures to "
                       "RUN_DIR/private/empirical_audit.json (0600) and print aggregates only")
    audit.add_argument("--noise-off", action="store_true",
                       help="with --empirical: also train with noise off, to measure the audit's power; its figures "
                       "carry no DP guarantee, and the records' budget records a release without DP")


def run_empirical(args, usage: Callable[[str], int], errors: tuple[type[Exception], ...]) -> int:
    """`dpdistill audit --empirical RUN_DIR`: 0 when written, 2 on a usage error."""
    import yaml

    from pipeline.audits.empirical_run import DEFAULT_CANARIES, EmpiricalAuditError, empirical_audit, format_summary

    if args.config or not args.run_dir:
        return usage("--empirical takes one run directory (dpdistill audit --empirical RUN_DIR), no --config")
    overrides = {}
    for o in args.overrides:
        key, _, value = o.partition("=")
        if not key.startswith("teacher.") or not value:
            return usage(f"{o!r}: with --empirical only teacher.KEY=VALUE overrides apply (to both trainings)")
        overrides[key.removeprefix("teacher.")] = yaml.safe_load(value)
    m = DEFAULT_CANARIES if args.canaries is None else args.canaries
    if m < 2:
        return usage("--canaries must be at least 2")
    try:
        path, report = empirical_audit(Path(args.run_dir), canaries=m, teacher_overrides=overrides or None,
                                       noise_off=args.noise_off)
    except (EmpiricalAuditError, *errors) as e:  # messages name settings and files, never records
        return usage(str(e))
    print(format_summary(report))
    print(f"written: {path} (0600: figures about private records; not in the report)")
    return 0


def run_audit(args) -> int:
    """`dpdistill audit`: 0 clean (everything read, nothing found), 1 a leak, 2 a usage error,
    3 incomplete (nothing found, but something the run publishes could not be read: a clean
    exit would be a claim about what was not read). Counts and names only."""
    import prefect.main  # noqa: F401  (before pipeline.* imports Opacus: see flows/__init__.py)
    from pipeline.audits.audit import AuditError, audit_run, format_audit

    def usage(msg: str) -> int:
        print(f"dpdistill audit: error: {msg}", file=sys.stderr)
        return 2

    if args.empirical:
        return run_empirical(args, usage, user_errors())
    if args.noise_off:
        return usage("--noise-off goes with --empirical (dpdistill audit --empirical --noise-off RUN_DIR)")
    if args.canaries is None:
        if args.config or not args.run_dir or args.overrides:
            return usage("pass one run directory (dpdistill audit RUN_DIR), or --canaries N --config C")
        from flows.audit import prefect_sources

        run_dir = Path(args.run_dir)
        if not (run_dir / "config.yaml").is_file():
            return usage(f"{run_dir} holds no config.yaml: pass a run directory")
        extra, note, unread = prefect_sources(run_dir)
        try:
            result = audit_run(run_dir, span=args.span, extra=extra, extra_note=note, extra_unread=unread)
        except (AuditError, *user_errors()) as e:  # their messages name rows and fields, never records
            return usage(str(e))
        print(format_audit(result.report))
        print(f"written: {result.path}")
        return 1 if result.leak else AUDIT_INCOMPLETE if result.incomplete else 0

    if not args.config:
        return usage("--canaries needs --config, e.g. --config configs/demo.yaml")
    overrides = ([args.run_dir] if args.run_dir else []) + args.overrides  # key=value lands in run_dir first
    if any("=" not in o for o in overrides):
        return usage("with --canaries, pass no run directory: the tool makes its own run")
    try:
        repetitions = tuple(int(r) for r in args.repetitions.split(","))
    except ValueError:
        return usage(f"--repetitions {args.repetitions!r}: use comma-separated counts, e.g. 1,1,4,16")
    if args.canaries < 1 or args.candidates < 1 or min(repetitions) < 1:
        return usage("--canaries, --candidates and every repetition must be at least 1")
    quiet_libraries()
    from flows.audit import canary_audit, format_canary_report

    try:
        cfg = load_config(args.config, overrides)
        work = Path(args.work_dir) if args.work_dir else cfg.run_root / f"canaries-{time.strftime('%Y%m%d-%H%M%S')}"
        path, report = canary_audit(cfg, args.canaries, work, repetitions, args.candidates)
    except user_errors() as e:
        return usage(str(e))
    print(format_canary_report(report))
    print(f"written: {path}")
    verbatim = report["verbatim_audit"]
    return 1 if verbatim["total_hits"] else AUDIT_INCOMPLETE if verbatim["incomplete"] else 0
