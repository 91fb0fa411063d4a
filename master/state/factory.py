"""Pick and open the master's state store from one URL-like setting (SQLite file or etcd)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from master.state.api import StateStore, StateStoreError
from master.state.etcd import DEFAULT_TIMEOUT_SECONDS, EtcdStateStore
from master.state.sqlite import MEMORY_PATH, SQLiteStateStore

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
_FORMS = (
    "a SQLite file path, sqlite://<path> (sqlite:///abs/path.db), ':memory:', "
    "or etcd://host:port[,host:port][/prefix]"
)
_DEFAULT_ETCD_PORT = 2379


@dataclass(frozen=True)
class StateStoreURL:
    """A parsed state store setting: kind "sqlite" with path, or "etcd" with endpoints, prefix."""

    kind: str
    path: str = ""
    endpoints: tuple[str, ...] = ()
    prefix: str = ""


def parse_state_url(url: str, job: str = "default") -> StateStoreURL:
    """Parse url; an etcd URL without a path gets the prefix /dlrover/<job>/."""
    if not url:
        raise StateStoreError(f"state store URL is empty. Use {_FORMS}.")
    match = _SCHEME.match(url)
    if match is None:
        return StateStoreURL("sqlite", path=url)  # a plain path, or ':memory:'
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "sqlite":
        if not rest:
            raise StateStoreError(f"state store URL {url!r} names no file. Use {_FORMS}.")
        return StateStoreURL("sqlite", path=rest)
    if scheme != "etcd":
        raise StateStoreError(f"state store URL {url!r}: unknown scheme {scheme!r}. Use {_FORMS}.")
    hosts, slash, path = rest.partition("/")
    endpoints = []
    for host in hosts.split(","):
        host = host.strip()
        name, colon, port = host.rpartition(":") if ":" in host else (host, "", "")
        if not name or (colon and not port.isdigit()) or not 0 < int(port or 1) < 65536:
            raise StateStoreError(
                f"state store URL {url!r}: {host!r} is not host[:port]. "
                "Use etcd://host:port[,host:port][/prefix], "
                "e.g. etcd://10.0.0.5:2379,10.0.0.6:2379/dlrover/myjob"
            )
        endpoints.append(f"{name}:{port or _DEFAULT_ETCD_PORT}")
    path = path.strip("/")
    prefix = f"/{path}/" if path else f"/dlrover/{job}/"
    return StateStoreURL("etcd", endpoints=tuple(endpoints), prefix=prefix)


def open_state_store(
    url: str, job: str = "default", timeout: float = DEFAULT_TIMEOUT_SECONDS
) -> StateStore:
    """Open the store url names (see parse_state_url); errors are StateStoreError with the fix."""
    parsed = parse_state_url(url, job)
    if parsed.kind == "etcd":
        return EtcdStateStore(list(parsed.endpoints), parsed.prefix, timeout)
    return SQLiteStateStore(parsed.path or MEMORY_PATH)


def in_memory(url: str) -> bool:
    """Whether the store url names keeps nothing past its process (SQLite ':memory:')."""
    try:
        parsed = parse_state_url(url)
    except StateStoreError:
        return False
    return parsed.kind == "sqlite" and parsed.path == MEMORY_PATH
