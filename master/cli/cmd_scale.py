"""`dlrover scale TYPE=N`: change how many nodes of one type a running job has."""

from __future__ import annotations

import argparse
import sys

from master.cli.admin_client import add_master_flags, admin_client


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `scale` subcommand and its flags."""
    sc = sub.add_parser(
        "scale", help="change the number of workers, evaluators or PS of a running job"
    )
    sc.add_argument(
        "target",
        metavar="TYPE=N",
        help="e.g. worker=3; ps=2 checkpoints, then restarts PS, chief and workers on 2 PS",
    )
    sc.add_argument("--reason", default="", help="shown in the job's events")
    add_master_flags(sc)


def run(args: argparse.Namespace) -> int:
    """Ask the master to scale one node type; returns the exit code."""
    from master.client import MasterError

    node_type, _, count = args.target.partition("=")
    if not count.isdigit():
        print(f"dlrover: error: {args.target!r}: expected TYPE=N, e.g. worker=3", file=sys.stderr)
        return 2
    try:
        reply = admin_client(args).scale(node_type, int(count), args.reason)
    except MasterError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    version = reply.cluster_version
    print(f"{node_type}: {reply.previous} -> {reply.replicas} (cluster version {version})")
    return 0
