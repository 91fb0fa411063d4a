"""`dlrover logs TYPE-RANK`: print a node's log, every incarnation in order."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `logs` subcommand and its flags."""
    lg = sub.add_parser("logs", help="print a node's log, every incarnation in order")
    lg.add_argument("node", metavar="TYPE-RANK", help="e.g. worker-1")
    lg.add_argument("--run-dir", required=True, help="the job's run dir (printed at start)")
    lg.add_argument("--tail", type=int, default=0, help="only the last N lines of each")


def run(args: argparse.Namespace) -> int:
    """Print the node's logs from the run dir; returns the exit code."""
    import glob
    import os

    pattern = os.path.join(args.run_dir, "logs", f"{args.node}.*.log")
    paths = sorted(glob.glob(pattern), key=lambda p: int(p.rsplit(".", 2)[-2]))
    if not paths:
        known = sorted(
            {
                os.path.basename(p).split(".")[0]
                for p in glob.glob(os.path.join(args.run_dir, "logs", "*.log"))
            }
        )
        print(
            f"dlrover: error: no log of {args.node!r} in {args.run_dir}/logs "
            f"(nodes with logs: {', '.join(known) or 'none'})",
            file=sys.stderr,
        )
        return 2
    for path in paths:
        node_id = path.rsplit(".", 2)[-2]
        print(f"===== {args.node} id {node_id} ({path}) =====")
        with open(path, errors="replace") as f:
            lines = f.readlines()
        sys.stdout.writelines(lines[-args.tail :] if args.tail > 0 else lines)
    return 0
