"""One label-selected watch of a namespace's pods, on its own thread, that never misses a change.

It lists the pods, then watches from the list's resourceVersion; a stream the server ends (or
that drops) is resumed from the last resourceVersion seen, and one whose resourceVersion has
expired (410 Gone) is relisted. Every pod it sees goes to `on_pod`, every list to `on_list`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from master.platform.k8s_errors import api_error_message

log = logging.getLogger(__name__)

WATCH_TIMEOUT_SECONDS = 240  # the server ends each watch after this; we resume at once
WATCH_CONNECT_TIMEOUT_SECONDS = 10
LIST_TIMEOUT_SECONDS = 60
RETRY_MIN_SECONDS = 0.2
RETRY_MAX_SECONDS = 10.0
WATCH_STOP_SECONDS = 5.0

# on_pod(pod, deleted): a pod as listed, added, modified, or deleted (its last state).
PodCallback = Callable[[dict[str, Any], bool], None]
# on_list(pods, started): the pods of a (re)list, read after monotonic time `started`.
ListCallback = Callable[[list[dict[str, Any]], float], None]


class PodWatch:
    """Lists and watches the pods matching `selector` in `namespace` until stopped."""

    def __init__(
        self,
        api: Any,
        core: Any,
        namespace: str,
        selector: str,
        on_pod: PodCallback,
        on_list: ListCallback,
        timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
    ) -> None:
        self._api = api  # ApiClient: turns listed objects into plain dicts
        self._core = core  # CoreV1Api
        self._ns = namespace
        self._selector = selector
        self._on_pod = on_pod
        self._on_list = on_list
        self.timeout_seconds = timeout_seconds
        self._stopping = threading.Event()
        self._watch: Any = None
        self._resource_version: str | None = None
        self.relists = 0  # how often the pod list was read (first sync + after each 410)
        self.last_error = ""  # why the latest list or watch failed ("" since one worked)
        self._thread = threading.Thread(target=self._loop, name="k8s-watch", daemon=True)

    def start(self) -> None:
        """Start listing and watching on the watch thread."""
        self._thread.start()

    def _loop(self) -> None:
        """List, then watch from the list's resourceVersion; resume or relist on failures."""
        from kubernetes.client.exceptions import ApiException

        delay = RETRY_MIN_SECONDS
        while not self._stopping.is_set():
            try:
                if self._resource_version is None:
                    self._resource_version = self._relist()
                self._watch_once()
                delay = RETRY_MIN_SECONDS
                self.last_error = ""
                continue  # the server ended the stream (timeout or dropped): resume
            except ApiException as e:
                if e.status == 410:
                    log.info(
                        "pod watch: resourceVersion %s expired; relisting", self._resource_version
                    )
                    self._resource_version = None
                    continue
                if self._stopping.is_set():
                    return
                self.last_error = api_error_message("list and watch pods", e, self._ns)
                log.warning("pod watch: %s; retrying in %.1fs", self.last_error, delay)
            except Exception as e:  # a cut connection, a read timeout, a refused connect
                if self._stopping.is_set():
                    return
                self.last_error = f"list and watch pods: {type(e).__name__}: {e}"
                log.warning("pod watch interrupted (%s); resuming in %.1fs", e, delay)
            self._stopping.wait(delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)

    def _relist(self) -> str:
        started = time.monotonic()
        pods = self._core.list_namespaced_pod(
            self._ns,
            label_selector=self._selector,
            _request_timeout=(WATCH_CONNECT_TIMEOUT_SECONDS, LIST_TIMEOUT_SECONDS),
        )
        data = self._api.sanitize_for_serialization(pods)
        self.relists += 1
        self._on_list(data.get("items") or [], started)
        return data["metadata"]["resourceVersion"]

    def _watch_once(self) -> None:
        from kubernetes import watch

        w = watch.Watch()
        self._watch = w
        if self._stopping.is_set():
            return
        stream = w.stream(
            self._core.list_namespaced_pod,
            self._ns,
            label_selector=self._selector,
            resource_version=self._resource_version,
            timeout_seconds=self.timeout_seconds,
            allow_watch_bookmarks=True,
            _request_timeout=(WATCH_CONNECT_TIMEOUT_SECONDS, self.timeout_seconds + 30),
        )
        for event in stream:
            obj = event["raw_object"]
            if event["type"] in ("ADDED", "MODIFIED"):
                self._on_pod(obj, False)
            elif event["type"] == "DELETED":
                self._on_pod(obj, True)
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if rv:
                self._resource_version = rv
            if self._stopping.is_set():
                w.stop()

    def stop(self) -> None:
        """End the watch thread. Watch.stop() only cuts a stream whose response has arrived
        (and a stream starting later resets it), so keep calling it until the thread ends."""
        self._stopping.set()
        deadline = time.monotonic() + WATCH_STOP_SECONDS
        while self._thread.is_alive() and time.monotonic() < deadline:
            w = self._watch
            if w is not None:
                w.stop()
            self._thread.join(timeout=0.05)
        if self._thread.is_alive():
            log.warning("the pod watch did not stop within %.0fs", WATCH_STOP_SECONDS)
