"""`dlrover checkpoint ls|gc`: flash-checkpoint shared memory on this machine, and freeing it."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

SHM_CLEAN = "dlrover_torch.checkpoint.shm_clean"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `checkpoint` subcommand and its flags."""
    ck = sub.add_parser(
        "checkpoint",
        help="list (ls) or free (gc) flash-checkpoint shared memory on this machine",
        description="Every group of flash-checkpoint segments of this user in /dev/shm: held by a "
        "live owner or orphaned, its size, newest step, whether that step is on disk. gc frees "
        "orphans past their grace (or whose step is on disk), writing a step held only in memory "
        "to its checkpoint dir first; --now frees every orphan.",
    )
    ck.add_argument("action", choices=("ls", "gc"))
    ck.add_argument("--now", action="store_true", help="gc: free every orphan now")
    ck.add_argument("--grace", type=float, help="gc: seconds ownerless before freed (300)")
    ck.add_argument("--shm-dir", help="where the segments live (/dev/shm)")


def run(args: argparse.Namespace) -> int:
    """Run the flash checkpoint's own command (it needs torch, which `dlrover` does not load)."""
    if (
        importlib.util.find_spec("dlrover_torch") is None
        or importlib.util.find_spec("torch") is None
    ):
        print(
            "dlrover: error: flash checkpoint is part of the torch extra; install it with "
            "`pip install 'dlrover-elastic[torch]'` (or the repo's `pip install -e '.[torch]'`)",
            file=sys.stderr,
        )
        return 2
    command = [sys.executable, "-m", SHM_CLEAN, args.action]
    if args.now:
        command.append("--now")
    if args.grace is not None:
        command += ["--grace", str(args.grace)]
    if args.shm_dir:
        command += ["--shm-dir", args.shm_dir]
    return subprocess.run(command, check=False).returncode
