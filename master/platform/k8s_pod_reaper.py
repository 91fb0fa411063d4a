"""Pod deletions that must happen: tried on a thread of their own until the pod is gone.

A delete the API server refused for a while (429, 5xx, a cut connection) is tried again, past
the retry budget too, with an error logged each time the budget is spent: a pod the master
gave up on could run on next to its rank's next incarnation. A delete refused for good (403)
goes to `on_fatal`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from master.platform.k8s_errors import K8sApiError
from master.platform.k8s_pod_calls import delete_pod
from master.platform.k8s_retry import RETRY_MAX_SECONDS, ApiRetry

log = logging.getLogger(__name__)

REAPER_STOP_SECONDS = 5.0


class PodReaper:
    """A queue of pods to delete, worked through on one thread until each is gone."""

    def __init__(self, retry: ApiRetry, core: Any, on_fatal: Callable[[K8sApiError], None]) -> None:
        self._retry = retry
        self._core = core
        self._on_fatal = on_fatal
        self._wake = threading.Condition()
        self._queue: dict[str, int | None] = {}  # pod name -> grace (None: its own)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="k8s-reaper", daemon=True)
        self._thread.start()

    def delete(self, name: str, grace: int | None) -> None:
        """Delete `name` (again) soon; a shorter grace period wins over a queued one."""
        with self._wake:
            if name in self._queue:
                queued = self._queue[name]
                if queued is not None and (grace is None or queued <= grace):
                    return
            self._queue[name] = grace
            self._wake.notify_all()

    def pending(self) -> list[str]:
        """The pods not deleted yet."""
        with self._wake:
            return sorted(self._queue)

    def close(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        self._thread.join(timeout=REAPER_STOP_SECONDS)

    def _next(self) -> tuple[str, int | None] | None:
        with self._wake:
            while not self._queue and not self._stop.is_set():
                self._wake.wait()
            if self._stop.is_set():
                return None
            name = next(iter(self._queue))
            return name, self._queue[name]

    def _loop(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            name, grace = item
            try:
                delete_pod(self._retry, self._core, name, grace, stop=self._stop)
            except K8sApiError as e:
                if self._stop.is_set():
                    return
                if e.failure.kind.retryable:
                    log.error("pod %s is still not deleted; trying again: %s", name, e)
                    self._stop.wait(RETRY_MAX_SECONDS)
                    continue
                self._on_fatal(e)
            with self._wake:
                if self._queue.get(name, -1) == grace:
                    del self._queue[name]
