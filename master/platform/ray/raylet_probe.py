"""Whether a Ray node's raylet still answers: a node command killed as its raylet dies may
end (by a signal) before Ray has marked the node dead, and must not pass for a plain kill."""

from __future__ import annotations

import socket

# A raylet on a live host accepts a connection at once; a dead one refuses it (same host) or
# lets it time out (a host gone).
PROBE_TIMEOUT_SECONDS = 1.0


def raylet_answers(ip: str, port: int, timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """True when the raylet at ip:port accepts a TCP connection (or its port is unknown)."""
    if port <= 0:
        return True
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False
