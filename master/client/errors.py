"""The errors every client call raises: what failed, and what to check."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a type here: a process that raises none of these need not load grpc
    import grpc


class MasterError(RuntimeError):
    """A call to the master failed; the message says what to check."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class StaleNodeError(MasterError):
    """The master no longer accepts this node incarnation or shard (FAILED_PRECONDITION)."""
