"""The interface through which the master keeps its durable state (nodes, shards, KV, ...)."""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager
from types import TracebackType


class StateStoreError(RuntimeError):
    """The state store cannot be opened or used; the message names the path and the fix."""


class StateStore(abc.ABC):
    """Durable key-value tables for the master's state.

    Tables and keys are any strings; values are bytes (callers serialise, e.g. protobuf).
    """

    # Most writes one transaction may hold (etcd refuses more than its --max-txn-ops); None: no
    # limit, so a writer may put any number of small rows in one transaction.
    max_writes_per_transaction: int | None = None

    @abc.abstractmethod
    def get(self, table: str, key: str) -> bytes | None:
        """The value stored under (table, key), or None."""

    @abc.abstractmethod
    def put(self, table: str, key: str, value: bytes) -> None:
        """Store value under (table, key), replacing any previous value."""

    @abc.abstractmethod
    def delete(self, table: str, key: str) -> None:
        """Remove (table, key); deleting a missing key is not an error."""

    @abc.abstractmethod
    def scan(self, table: str) -> dict[str, bytes]:
        """All entries of one table, ordered by key."""

    @abc.abstractmethod
    def transaction(self) -> AbstractContextManager[None]:
        """Writes inside commit atomically at exit and roll back on exception.

        Re-entrant: a nested transaction is part of the outer one (an exception that leaves only
        the nested block undoes only the nested block's writes)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store; later calls raise StateStoreError. Closing twice is allowed."""

    def __enter__(self) -> StateStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
