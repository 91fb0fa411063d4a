"""Blocking calls on the aio server whose thread is freed as soon as their call ends.

grpc.aio runs a sync handler in its thread pool and runs what the handler gave `add_callback`
only after the handler has returned: a wait made for a client that died or cancelled keeps its
thread until its own timeout (up to `wait_ms`), and a stopping master waits for it at exit.
`blocking(method)` runs the sync `method` in the loop's pool from a coroutine instead, with a
context that ends (callbacks run, `is_active()` turns False) when the coroutine does: when the
call completes, is cancelled by its client, or the server stops."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import grpc

from master.rpc.kv_servicer import KVServicer
from master.rpc.rendezvous_servicer import RendezvousServicer


class _Aborted(Exception):
    """A sync handler's `context.abort(code, details)`, answered by its coroutine."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class ThreadContext:
    """What a blocking sync handler uses of its context, from a pool thread: `is_active`,
    `add_callback` (run once when the call ends) and `abort`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._ended = False

    def is_active(self) -> bool:
        return not self._ended

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if not self._ended:
                self._callbacks.append(callback)
                return True
        callback()
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    def end(self) -> None:
        with self._lock:
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


def blocking(method: Callable) -> Callable:
    """The servicer method `method` (sync, possibly blocking) as a coroutine method that runs
    it in the loop's pool and ends its context when the call ends."""

    async def run(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        call = ThreadContext()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, method, self, request, call)
        except _Aborted as e:
            await context.abort(e.code, e.details)
        finally:
            call.end()

    run.__name__ = method.__name__
    run.__doc__ = method.__doc__
    return run


class AioKVServicer(KVServicer):
    """The KV service whose waits end with their call."""

    Get = blocking(KVServicer.Get)
    Wait = blocking(KVServicer.Wait)


class AioRendezvousServicer(RendezvousServicer):
    """The Rendezvous service whose waits end with their call."""

    WaitRound = blocking(RendezvousServicer.WaitRound)
    Watch = blocking(RendezvousServicer.Watch)
