"""KVClient: the master's KV store (KVStore service), with blocking get and wait.

Built on a MasterClient like RendezvousClient: one channel, token, node identity, retries.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from master.client.master import MasterClient
from master.pb import kv_pb2, kv_pb2_grpc

# Longest single blocking call; longer waits are split so no call outlives a lost connection.
MAX_WAIT_CHUNK_MS = 10_000


class KVClient:
    """Calls of the KVStore service; get and wait block up to a timeout in seconds."""

    def __init__(self, master: MasterClient) -> None:
        self.master = master
        self._stub = kv_pb2_grpc.KVStoreStub(master._channel)

    def set(self, key: bytes, value: bytes) -> None:
        req = kv_pb2.KVSetRequest(node=self.master._node_pb(), key=key, value=value)
        self.master._call(self._stub.Set, req)

    def get(self, key: bytes, timeout: float) -> bytes | None:
        """The value of key, waiting up to timeout seconds for it; None if it never came."""
        deadline = time.monotonic() + timeout
        while True:
            wait_ms = _chunk_ms(deadline)
            req = kv_pb2.KVGetRequest(node=self.master._node_pb(), key=key, wait_ms=wait_ms)
            reply = self.master._call(
                self._stub.Get, req, timeout=self.master.call_timeout + wait_ms / 1000
            )
            if reply.found:
                return reply.value
            if time.monotonic() >= deadline:
                return None

    def add(self, key: bytes, amount: int) -> int:
        req = kv_pb2.KVAddRequest(node=self.master._node_pb(), key=key, amount=amount)
        return self.master._call(self._stub.Add, req).value

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        req = kv_pb2.KVCompareSetRequest(
            node=self.master._node_pb(), key=key, expected=expected, desired=desired
        )
        return self.master._call(self._stub.CompareSet, req).value

    def wait(self, keys: Iterable[bytes], timeout: float) -> bool:
        """Wait up to timeout seconds until every key exists; whether they all do."""
        keys = list(keys)
        deadline = time.monotonic() + timeout
        while True:
            wait_ms = _chunk_ms(deadline)
            req = kv_pb2.KVWaitRequest(node=self.master._node_pb(), keys=keys, wait_ms=wait_ms)
            reply = self.master._call(
                self._stub.Wait, req, timeout=self.master.call_timeout + wait_ms / 1000
            )
            if reply.value:
                return True
            if time.monotonic() >= deadline:
                return False

    def check(self, keys: Iterable[bytes]) -> bool:
        req = kv_pb2.KVKeysRequest(node=self.master._node_pb(), keys=list(keys))
        return self.master._call(self._stub.Check, req).value

    def delete_key(self, key: bytes) -> bool:
        req = kv_pb2.KVKeyRequest(node=self.master._node_pb(), key=key)
        return self.master._call(self._stub.DeleteKey, req).value

    def num_keys(self) -> int:
        req = kv_pb2.KVNumKeysRequest(node=self.master._node_pb())
        return self.master._call(self._stub.NumKeys, req).count


def _chunk_ms(deadline: float) -> int:
    """The wait of the next blocking call: what is left until deadline, at most one chunk."""
    return max(0, min(MAX_WAIT_CHUNK_MS, int((deadline - time.monotonic()) * 1000)))
