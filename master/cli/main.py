"""The `dlrover` command: its subcommands (one module each) and which one runs."""

from __future__ import annotations

import argparse
import sys

from master.cli import (
    cmd_brain,
    cmd_chaos,
    cmd_checkpoint,
    cmd_convert,
    cmd_logs,
    cmd_migrate,
    cmd_scale,
    cmd_status,
    cmd_submit,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `dlrover` and all its subcommands."""
    p = argparse.ArgumentParser(prog="dlrover", description="Elastic distributed training master")
    sub = p.add_subparsers(dest="cmd", required=True)
    cmd_submit.add_parsers(sub)  # submit, master
    cmd_brain.add_parser(sub)
    cmd_status.add_parser(sub)
    cmd_scale.add_parser(sub)
    cmd_chaos.add_parser(sub)
    cmd_logs.add_parser(sub)
    cmd_migrate.add_parser(sub)
    cmd_convert.add_parser(sub)
    cmd_checkpoint.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run `dlrover` with argv (default: sys.argv[1:]); returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.cmd == "status":
        return cmd_status.run(args)
    if args.cmd == "scale":
        return cmd_scale.run(args)
    if args.cmd == "migrate":
        return cmd_migrate.run(args)
    if args.cmd == "logs":
        return cmd_logs.run(args)
    if args.cmd == "chaos":
        return cmd_chaos.run(args, argv)
    if args.cmd == "convert":
        return cmd_convert.run(args)
    if args.cmd == "checkpoint":
        return cmd_checkpoint.run(args)
    if args.cmd == "brain":
        return cmd_brain.run(args)
    return cmd_submit.run(args, argv)
