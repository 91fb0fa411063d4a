"""HeartbeatThread: a node's periodic heartbeat, carrying its resource stats and global step,
whose replies bring the master's commands."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from master.client.errors import MasterError
from master.client.master import MasterClient
from master.client.resources import ResourceSampler
from master.pb import nodes_pb2

log = logging.getLogger(__name__)


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

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                commands = self._client.heartbeat(self._sampler.sample(), self._global_step())
                for cmd in commands:
                    if self._on_command:
                        self._on_command(cmd)
            except MasterError as e:
                log.warning("heartbeat failed: %s", e)
            self._stop_event.wait(self._interval)

    def stop(self) -> None:
        self._stop_event.set()
