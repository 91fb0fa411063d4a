"""A StateStore on etcd v3, for deployments where the master's disk can vanish.

The client is etcd's own JSON gRPC gateway (`POST /v3/kv/range|put|deleterange|txn`, keys and
values base64 in JSON; served on every client URL of etcd >= 3.4) spoken with the standard
library. We deliberately use no client package: `etcd3` on PyPI was last released in 2020 and
ships generated protobuf code that breaks with the protobuf 4 our gRPC stack needs; urllib and
json are the whole client here, so there is no dependency and no protobuf conflict.

Layout: the value of (table, key) lives at `prefix + quote(table) + "/" + quote(key)`, each part
percent-encoded (`/` and `%` included), so names containing "/" never collide across tables.

Transactions hold the store's lock (writes and reads of other threads wait, as with SQLite),
buffer their writes in memory (reads inside see them), and commit at the outermost exit as one
etcd txn: all of it or none. A nested block that raises drops only its own writes.

Fencing: `transaction(expect={(table, key): value})` commits only if each key still holds the
given value (None: the key is absent), and `set_fence({...})` adds such a condition to every later
commit of this client, e.g. the master epoch, so a master that was replaced cannot write any
more. A failed condition raises `StateStoreFencedError` and writes nothing. Without a fence,
concurrent writers in *other* processes are not isolated from one another: last write wins.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from master.state.api import StateStore, StateStoreError

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "/dlrover/default/"
DEFAULT_TIMEOUT_SECONDS = 5.0
_SCAN_PAGE_KEYS = 1000  # keys per range request of a scan (all pages read at one revision)
_URL_FORMS = "etcd://host:port[,host:port]/prefix"
ETCD_DEFAULT_MAX_TXN_OPS = 128  # etcd's --max-txn-ops default

# Extra advice for etcd error replies a user can fix by changing a flag or the call.
_HINTS = {
    "too many operations in txn request": (
        "a transaction may write at most --max-txn-ops keys (etcd's default is 128): start "
        "etcd with a larger --max-txn-ops, or write fewer keys per transaction"
    ),
    "request is too large": (
        "one request may carry at most --max-request-bytes (etcd's default is 1.5 MiB): start "
        "etcd with a larger --max-request-bytes, or store smaller values per transaction"
    ),
}

Expectation = Mapping[tuple[str, str], bytes | None]


class StateStoreFencedError(StateStoreError):
    """A commit was refused because a guarded key no longer holds its expected value."""


@dataclass
class _Frame:
    """The pending writes (None = delete) and commit conditions of one transaction level."""

    writes: dict[bytes, bytes | None] = field(default_factory=dict)
    expects: list[tuple[bytes, bytes | None]] = field(default_factory=list)


class EtcdStateStore(StateStore):
    """StateStore on an etcd v3 cluster; several endpoints are tried in turn when one is down."""

    max_writes_per_transaction = ETCD_DEFAULT_MAX_TXN_OPS

    def __init__(
        self,
        endpoints: str | list[str],
        prefix: str = DEFAULT_PREFIX,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        self.endpoints = _parse_endpoints(endpoints)
        if not prefix.endswith("/"):
            prefix += "/"
        self.prefix = prefix
        self.timeout = timeout
        hosts = ",".join(e.split("://", 1)[1] for e in self.endpoints)
        self.name = f"etcd://{hosts}{prefix}"
        self._lock = threading.RLock()
        self._frames: list[_Frame] = []  # open transaction levels; only the lock holder uses it
        self._fence: list[tuple[bytes, bytes | None]] = []
        self._preferred = 0  # index of the endpoint that answered last
        self._closed = False
        # Fail now, with the fix, rather than at the master's first write.
        self._call("kv/range", {"key": _b64(prefix.encode()), "limit": "1", "keys_only": True})
        logger.info("state store opened at %s", self.name)

    # -- keys -----------------------------------------------------------------------------

    def _table_prefix(self, table: str) -> bytes:
        return (self.prefix + quote(table, safe="") + "/").encode()

    def _key(self, table: str, key: str) -> bytes:
        return self._table_prefix(table) + quote(key, safe="").encode()

    def _conditions(self, expect: Expectation | None) -> list[tuple[bytes, bytes | None]]:
        conditions = []
        for (table, key), value in (expect or {}).items():
            _check_names(table, key)
            conditions.append((self._key(table, key), _value_or_none(value)))
        return conditions

    # -- StateStore ---------------------------------------------------------------------------

    def get(self, table: str, key: str) -> bytes | None:
        _check_names(table, key)
        k = self._key(table, key)
        with self._lock:
            self._check_open()
            for frame in reversed(self._frames):
                if k in frame.writes:
                    return frame.writes[k]
            reply = self._call("kv/range", {"key": _b64(k)})
        kvs = reply.get("kvs") or []
        return _b64d(kvs[0].get("value", "")) if kvs else None

    def put(self, table: str, key: str, value: bytes) -> None:
        _check_names(table, key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"state store value must be bytes, got {type(value).__name__}")
        self._write(self._key(table, key), bytes(value))

    def delete(self, table: str, key: str) -> None:
        _check_names(table, key)
        self._write(self._key(table, key), None)

    def scan(self, table: str) -> dict[str, bytes]:
        _check_names(table)
        start = self._table_prefix(table)
        end = start[:-1] + b"0"  # the first key after every key starting with ".../table/"
        entries: dict[bytes, bytes] = {}
        with self._lock:
            self._check_open()
            body: dict[str, Any] = {
                "key": _b64(start),
                "range_end": _b64(end),
                "limit": str(_SCAN_PAGE_KEYS),
            }
            while True:
                reply = self._call("kv/range", body)
                kvs = reply.get("kvs") or []
                for kv in kvs:
                    entries[_b64d(kv["key"])] = _b64d(kv.get("value", ""))
                if not reply.get("more") or not kvs:
                    break
                # The next page starts after the last key, at the first page's revision.
                body["key"] = _b64(_b64d(kvs[-1]["key"]) + b"\0")
                body["revision"] = reply["header"]["revision"]
            for frame in self._frames:
                for k, v in frame.writes.items():
                    if k.startswith(start):
                        if v is None:
                            entries.pop(k, None)
                        else:
                            entries[k] = v
        decoded = {unquote(k[len(start) :].decode()): v for k, v in entries.items()}
        # Percent-encoding changes byte order ("/" -> "%2F"), so sort the decoded names.
        return {k: decoded[k] for k in sorted(decoded)}

    @contextlib.contextmanager
    def transaction(self, expect: Expectation | None = None) -> Iterator[None]:
        """Writes inside commit as one etcd txn at the outermost exit; see the module docstring.

        expect: {(table, key): value or None}; the commit happens only if each key holds that
        value (None: is absent) at commit time, else StateStoreFencedError and nothing is written.
        A nested block's conditions become conditions of the outer commit."""
        conditions = self._conditions(expect)
        with self._lock:
            self._check_open()
            frame = _Frame(expects=conditions)
            self._frames.append(frame)
            try:
                yield
            finally:
                self._frames.pop()
            # Reached only when the block ended without an exception.
            if self._frames:
                parent = self._frames[-1]
                parent.writes.update(frame.writes)
                parent.expects.extend(frame.expects)
            elif frame.writes or frame.expects:
                self._commit(frame.writes, frame.expects)

    def set_fence(self, expect: Expectation | None) -> None:
        """Make every later commit of this client conditional on expect (None: no fence)."""
        conditions = self._conditions(expect)
        with self._lock:
            self._fence = conditions

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._frames:
                raise StateStoreError(
                    f"state store {self.name!r}: close() called inside a transaction; "
                    "close it after the transaction block ends"
                )
            self._closed = True

    # -- writing ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StateStoreError(f"state store {self.name!r} is closed")

    def _write(self, k: bytes, value: bytes | None) -> None:
        with self._lock:
            self._check_open()
            if self._frames:
                self._frames[-1].writes[k] = value
            else:
                self._commit({k: value}, [])

    def _commit(
        self, writes: dict[bytes, bytes | None], expects: list[tuple[bytes, bytes | None]]
    ) -> None:
        conditions = [*self._fence, *expects]
        ops = [
            {"request_delete_range": {"key": _b64(k)}}
            if v is None
            else {"request_put": {"key": _b64(k), "value": _b64(v)}}
            for k, v in writes.items()
        ]
        compares = [
            {"key": _b64(k), "result": "EQUAL", "target": "VERSION", "version": "0"}
            if v is None
            else {"key": _b64(k), "result": "EQUAL", "target": "VALUE", "value": _b64(v)}
            for k, v in conditions
        ]
        reply = self._call("kv/txn", {"compare": compares, "success": ops})
        if not reply.get("succeeded"):  # the gateway omits false booleans
            raise StateStoreFencedError(self._fence_message(conditions, len(ops)))

    def _fence_message(self, conditions: list[tuple[bytes, bytes | None]], n_writes: int) -> str:
        failed = []
        for k, expected in conditions:
            kvs = self._call("kv/range", {"key": _b64(k)}).get("kvs") or []
            actual = _b64d(kvs[0].get("value", "")) if kvs else None
            if actual != expected:
                name = k[len(self.prefix) :].decode()
                failed.append(f"{unquote(name)!r} holds {actual!r}, expected {expected!r}")
        what = "; ".join(failed) or "a guarded key changed between the commit and this check"
        return (
            f"state store {self.name!r}: commit of {n_writes} write(s) refused, nothing was "
            f"written: {what}. Another writer (e.g. a newer master of this job) owns the state "
            "now; this process must stop writing, or re-read the state and retry."
        )

    # -- HTTP ---------------------------------------------------------------------------------

    def _call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST body to /v3/<method>, trying each endpoint whose connection fails in turn."""
        data = json.dumps(body).encode()
        unreachable = []
        n = len(self.endpoints)
        for i in range(n):
            index = (self._preferred + i) % n
            endpoint = self.endpoints[index]
            request = urllib.request.Request(
                f"{endpoint}/v3/{method}",
                data=data,
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = response.read()
            except urllib.error.HTTPError as e:
                raise self._reply_error(endpoint, method, e) from None
            except urllib.error.URLError as e:
                # Raised while connecting or sending: etcd did not act on it; try the next one.
                unreachable.append(f"{endpoint} ({e.reason})")
                continue
            except (OSError, http.client.HTTPException) as e:
                raise StateStoreError(
                    f"state store {self.name!r}: etcd at {endpoint} did not answer {method} "
                    f"within {self.timeout:g} s ({e!r}); a write's outcome is unknown. Check that "
                    "etcd is healthy (etcdctl endpoint health) or raise the store's timeout."
                ) from None
            self._preferred = index
            try:
                return json.loads(payload)
            except ValueError:
                raise StateStoreError(
                    f"state store {self.name!r}: {endpoint} answered {method} with "
                    f"{payload[:80]!r}, not etcd JSON. Point the store at an etcd >= 3.4 client "
                    "URL (its --advertise-client-urls)."
                ) from None
        raise StateStoreError(
            f"state store {self.name!r}: etcd is unreachable at {'; '.join(unreachable)}. "
            "Start etcd listening there (--listen-client-urls), or set the state store URL "
            f"({_URL_FORMS}) to a running etcd's client URLs."
        )

    def _reply_error(
        self, endpoint: str, method: str, e: urllib.error.HTTPError
    ) -> StateStoreError:
        try:
            raw = e.read()
        except OSError:
            raw = b""
        try:
            message = str(json.loads(raw).get("message") or raw[:200])
        except (ValueError, AttributeError):
            message = repr(raw[:200])
        if e.code == 404:
            fix = (
                "this is not an etcd >= 3.4 client URL (no /v3/ gateway there); use the URL "
                "etcd advertises for clients (--advertise-client-urls), not its peer URL"
            )
        else:
            fix = next((hint for text, hint in _HINTS.items() if text in message), "")
            fix = fix or "check the etcd server's log for the cause"
        return StateStoreError(
            f"state store {self.name!r}: etcd at {endpoint} refused {method} "
            f"(HTTP {e.code}: {message}). Fix: {fix}."
        )


def _parse_endpoints(endpoints: str | list[str]) -> list[str]:
    """Normalise "host:port" / "http(s)://host:port" items (or one comma list) to base URLs."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    urls = []
    for item in items:
        item = item.strip().rstrip("/")
        if "://" not in item:
            item = "http://" + item
        scheme, _, hostport = item.partition("://")
        if scheme not in ("http", "https") or not hostport or "/" in hostport:
            raise StateStoreError(
                f"etcd endpoint {item!r} is not host:port or http(s)://host:port. "
                f"Give the client URLs of the etcd cluster, e.g. 127.0.0.1:2379 ({_URL_FORMS})."
            )
        urls.append(item)
    if not urls:
        raise StateStoreError(f"no etcd endpoint given. Use e.g. {_URL_FORMS}.")
    return urls


def _value_or_none(value: object) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"state store value must be bytes or None, got {type(value).__name__}")
    return bytes(value)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _b64d(text: str) -> bytes:
    return base64.b64decode(text)


def _check_names(*names: object) -> None:
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"state store table and key must be str, got {type(name).__name__}")
