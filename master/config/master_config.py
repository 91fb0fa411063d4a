"""The master process's own settings (address, token, state, TLS), apart from the job it runs."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

RPC_SERVERS = ("sync", "aio")


@dataclass(frozen=True)
class MasterConfig:
    """Settings of the master process itself (not of the job it runs)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    # "" = generate (secrets.token_urlsafe(32)); kept out of repr so it never lands in logs.
    job_token: str = field(default="", repr=False)
    state_path: str = ":memory:"  # SQLite file of the job's durable state
    heartbeat_interval_seconds: float = 2.0
    # gRPC server threads, made as needed: torch agents each hold one or two in blocking calls.
    max_workers: int = 512
    # "aio": grpc.aio, with heartbeats, shard asks and progress streams answered on its event
    # loop (less CPU per message, no thread per stream); "sync": grpc's thread-per-call server.
    rpc_server: str = "aio"
    # TLS: tls_auto makes a per-job CA with mutual TLS; or give the master's cert and key
    # and the CA that nodes must trust (server-side TLS only).
    tls_auto: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(
                f"MasterConfig.port: {self.port} is out of range. "
                "Use 0..65535 (0 picks a free port)."
            )
        if not (
            self.heartbeat_interval_seconds > 0 and math.isfinite(self.heartbeat_interval_seconds)
        ):
            raise ValueError(
                f"MasterConfig.heartbeat_interval_seconds: {self.heartbeat_interval_seconds} "
                "must be a positive number of seconds. Use e.g. 2.0."
            )
        if self.max_workers < 1:
            raise ValueError(
                f"MasterConfig.max_workers: {self.max_workers} must be at least 1. Use e.g. 128."
            )
        if self.rpc_server not in RPC_SERVERS:
            raise ValueError(
                f"MasterConfig.rpc_server: {self.rpc_server!r} is not a server kind. "
                f"Use one of {', '.join(RPC_SERVERS)}."
            )
        if not self.state_path:
            raise ValueError(
                "MasterConfig.state_path: empty. Use a file path, or ':memory:' for no durability."
            )
        manual = [f for f in ("tls_cert", "tls_key", "tls_ca") if getattr(self, f)]
        if manual and self.tls_auto:
            raise ValueError(
                "--tls makes the job's own certificates: drop it, or drop "
                + ", ".join("--" + f.replace("_", "-") for f in manual)
            )
        if manual and len(manual) != 3:
            missing = sorted({"tls_cert", "tls_key", "tls_ca"} - set(manual))
            raise ValueError(
                "TLS needs --tls-cert, --tls-key and --tls-ca together (the CA nodes trust); "
                f"missing: {', '.join('--' + f.replace('_', '-') for f in missing)}"
            )
        if not self.job_token:
            object.__setattr__(self, "job_token", secrets.token_urlsafe(32))
