"""What `dlrover status`, `scale` and `migrate` share: the flags that reach a running master
(address, token, TLS) and the client made from them."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from master.client import MasterClient


def add_master_flags(cmd: argparse.ArgumentParser) -> None:
    """Add --addr, --token-file and the TLS flags to a subcommand that talks to a master."""
    cmd.add_argument("--addr", required=True, help="master host:port")
    cmd.add_argument("--token-file", required=True, help="the run's .job_token file")
    cmd.add_argument("--ca-file", default="", help="TLS: the CA of a master run with --tls")
    cmd.add_argument("--client-cert", default="", help="mutual TLS: this client's cert")
    cmd.add_argument("--client-key", default="", help="mutual TLS: this client's key")


def admin_client(args: argparse.Namespace) -> MasterClient:
    """A MasterClient for the master the flags of add_master_flags name."""
    from master.client import MasterClient, read_token
    from master.client.tls import ClientTLS

    token = read_token({"DLROVER_JOB_TOKEN_FILE": args.token_file})
    tls = ClientTLS(args.ca_file, args.client_cert, args.client_key) if args.ca_file else None
    return MasterClient(args.addr, token, retry_seconds=2.0, call_timeout=30.0, tls=tls)
