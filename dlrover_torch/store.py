"""A torch.distributed Store served by the master's KV store, with blocking waits on the master.

`MasterStore` works wherever torch takes a Store (e.g. `init_process_group(store=...)`). Keys are
namespaced by `prefix`; `get` and `wait` block on the master until the keys exist or the store's
timeout passes, then raise `torch.distributed.DistStoreError` as torch's own stores do. An
unreachable master raises `torch.distributed.DistNetworkError`.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import grpc
import torch.distributed as dist

from master.client import KVClient, MasterError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(seconds=300)


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


class MasterStore(dist.Store):
    """torch's Store API on the master's KV store (keys namespaced by prefix)."""

    def __init__(
        self, client: KVClient, prefix: str = "", timeout: timedelta = DEFAULT_TIMEOUT
    ) -> None:
        super().__init__()
        self._client = client
        self.prefix = prefix
        self._prefix = prefix.encode("utf-8")
        self.set_timeout(timeout)

    def _key(self, key: str) -> bytes:
        return self._prefix + _as_bytes(key)

    def set_timeout(self, timeout: timedelta) -> None:
        """The default timeout of get and wait."""
        if timeout.total_seconds() < 0:
            raise ValueError(f"timeout must not be negative, got {timeout}")
        super().set_timeout(timeout)

    def set(self, key: str, value: bytes | str) -> None:
        with _errors("set", key):
            self._client.set(self._key(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of key; waits up to the store's timeout for it to be set."""
        with _errors("get", key):
            value = self._client.get(self._key(key), self.timeout.total_seconds())
        if value is None:
            raise _timeout_error(self.timeout, [key], self.prefix)
        return value

    def add(self, key: str, value: int) -> int:
        """Add value to the integer counter under key (created at 0); returns the new value."""
        with _errors("add", key):
            return self._client.add(self._key(key), int(value))

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        """Set desired_value if key holds expected_value (or is missing and expected is empty)."""
        with _errors("compare_set", key):
            return self._client.compare_set(
                self._key(key), _as_bytes(expected_value), _as_bytes(desired_value)
            )

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key is set; DistStoreError after timeout (default: the store's)."""
        timeout = self.timeout if timeout is None else timeout
        with _errors("wait", ",".join(keys)):
            ready = self._client.wait([self._key(k) for k in keys], timeout.total_seconds())
        if not ready:
            raise _timeout_error(timeout, keys, self.prefix)

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set now (does not wait)."""
        with _errors("check", ",".join(keys)):
            return self._client.check([self._key(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        """Delete key; whether it existed."""
        with _errors("delete_key", key):
            return self._client.delete_key(self._key(key))

    def num_keys(self) -> int:
        """Keys in the master's whole KV store (like torch's PrefixStore, not only this prefix)."""
        with _errors("num_keys", ""):
            return self._client.num_keys()


def _timeout_error(timeout: timedelta, keys: list[str], prefix: str) -> dist.DistStoreError:
    ms = int(timeout.total_seconds() * 1000)
    return dist.DistStoreError(
        f"wait timeout after {ms}ms, keys: {', '.join(prefix + k for k in keys)} "
        "(not set in the master's KV store; is every rank running and using the same prefix?)"
    )


class _errors:
    """Re-raise master errors as torch's store errors: network trouble or a store failure."""

    def __init__(self, op: str, key: str) -> None:
        self._op = op
        self._key = key

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if not isinstance(exc, MasterError):
            return None
        message = f"MasterStore.{self._op}({self._key!r}): {exc}"
        if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise dist.DistNetworkError(message) from exc
        if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
            raise ValueError(message) from exc
        raise dist.DistStoreError(message) from exc
