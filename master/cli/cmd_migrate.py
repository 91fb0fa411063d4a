"""`dlrover migrate TYPE-RANK`: move a PS to new CPU or memory while the job trains."""

from __future__ import annotations

import argparse
import sys

from master.cli.admin_client import add_master_flags, admin_client


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `migrate` subcommand and its flags."""
    mg = sub.add_parser(
        "migrate", help="move a PS to new CPU or memory while the job trains (same address)"
    )
    mg.add_argument("node", metavar="TYPE-RANK", help="e.g. ps-0")
    mg.add_argument("--memory-mb", type=int, default=0, help="the new memory limit")
    mg.add_argument("--cpu", type=float, default=0.0, help="the new CPU count")
    mg.add_argument("--reason", default="", help="shown in the job's events")
    add_master_flags(mg)


def run(args: argparse.Namespace) -> int:
    """Ask the master to migrate one node; returns the exit code."""
    from master.client import MasterError

    node_type, _, rank = args.node.rpartition("-")
    if not node_type or not rank.isdigit():
        print(f"dlrover: error: {args.node!r}: expected TYPE-RANK, e.g. ps-0", file=sys.stderr)
        return 2
    try:
        reply = admin_client(args).migrate(
            node_type, int(rank), args.memory_mb, args.cpu, args.reason
        )
    except MasterError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.node} moved: now id {reply.node_id}, restoring the checkpoint of step "
        f"{reply.checkpoint_step}"
    )
    return 0
