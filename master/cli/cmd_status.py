"""`dlrover status`: print a running job's status, or watch it live."""

from __future__ import annotations

import argparse
import sys

from master.cli.admin_client import add_master_flags, admin_client


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `status` subcommand and its flags."""
    st = sub.add_parser("status", help="print the status of a running job (--watch: live view)")
    st.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=0.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until the job ends",
    )
    st.add_argument(
        "--show-dashboard-token",
        action="store_true",
        help="print the dashboard link with its login token (read from .dashboard_token next to "
        "--token-file); anyone with the link can read the dashboard",
    )
    add_master_flags(st)


def run(args: argparse.Namespace) -> int:
    """Show the status of the job whose master the flags name; returns the exit code."""
    import os

    from master.client import MasterError
    from master.observability.dashboard.auth import TOKEN_FILE, read_token
    from master.observability.status_view import DashboardAccess, show_status

    token_file = os.path.join(os.path.dirname(os.path.abspath(args.token_file)), TOKEN_FILE)
    try:
        token = read_token(token_file)
    except ValueError as e:
        if args.show_dashboard_token:
            print(f"dlrover: error: {e}", file=sys.stderr)
            return 2
        token = ""  # the screen then comes from the gRPC status alone
    access = DashboardAccess(token, token_file, args.ca_file, args.show_dashboard_token)
    try:
        client = admin_client(args)
    except MasterError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    return show_status(client, args.watch, sys.stdout, access)
