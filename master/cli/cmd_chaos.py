"""`dlrover chaos`: run a job while killing or freezing random nodes and its master, or removing
their Ray nodes (the runner: chaos.py; what a Ray cluster can spare: chaos_ray.py)."""

from __future__ import annotations

import argparse
import sys

from master.config import JobSpec, SpecError, load_job_spec

BY_CHOICES = ("auto", "records", "steps", "time")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `chaos` subcommand and its flags."""
    ch = sub.add_parser(
        "chaos",
        help="run a job while killing or freezing random nodes and its master, or removing their "
        "Ray nodes; report what it took",
    )
    ch.add_argument("job_yaml", help="the job spec")
    ch.add_argument("--kills", type=int, default=10, help="how many faults (default 10)")
    ch.add_argument("--seed", type=int, default=0, help="picks the targets (default 0)")
    ch.add_argument(
        "--actions",
        default="",
        help="what a fault does, comma-separated: kill (SIGKILL), freeze (SIGSTOP: the "
        "heartbeat timeout must find it; workers and the chief only), node (the target's Ray node "
        "removed, every rank on it lost at once; --platform ray --ray-address only, at most as "
        "many as the cluster can spare); default kill, and node too on --platform ray "
        "--ray-address when the cluster can spare a Ray node",
    )
    ch.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="TYPE:RANK@WHEN[:ACTION]",
        help="run these faults (as `dlrover submit --kill`) instead of a random plan, e.g. to "
        "replay one; --kills, --seed and --actions are then not used. May repeat.",
    )
    ch.add_argument(
        "--platform",
        choices=("local", "ray"),
        default="local",
        help="where the job runs (as `dlrover submit --platform`; default local)",
    )
    ch.add_argument(
        "--ray-address", default="", help="with --platform ray: the cluster (default: start one)"
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
        given_plan,
        measure,
        plan_kills,
        run_chaos,
        write_report,
    )

    try:
        spec = load_job_spec(args.job_yaml)
        auto = not args.actions  # kill, and node where the Ray cluster can spare nodes
        on_ray_cluster = args.platform == "ray" and bool(args.ray_address)
        names = [a.strip() for a in (args.actions or "kill").split(",") if a.strip()]
        known = [a.value for a in ChaosAction]
        if not names or any(n not in known for n in names):
            raise ValueError(f"--actions {args.actions!r}: use one or more of {', '.join(known)}")
        actions = tuple(ChaosAction(n) for n in dict.fromkeys(names))
        given = given_plan(spec, args.kill, args.seed) if args.kill else None
        removes = ChaosAction.REMOVE_NODE in actions
        submit_args = _submit_args(args, given.removes_nodes if given else removes)
        spare = 0
        if not given and (removes or (auto and on_ray_cluster)):
            spare = _spare_ray_nodes(args, spec)
            if auto and spare:
                actions += (ChaosAction.REMOVE_NODE,)
        if not given:  # refuse a bad plan before any run
            plan_kills(spec, args.kills, args.seed, actions, spare_ray_nodes=spare)
    except (SpecError, ValueError) as e:  # FaultSpecError is a ValueError
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # PlatformError: the Ray cluster cannot be reached
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    out_dir = args.out_dir or os.path.join(
        spec.workdir, "runs", f"chaos-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    scale, base_wall = None, None
    try:
        if args.baseline or (args.by != "records" and not given):
            print("== chaos: a fault-free run first, to measure the job", flush=True)
            scale, base_wall = measure(args.job_yaml, out_dir, sys.stdout, submit_args)
        if given:
            plan = given
        else:
            trigger = (
                scale.trigger()
                if args.by == "auto" and scale
                else Trigger("records" if args.by == "auto" else args.by)
            )
            plan = plan_kills(
                spec, args.kills, args.seed, actions, trigger, scale, spare_ray_nodes=spare
            )
    except (RuntimeError, ValueError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    what = "given" if args.kill else f"seed {plan.seed}"
    print(f"== chaos plan ({what}, by {plan.trigger.value}): {', '.join(plan.kills)}")
    for note in plan.notes:
        print(f"   note: {note}")
    for warning in plan.warnings:
        print(f"   warning: {warning}")
    sys.stdout.flush()
    try:
        report = run_chaos(args.job_yaml, spec, plan, out_dir, base_wall, sys.stdout, submit_args)
    except RuntimeError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    report.command = "dlrover " + " ".join(argv)
    print(format_report(report))
    if args.report:
        write_report(report, args.report)
    ok = (
        report.status == "succeeded"
        and report.records_missing == 0
        and report.kills_not_fired == 0
        and report.kills_failed == 0
    )
    return 0 if ok else 1


def _submit_args(args: argparse.Namespace, removes_nodes: bool) -> tuple[str, ...]:
    """The platform flags for `dlrover submit`; a Ray node removal needs a Ray cluster's
    address (`dlrover submit` checks the `--kill` values it is given itself)."""
    if removes_nodes and (args.platform != "ray" or not args.ray_address):
        raise ValueError(
            "--actions node removes Ray nodes: it needs --platform ray --ray-address ADDRESS "
            "(a Ray cluster of several Ray nodes); leave node out of --actions otherwise"
        )
    out = ("--platform", args.platform)
    return out + (("--ray-address", args.ray_address) if args.ray_address else ())


def _spare_ray_nodes(args: argparse.Namespace, spec: JobSpec) -> int:
    """How many Ray nodes the job can lose on the cluster at --ray-address (said)."""
    from master.cli.chaos_ray import job_cpu, spare_ray_nodes, survey

    nodes, here = survey(args.ray_address)
    spare = spare_ray_nodes(nodes, here, job_cpu(spec))
    print(
        f"== chaos: the Ray cluster at {args.ray_address} has {len(nodes)} Ray nodes alive; the "
        f"job can lose {spare} of them (never the head's nor this machine's)",
        flush=True,
    )
    return spare
