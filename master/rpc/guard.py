"""Maps the domain errors of every servicer (Master, Rendezvous, KV) to gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import grpc

from master.job.migration import MigrationFailedError
from master.nodes.manager import MasterResumingError, StaleNodeError
from master.pb import common_pb2
from master.rendezvous.rounds import StaleRoundError
from master.sharding.ledger import BadReportError, StaleShardError
from master.sharding.service import DatasetConflictError, UnknownDatasetError

log = logging.getLogger(__name__)

NodeCheck = Callable[[common_pb2.NodeRef], None]
MAX_WAIT_MS = 60_000
# Status details travel in trailing metadata, which gRPC caps at 8 KiB by default.
MAX_DETAIL_CHARS = 1_000


def _detail(error: Exception) -> str:
    """The error's message, cut short: it may echo a huge field of the request back."""
    text = str(error)
    if len(text) <= MAX_DETAIL_CHARS:
        return text
    return f"{text[:MAX_DETAIL_CHARS]}... ({len(text):,} characters in all)"


def error_status(error: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status a domain error is answered with; None for an error that is a bug."""
    if isinstance(error, MasterResumingError):
        return grpc.StatusCode.UNAVAILABLE, str(error)  # clients retry UNAVAILABLE
    if isinstance(error, (StaleNodeError, StaleRoundError, StaleShardError)):
        return grpc.StatusCode.FAILED_PRECONDITION, _detail(error)
    if isinstance(error, UnknownDatasetError):
        return grpc.StatusCode.NOT_FOUND, _detail(error).strip("'\"")
    if isinstance(error, DatasetConflictError):
        return grpc.StatusCode.ALREADY_EXISTS, _detail(error)
    if isinstance(error, (BadReportError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT, _detail(error)
    if isinstance(error, MigrationFailedError):
        return grpc.StatusCode.ABORTED, _detail(error)
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the master did not apply it in time"
    return None


def guard(method: Callable) -> Callable:
    """A sync servicer method whose domain errors are answered with their status
    (`error_status`), so bad requests never crash the master; a bug is raised."""

    @functools.wraps(method)
    def wrapper(self: object, request: object, context: grpc.ServicerContext) -> object:
        try:
            return method(self, request, context)
        except Exception as e:
            status = error_status(e)
            if status is None:
                raise
            context.abort(*status)

    return wrapper


async def answer_error(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """On the aio server: answer a domain error with its status; a bug is raised."""
    status = error_status(error)
    if status is None:
        raise error
    await context.abort(*status)


def check_wait_ms(wait_ms: int) -> float:
    """A request's wait_ms, validated, in seconds."""
    if not 0 <= wait_ms <= MAX_WAIT_MS:
        raise ValueError(f"wait_ms must be in [0, {MAX_WAIT_MS}], got {wait_ms}")
    return wait_ms / 1000


class CallWatch:
    """is_active() for a blocking call; wakes the waiters once if the call ends early
    (client cancelled or died), so a dead client does not hold a server thread until timeout."""

    def __init__(self, context: grpc.ServicerContext, wake: Callable[[], None]) -> None:
        self._context = context
        self._wake = wake
        self._returned = False
        self._ended = False
        context.add_callback(self._on_end)

    def _on_end(self) -> None:
        self._ended = True
        if not self._returned:
            self._wake()

    def is_active(self) -> bool:
        # The aio server's context for a method run in its thread pool has no is_active().
        is_active = getattr(self._context, "is_active", None)
        return is_active() if is_active is not None else not self._ended

    def __enter__(self) -> CallWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self._returned = True
