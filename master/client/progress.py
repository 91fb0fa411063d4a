"""ProgressStream: a node's progress reports on one long-lived stream to the master, one per step
or, with a position file, coalesced to one per second (the first step after a quiet second
goes out at once)."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Iterable, Iterator

import grpc

from master.client.heartbeat import HeartbeatThread
from master.client.master import RETRYABLE_CODES, MasterClient
from master.client.position import PositionFile, stream_position_path
from master.pb import data_pb2

log = logging.getLogger(__name__)

REOPEN_DELAY_SECONDS = 0.2  # before a stream the master ended is reopened
# With a position file: how often the steps taken since the last report go out as one report.
COALESCE_SECONDS = 1.0


class ProgressStream:
    """Per-step progress reports on one long-lived stream, without a round trip per step.

    send() returns at once, but first waits (rarely: a send takes ~0.2 ms, a step much
    longer) until the previous report is written to the connection. A report written to
    the socket reaches the master even if this process is killed right after, and the
    master drains a dead node's stream before re-queueing its shards: so after a crash
    only the batch of the step in flight can be ambiguous. A stream the master ends (it died)
    is reopened at once, not at the next report: a node that takes no step meanwhile (paused,
    or waiting for data) still gives a restarted master the progress the old one had not
    stored yet.

    With `position_file` (the base path the platform names in DLROVER_POSITION_FILE, where it
    reads positions back when the trainer dies; see master.client.position), send() only
    writes the step's position there, and the steps of each `flush_seconds` go out as one
    report from a thread of the stream's own: a tenth of the master's work at 10 steps/s,
    and the same bound of one batch. A step taken after an interval without a report (the
    first after a pause or a recovery) goes out at once: the master learns that training
    resumed without waiting for the next interval.
    """

    _END = object()

    def __init__(
        self,
        client: MasterClient,
        send_timeout: float = 10.0,
        position_file: str = "",
        flush_seconds: float = COALESCE_SECONDS,
    ) -> None:
        self._client = client
        self._send_timeout = send_timeout
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue | None = None
        self._future: grpc.Future | None = None
        self._enqueued = 0
        self._sent = 0
        self._flowing = False  # a message went out on the current stream
        # Latest cumulative progress per dataset and shard, re-sent on a new stream: the
        # master may have restarted and lost the tail of what the old stream carried.
        self._progress: dict[str, dict[int, int]] = {}
        self._global_step = 0
        self._open_lock = threading.RLock()
        self._closing = False
        # Coalescing (with a position file): reports not sent yet, and those being sent.
        self._position = (
            PositionFile(stream_position_path(position_file)) if position_file else None
        )
        if self._position is not None:
            log.info(
                "progress reported every %gs; each step's position kept in %s",
                flush_seconds,
                self._position.path,
            )
        self._flush_seconds = flush_seconds
        self._pending_lock = threading.Lock()
        self._pending: dict[str, dict[int, int]] = {}
        self._inflight: dict[str, dict[int, int]] = {}
        # The batch sent last: on the wire is not yet applied by the master, and a master that
        # hands this trainer's shards back first (a PS loss) reads them from the file.
        self._last_sent: dict[str, dict[int, int]] = {}
        self._pending_steps = 0
        self._pending_loss: float | None = None
        self._flush_lock = threading.Lock()  # one flush at a time
        self._flusher: threading.Thread | None = None
        self._stop_flusher = threading.Event()
        self._heartbeat: HeartbeatThread | None = None
        self._flush_soon = threading.Event()  # wakes the flusher before its interval ends
        self._flushed_at = time.monotonic()  # of the latest flush (a new stream: now)

    def carry_heartbeats(self, heartbeat: HeartbeatThread | None) -> None:
        """Coalesced reports carry the node's heartbeat (its stats), and `heartbeat` skips its
        own call while they do: one message a second to the master instead of two."""
        self._heartbeat = heartbeat

    @property
    def coalescing(self) -> bool:
        """Whether steps are reported once per flush interval (a position file is kept)."""
        return self._position is not None

    def _messages(self, q: queue.SimpleQueue) -> Iterator[data_pb2.ReportProgressRequest]:
        while True:
            item = q.get()
            if item is self._END:
                return
            yield item
            # gRPC asks for the next message only once the previous one was sent.
            with self._cond:
                self._sent += 1
                self._flowing = True
                self._cond.notify_all()

    def _open(self) -> None:
        if self._future is not None:
            try:
                self._future.result(timeout=0)
            except grpc.RpcError as e:
                log.warning("progress stream ended (%s: %s); reopening", e.code().name, e.details())
        self._queue = queue.SimpleQueue()
        with self._cond:
            self._enqueued = self._sent = 0
            self._flowing = False
        # wait_for_ready: a stream opened while the master restarts starts once it is back.
        self._future = self._client._stub.StreamProgress.future(
            self._messages(self._queue), metadata=self._client._metadata, wait_for_ready=True
        )
        self._future.add_done_callback(self._ended)
        for dataset, shards in self._progress.items():
            # Progress is cumulative, so the latest report of a shard stands for every earlier
            # one; shards the master already saw end are skipped by it as stale.
            self._put(
                self._client._progress_request(dataset, sorted(shards.items()), self._global_step)
            )

    def _ended(self, future: grpc.Future) -> None:
        """The stream ended; unless this side closed it, reopen it now (in a thread of its
        own: this runs in gRPC's) to re-send the progress the master may have lost."""
        if self._closing or future.cancelled() or not self._progress:
            return
        error = future.exception()
        if not isinstance(error, grpc.RpcError) or error.code() not in RETRYABLE_CODES:
            return  # not the master going away: the next send() reports what is wrong
        threading.Thread(
            target=self._reopen, args=(future,), name="dlrover-progress-reopen", daemon=True
        ).start()

    def _reopen(self, ended: grpc.Future) -> None:
        time.sleep(REOPEN_DELAY_SECONDS * (0.5 + random.random()))  # a master refusing at once
        with self._open_lock:
            if self._closing or self._future is not ended:
                return  # closed, or send() has reopened it already
            try:
                self._open()
            except Exception as e:  # the next send() tries again
                log.warning("reopening the progress stream: %s", e)

    def _put(self, request: data_pb2.ReportProgressRequest) -> None:
        with self._cond:
            self._enqueued += 1
        self._queue.put(request)

    def send(
        self,
        dataset: str,
        reports: Iterable[tuple[int, int]],
        global_step: int = 0,
        loss: float | None = None,
    ) -> None:
        """Queue one step's report (and its loss, if given) once the previous one is on the wire.

        Coalescing: record the step's position in the position file and return; the report
        goes out with the others of its flush interval."""
        if self._position is not None:
            self._record(dataset, reports, global_step, loss)
            return
        with self._open_lock:
            self._closing = False
            if self._future is None or self._future.done():
                self._open()
        self._wait_sent()
        reports = list(reports)
        self._progress.setdefault(dataset, {}).update(reports)
        self._global_step = max(self._global_step, global_step)
        self._put(self._client._progress_request(dataset, reports, global_step, loss))
        if not self._flowing:
            # A new stream (first use, or the master restarting) may not be connected yet:
            # keep the one-batch bound by waiting for this report itself to go out.
            self._wait_sent()

    def _wait_sent(self) -> bool:
        """Wait until every queued report is on the wire; False if not (stream ended, or
        timed out)."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._sent >= self._enqueued or self._future.done(), self._send_timeout
            ):
                log.warning(
                    "a progress report is not sent after %ss; is the master reachable?",
                    self._send_timeout,
                )
            return self._sent >= self._enqueued

    # -- coalescing -----------------------------------------------------------------------

    def _record(
        self, dataset: str, reports: Iterable[tuple[int, int]], global_step: int, loss: float | None
    ) -> None:
        with self._pending_lock:
            pending = self._pending.setdefault(dataset, {})
            pending.update(reports)
            self._global_step = max(self._global_step, global_step)
            self._pending_steps += 1
            if loss is not None:
                self._pending_loss = loss
            # What the master may not have applied yet: the report sent last, one being sent,
            # and the pending (positions are cumulative, so a newer one replaces an older).
            merged: dict[str, dict[int, int]] = {}
            for batch in (self._last_sent, self._inflight, self._pending):
                for d, shards in batch.items():
                    merged.setdefault(d, {}).update(shards)
            self._position.write(merged)
            if time.monotonic() - self._flushed_at >= self._flush_seconds:
                self._flush_soon.set()  # the first step after a quiet interval
            if self._flusher is None:
                self._stop_flusher.clear()
                self._flusher = threading.Thread(
                    target=self._flush_loop, name="dlrover-progress-flush", daemon=True
                )
                self._flusher.start()

    def _flush_loop(self) -> None:
        while True:
            self._flush_soon.wait(self._flush_seconds)
            if self._stop_flusher.is_set():
                return
            self._flush_soon.clear()
            try:
                self.flush()
            except Exception as e:  # the master is away: the next interval tries again
                log.warning("sending coalesced progress: %s", e)

    def flush(self) -> None:
        """Send the coalesced reports now and wait until they are on the wire (no-op when
        every step is sent at once)."""
        with self._flush_lock:
            with self._pending_lock:
                if not self._pending:
                    return
                self._flushed_at = time.monotonic()
                batch, self._pending = self._pending, {}
                steps, self._pending_steps = self._pending_steps, 0
                loss, self._pending_loss = self._pending_loss, None
                self._inflight = batch
                global_step = self._global_step
            try:
                with self._open_lock:
                    if self._future is None or self._future.done():
                        self._open()
                    for dataset, shards in batch.items():
                        # Re-sent on a new stream from now on (a master restart), as in send().
                        self._progress.setdefault(dataset, {}).update(shards)
            except BaseException:
                with self._pending_lock:  # not sent: the next flush takes it again
                    for dataset, shards in batch.items():
                        newer = self._pending.setdefault(dataset, {})
                        self._pending[dataset] = {**shards, **newer}
                    self._pending_steps += steps
                raise
            heartbeat = self._heartbeat
            for dataset, shards in batch.items():
                request = self._client._progress_request(
                    dataset, sorted(shards.items()), global_step, loss
                )
                request.steps, steps, loss = steps, 0, None
                if heartbeat is not None:
                    request.heartbeat_stats.CopyFrom(heartbeat.sample())
                    heartbeat = None  # one beat per flush
                self._put(request)
            if self._wait_sent() and self._heartbeat is not None:
                self._heartbeat.carried()
            with self._pending_lock:
                self._inflight, self._last_sent = {}, batch

    def close(self, timeout: float = 30.0) -> data_pb2.ReportProgressReply | None:
        """Flush: end the stream and wait until the master has applied every report."""
        if self._flusher is not None:
            self._stop_flusher.set()
            self._flush_soon.set()
            self._flusher.join(timeout)
            self._flusher = None
            self.flush()
        with self._open_lock:
            self._closing = True
        if self._future is None:
            return None
        self._queue.put(self._END)
        try:
            reply = self._future.result(timeout=timeout)
            self._progress.clear()  # applied: nothing to send again on the next stream
            return reply
        except grpc.RpcError as e:
            raise self._client._translate(e) from None
        finally:
            self._future = None
