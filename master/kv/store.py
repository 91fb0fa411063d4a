"""The master's key-value store behind torch's `Store`: bytes keys and values, blocking waits.

Semantics follow torch's c10d stores: `add` keeps an int64 counter as decimal text and creates a
missing key at 0; `compare_set` sets when the stored value equals `expected`, or when the key is
missing and `expected` is empty, and returns the value the key holds afterwards (`expected` itself
when the key is missing and nothing was set). Waiters sleep on a condition variable and wake on
every write. Entries go to the state store, so a restarted master keeps them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from master.state.api import StateStore

log = logging.getLogger(__name__)

TABLE = "kv"
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_KEY_BYTES = 4096


def _always_active() -> bool:
    return True


class KVStore:
    """A thread-safe bytes-to-bytes map with blocking get and wait."""

    def __init__(self, store: StateStore | None = None) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._data: dict[bytes, bytes] = {}
        self._listeners: list[Callable[[bytes, bytes], None]] = []
        self._closed = False
        if store is not None:
            for hex_key, value in store.scan(TABLE).items():
                self._data[bytes.fromhex(hex_key)] = value
            if self._data:
                log.info("KV store resumes with %d key(s)", len(self._data))

    def set(self, key: bytes, value: bytes) -> None:
        """Store value under key, replacing any previous value."""
        _check_key(key)
        with self._cond:
            self._put(key, value)
        self._tell(key, value)

    def add_listener(self, listener: Callable[[bytes, bytes], None]) -> None:
        """Call listener(key, value) after every set and add (outside the store's lock)."""
        self._listeners.append(listener)

    def _tell(self, key: bytes, value: bytes) -> None:
        for listener in self._listeners:
            try:
                listener(key, value)
            except Exception:  # a listener's bug must not fail the write
                log.exception("KV listener failed on %r", key)

    def get(
        self, key: bytes, timeout: float, is_active: Callable[[], bool] = _always_active
    ) -> bytes | None:
        """The value of key, waiting up to timeout seconds for it to appear; None if it did not."""
        _check_key(key)
        with self._cond:
            if self._wait_for(lambda: key in self._data, timeout, is_active):
                return self._data[key]
            return None

    def add(self, key: bytes, amount: int) -> int:
        """Add amount to the int64 counter under key (a missing key counts as 0); the new value."""
        _check_key(key)
        with self._cond:
            raw = self._data.get(key, b"0")
            try:
                current = int(raw.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                raise ValueError(
                    f"add: key {key!r} holds {raw[:40]!r}, not an integer; add only to counter "
                    "keys (created by add, or set to decimal text)"
                ) from None
            value = current + amount
            if not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(f"add: key {key!r} would overflow int64 ({current} + {amount})")
            self._put(key, str(value).encode("ascii"))
        self._tell(key, str(value).encode("ascii"))
        return value

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """torch's compare_set: set desired if key holds expected (or is missing and expected
        is empty); returns what key holds afterwards, or expected when key is missing."""
        _check_key(key)
        with self._cond:
            current = self._data.get(key)
            if current is None:
                if expected:
                    return expected
                self._put(key, desired)
                return desired
            if current == expected:
                self._put(key, desired)
                return desired
            return current

    def wait(
        self,
        keys: Iterable[bytes],
        timeout: float,
        is_active: Callable[[], bool] = _always_active,
    ) -> bool:
        """Wait up to timeout seconds until every key exists; whether they all do."""
        wanted = list(keys)
        for key in wanted:
            _check_key(key)
        with self._cond:
            return self._wait_for(lambda: all(k in self._data for k in wanted), timeout, is_active)

    def check(self, keys: Iterable[bytes]) -> bool:
        """Whether every key exists now."""
        with self._cond:
            return all(k in self._data for k in keys)

    def delete(self, key: bytes) -> bool:
        """Remove key; whether it existed."""
        with self._cond:
            if key not in self._data:
                return False
            del self._data[key]
            if self._store is not None:
                self._store.delete(TABLE, key.hex())
            return True

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def close(self) -> None:
        """End every wait now and any later one at once: the master is stopping, and a handler
        thread blocked in a wait would hold the process's exit until the wait timed out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter so it re-checks (e.g. its RPC was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    # -- internals ----------------------------------------------------------

    def _put(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        if self._store is not None:
            self._store.put(TABLE, key.hex(), value)
        self._cond.notify_all()

    def _wait_for(self, ready: Callable[[], bool], timeout: float, is_active: Callable) -> bool:
        deadline = time.monotonic() + timeout
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed or not is_active():
                return False
            self._cond.wait(remaining)
        return True


def _check_key(key: bytes) -> None:
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"KV key of {len(key)} bytes is longer than {MAX_KEY_BYTES}; shorten it")
