"""Maps the domain errors of the torch-facing services to gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import grpc

from master.nodes.manager import MasterResumingError, StaleNodeError
from master.pb import common_pb2
from master.rendezvous.rounds import StaleRoundError

log = logging.getLogger(__name__)

NodeCheck = Callable[[common_pb2.NodeRef], None]
MAX_WAIT_MS = 60_000


def guard(method: Callable) -> Callable:
    """Stale identities and rounds become FAILED_PRECONDITION, bad input INVALID_ARGUMENT."""

    @functools.wraps(method)
    def wrapper(self: object, request: object, context: grpc.ServicerContext) -> object:
        try:
            return method(self, request, context)
        except MasterResumingError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))  # clients retry UNAVAILABLE
        except (StaleNodeError, StaleRoundError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return wrapper


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
