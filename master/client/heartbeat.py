"""HeartbeatThread: a node's periodic heartbeat, carrying its resource stats and global step,
whose replies bring the master's commands. A beat may ride another message instead (the
node's progress report): the thread then calls only when none did, or to fetch commands."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

from master.client.errors import MasterError
from master.client.master import MasterClient
from master.client.resources import ResourceSampler
from master.pb import nodes_pb2

log = logging.getLogger(__name__)

# While beats ride progress reports, a Heartbeat call still goes out this often (commands come
# back only in its reply), or every interval if that is longer.
COMMAND_POLL_SECONDS = 5.0
# A carried beat stands for the thread's own if it went out within this many intervals.
CARRIED_FRESH_INTERVALS = 1.5


class HeartbeatThread(threading.Thread):
    """Sends heartbeats with resource stats and hands received commands to a callback."""

    def __init__(
        self,
        client: MasterClient,
        interval: float,
        on_command: Callable[[nodes_pb2.Command], None] | None = None,
        global_step: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(name="dlrover-heartbeat", daemon=True)
        self._client = client
        self._interval = interval
        self._on_command = on_command
        self._global_step = global_step or (lambda: 0)
        self._stop_event = threading.Event()
        self._sampler = ResourceSampler()
        self._sample_lock = threading.Lock()  # the sampler keeps CPU times between samples
        self._command_poll = max(interval, COMMAND_POLL_SECONDS)
        self._last_carried = float("-inf")
        self._last_call = float("-inf")
        self.pid = os.getpid()  # a forked child has no thread: it starts its own
        self.master_addr = getattr(client, "addr", None)
        self.node = getattr(client, "node", None)

    def sample(self) -> nodes_pb2.ResourceStats:
        """This process's resource stats now (for a beat another message carries)."""
        with self._sample_lock:
            return self._sampler.sample()

    def carried(self) -> None:
        """A beat went out on another message: the next call is skipped unless commands are
        due."""
        self._last_carried = time.monotonic()

    def _due_at(self) -> float:
        """When the next call is due: an interval after the last, unless a carried beat is
        fresh then; that defers it to the carried beat's freshness end or the command poll."""
        regular = self._last_call + self._interval
        fresh_until = self._last_carried + CARRIED_FRESH_INTERVALS * self._interval
        return max(regular, min(fresh_until, self._last_call + self._command_poll))

    def _call_due(self, now: float) -> bool:
        return now >= self._due_at()

    def run(self) -> None:
        while not self._stop_event.is_set():
            now = time.monotonic()
            if self._call_due(now):
                self._last_call = now
                try:
                    commands = self._client.heartbeat(self.sample(), self._global_step())
                    for cmd in commands:
                        if self._on_command:
                            self._on_command(cmd)
                except MasterError as e:
                    log.warning("heartbeat failed: %s", e)
            # Woken at the due time, not an interval later: once carried beats stop (a trainer
            # hung or waiting), the master hears a beat within the freshness span.
            self._stop_event.wait(max(self._due_at() - time.monotonic(), 0.01))

    @property
    def interval(self) -> float:
        """Seconds between this thread's own beats."""
        return self._interval

    def stop(self) -> None:
        self._stop_event.set()


_process_beat: HeartbeatThread | None = None
_process_beat_lock = threading.Lock()


def process_heartbeat(env: Mapping[str, str] | None = None) -> HeartbeatThread | None:
    """This process's heartbeat to its master: registered and started on first use, kept until
    the process ends (a node that lives on after its data ends, e.g. a chief's final
    evaluation, must not look lost). None when the environment names no node of a job."""
    global _process_beat
    with _process_beat_lock:
        client = MasterClient.from_env(env)
        if client.node is None:
            client.close()
            return None
        beat = _process_beat
        if beat is not None and beat.is_alive() and beat.pid == os.getpid():
            if (beat.master_addr, beat.node) == (client.addr, client.node):
                client.close()
                return beat
            beat.stop()  # another job's or incarnation's (tests, a promoted standby)
        reply = client.register(socket.gethostname(), os.getpid())
        beat = HeartbeatThread(client, max(reply.heartbeat_interval_ms, 200) / 1000)
        beat.pid = os.getpid()
        beat.start()
        _process_beat = beat
        return beat
