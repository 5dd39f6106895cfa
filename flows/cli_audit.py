"""`dpdistill audit`'s options, and its `--empirical` mode (pipeline/audits/empirical_run.py):

    dpdistill audit --empirical runs/demo-... [--canaries 1000] [--noise-off] [teacher.KEY=VALUE ...]

Light at import, like flows/cli.py: torch, Opacus and the pipeline load in the handler.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


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
