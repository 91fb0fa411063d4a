"""Open progress streams per node, so a node's end can wait for the last reports it sent."""

from __future__ import annotations

import threading
import time
from collections import Counter


class StreamRegistry:
    """Counts open progress streams per node id; wait_closed() blocks until they end."""

    def __init__(self) -> None:
        self._open: Counter[int] = Counter()
        self._cond = threading.Condition()

    def opened(self, node_id: int) -> None:
        with self._cond:
            self._open[node_id] += 1

    def closed(self, node_id: int) -> None:
        with self._cond:
            self._open[node_id] -= 1
            if self._open[node_id] <= 0:
                del self._open[node_id]
            self._cond.notify_all()

    def is_open(self, node_id: int) -> bool:
        with self._cond:
            return self._open[node_id] > 0

    def wait_closed(self, node_id: int, timeout: float) -> bool:
        """True once the node has no open stream; False if it still has one after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._open[node_id] > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._open.pop(node_id, None)
            return True
