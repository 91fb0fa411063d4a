"""`dlrover chaos`: run a job while killing random nodes and its master (the runner: chaos.py)."""

from __future__ import annotations

import argparse
import sys

from master.config import SpecError, load_job_spec


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `chaos` subcommand and its flags."""
    ch = sub.add_parser(
        "chaos", help="run a job while killing random nodes and its master; report what it took"
    )
    ch.add_argument("job_yaml", help="the job spec")
    ch.add_argument("--kills", type=int, default=10, help="how many kills (default 10)")
    ch.add_argument("--seed", type=int, default=0, help="picks the targets (default 0)")
    ch.add_argument(
        "--baseline", action="store_true", help="first run without faults, to measure time lost"
    )
    ch.add_argument("--out-dir", default="", help="run dirs go here (default: runs/chaos-TIME)")
    ch.add_argument("--report", default="", help="write the report as JSON here too")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Plan the kills, run the job under them and report; returns the exit code."""
    import os
    import time

    from master.cli.chaos import format_report, plan_kills, run_chaos, write_report

    try:
        spec = load_job_spec(args.job_yaml)
        plan = plan_kills(spec, args.kills, args.seed)
    except (SpecError, ValueError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or os.path.join(
        spec.workdir, "runs", f"chaos-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    print(f"== chaos plan (seed {plan.seed}): {', '.join(plan.kills)}")
    for warning in plan.warnings:
        print(f"   warning: {warning}")
    sys.stdout.flush()
    try:
        report = run_chaos(args.job_yaml, spec, plan, out_dir, args.baseline, sys.stdout)
    except RuntimeError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    report.command = "dlrover " + " ".join(argv)
    print(format_report(report))
    if args.report:
        write_report(report, args.report)
    ok = report.status == "succeeded" and report.records_missing == 0
    return 0 if ok else 1
