"""`dlrover chaos`: run a job while killing or freezing random nodes and its master (the runner:
chaos.py)."""

from __future__ import annotations

import argparse
import sys

from master.config import SpecError, load_job_spec

BY_CHOICES = ("auto", "records", "steps", "time")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `chaos` subcommand and its flags."""
    ch = sub.add_parser(
        "chaos",
        help="run a job while killing or freezing random nodes and its master; report what it took",
    )
    ch.add_argument("job_yaml", help="the job spec")
    ch.add_argument("--kills", type=int, default=10, help="how many faults (default 10)")
    ch.add_argument("--seed", type=int, default=0, help="picks the targets (default 0)")
    ch.add_argument(
        "--actions",
        default="kill",
        help="what a fault does, comma-separated: kill (SIGKILL), freeze (SIGSTOP: the "
        "heartbeat timeout must find it; workers and the chief only); default kill",
    )
    ch.add_argument(
        "--by",
        choices=BY_CHOICES,
        default="auto",
        help="when faults fire: spread from 10%% to 85%% of the records, or 10%% to 70%% of the "
        "global steps or time of a fault-free run; auto (default) runs the job once without "
        "faults first and takes records if it has a dataset, else steps, else time",
    )
    ch.add_argument(
        "--baseline",
        action="store_true",
        help="first run without faults, to measure time lost (always so unless --by records)",
    )
    ch.add_argument("--out-dir", default="", help="run dirs go here (default: runs/chaos-TIME)")
    ch.add_argument("--report", default="", help="write the report as JSON here too")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Plan the faults, run the job under them and report; returns the exit code."""
    import os
    import time

    from master.cli.chaos import (
        ChaosAction,
        Trigger,
        format_report,
        measure,
        plan_kills,
        run_chaos,
        write_report,
    )

    try:
        spec = load_job_spec(args.job_yaml)
        names = [a.strip() for a in args.actions.split(",") if a.strip()]
        known = [a.value for a in ChaosAction]
        if not names or any(n not in known for n in names):
            raise ValueError(f"--actions {args.actions!r}: use one or more of {', '.join(known)}")
        actions = tuple(ChaosAction(n) for n in dict.fromkeys(names))
        plan_kills(spec, args.kills, args.seed, actions)  # refuse a bad plan before any run
    except (SpecError, ValueError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or os.path.join(
        spec.workdir, "runs", f"chaos-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    scale, base_wall = None, None
    try:
        if args.baseline or args.by != "records":
            print("== chaos: a fault-free run first, to measure the job", flush=True)
            scale, base_wall = measure(args.job_yaml, out_dir, sys.stdout)
        trigger = (
            scale.trigger()
            if args.by == "auto" and scale
            else Trigger("records" if args.by == "auto" else args.by)
        )
        plan = plan_kills(spec, args.kills, args.seed, actions, trigger, scale)
    except (RuntimeError, ValueError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    print(f"== chaos plan (seed {plan.seed}, by {trigger.value}): {', '.join(plan.kills)}")
    for note in plan.notes:
        print(f"   note: {note}")
    for warning in plan.warnings:
        print(f"   warning: {warning}")
    sys.stdout.flush()
    try:
        report = run_chaos(args.job_yaml, spec, plan, out_dir, base_wall, sys.stdout)
    except RuntimeError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    report.command = "dlrover " + " ".join(argv)
    print(format_report(report))
    if args.report:
        write_report(report, args.report)
    ok = (
        report.status == "succeeded" and report.records_missing == 0 and report.kills_not_fired == 0
    )
    return 0 if ok else 1
