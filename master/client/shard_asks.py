"""A node's shard asks as messages on one long-lived `ShardStream`, answered in order.

A unary `GetShard` costs the master and the node about twice what a message on an open stream
does (measured in benchmarks/sharding.py). An ask the stream cannot answer (the stream broke,
the master restarted, or the ask failed there) returns None and the caller asks again by a
unary call with the same ask id: a grant whose answer was lost is handed out again to the
same ask, never a second shard, and errors and retries stay those of the unary call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from master.pb import data_pb2

log = logging.getLogger(__name__)

# An ask unanswered this long past its own wait is given up (the call cancelled; the caller
# asks again by a unary call), as a unary call's deadline would.
WATCH_PERIOD_SECONDS = 1.0


class ShardAskStream:
    """Asks on one stream, one at a time; `ask` returns None where a unary call must answer."""

    _END = object()

    def __init__(self, open_call: Callable[[Iterator], grpc.Call], call_timeout: float) -> None:
        """`open_call(requests)`: starts the stream call (the stub's ShardStream with the
        node's metadata) over an iterator of requests."""
        self._open_call = open_call
        self._call_timeout = call_timeout
        self._lock = threading.Lock()  # one ask on the stream at a time
        self._requests: queue.SimpleQueue | None = None
        self._answers = None  # the call: an iterator of answers, cancellable
        self._deadline = 0.0  # of the ask in flight; 0 when none
        self._closed = False
        self._watcher: threading.Thread | None = None

    def ask(self, request: data_pb2.GetShardRequest) -> data_pb2.GetShardReply | None:
        """The stream's answer to `request`, or None: the stream is busy with another ask (of
        another thread), or did not answer it."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed:
                return None
            if self._answers is None:
                self._open()
            self._deadline = time.monotonic() + self._call_timeout + request.wait_ms / 1000
            self._requests.put(request)
            try:
                return next(self._answers)
            except (grpc.RpcError, StopIteration) as e:
                # The master ended the stream (restarted, or the ask failed there): the unary
                # call asks again and reports the failure as such; a new stream comes next time.
                # A master that serves no asks on streams is asked by unary calls from now on.
                if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._closed = True
                log.debug("shard ask stream ended (%s); asking by a unary call", e)
                self._drop()
                return None
            finally:
                self._deadline = 0.0
        finally:
            self._lock.release()

    def close(self) -> None:
        """End the stream (the master sees its end); later asks get None."""
        with self._lock:
            self._closed = True
            self._drop()

    def _open(self) -> None:
        requests: queue.SimpleQueue = queue.SimpleQueue()
        self._requests = requests
        self._answers = self._open_call(iter(requests.get, self._END))
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name="shard-asks-watch", daemon=True
            )
            self._watcher.start()

    def _drop(self) -> None:
        if self._requests is not None:
            self._requests.put(self._END)
        if self._answers is not None:
            self._answers.cancel()
        self._requests = self._answers = None

    def _watch(self) -> None:
        """Cancel an ask that outlived its deadline (sync gRPC has no timeout per message)."""
        while not self._closed:
            time.sleep(WATCH_PERIOD_SECONDS)
            deadline, answers = self._deadline, self._answers
            if deadline and time.monotonic() > deadline and answers is not None:
                log.warning("a shard ask got no answer in time; asking by a unary call")
                answers.cancel()  # its next() raises CANCELLED: the ask falls back
