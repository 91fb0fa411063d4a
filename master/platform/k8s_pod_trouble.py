"""Pod states that are no end (yet): unschedulable, an image that will not pull, a node not Ready.

`pod_trouble` reads one from a pod (pure). `PodTroubles` follows each pod's trouble: it says when
one starts, changes and is over, and ends it through `on_expired` when it lasts past its limit
(an image pull failing for `image_pull_timeout_seconds`, a node not Ready for
`node_lost_grace_seconds`); an unschedulable pod has no limit, only its scheduler's message.
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from master.platform.k8s_pod_end import TERMINAL_PHASES, PodEnd, condition, node_not_ready
from master.platform.k8s_settings import (
    ENV_IMAGE_PULL_TIMEOUT_SECONDS,
    ENV_NODE_LOST_GRACE_SECONDS,
)

IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff"})


class TroubleKind(str, enum.Enum):
    """What holds a pod up. Each starts when first seen and is over when no longer seen:
    UNSCHEDULABLE (no limit) | IMAGE_PULL -> node failed after its limit | NODE_NOT_READY ->
    node lost after its limit."""

    UNSCHEDULABLE = "unschedulable"
    IMAGE_PULL = "image_pull"
    NODE_NOT_READY = "node_not_ready"


@dataclass(frozen=True)
class PodTrouble:
    """One trouble as the pod shows it: its kind, the reason Kubernetes gives and its message."""

    kind: TroubleKind
    reason: str
    message: str

    def line(self) -> str:
        return f"{self.reason}: {self.message}".rstrip(": ")


def pod_trouble(pod: Mapping[str, Any]) -> PodTrouble | None:
    """The trouble a pending or running pod is in, or None."""
    status = pod.get("status") or {}
    if status.get("phase") in TERMINAL_PHASES:
        return None
    scheduled = condition(status, "PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        if scheduled.get("reason") == "Unschedulable":
            message = scheduled.get("message") or "no node fits the pod"
            return PodTrouble(TroubleKind.UNSCHEDULABLE, "Unschedulable", message)
    # Any container, sidecars and init containers too: one that cannot pull holds the pod.
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL_REASONS:
            image = cs.get("image") or "?"
            message = waiting.get("message") or f"cannot pull image {image!r}"
            text = f"container {cs.get('name')!r}: {message}"
            return PodTrouble(TroubleKind.IMAGE_PULL, waiting["reason"], text)
    if status.get("phase") == "Running" and node_not_ready(status):
        node = (pod.get("spec") or {}).get("nodeName") or "?"
        ready = condition(status, "Ready") or {}
        text = f"node {node} is not Ready (the pod's Ready condition is {ready.get('status')})"
        return PodTrouble(TroubleKind.NODE_NOT_READY, "NodeNotReady", text)
    return None


def trouble_end(trouble: PodTrouble, seconds: float) -> PodEnd:
    """The node's end when `trouble` lasted `seconds`, past its limit: an image that never
    pulled fails the node; a node never Ready again is lost (its pod can no longer run)."""
    if trouble.kind == TroubleKind.IMAGE_PULL:
        return PodEnd(
            1,
            message=f"{trouble.line()} (for {seconds:.0f}s, the limit set by "
            f"{ENV_IMAGE_PULL_TIMEOUT_SECONDS})",
            reason=trouble.reason,
            force_delete=True,
        )
    return PodEnd(
        -signal.SIGKILL,
        message=f"NodeLost: {trouble.message} for {seconds:.0f}s (the grace set by "
        f"{ENV_NODE_LOST_GRACE_SECONDS})",
        reason="NodeLost",
        force_delete=True,
        node_lost=True,
    )


# on_expired(pod name, trouble, seconds it lasted)
ExpiredCallback = Callable[[str, PodTrouble, float], None]
# note(logging level, line): how a start, change or end of a trouble is told
NoteCallback = Callable[[int, str], None]


@dataclass(eq=False)
class _Open:
    trouble: PodTrouble
    since: float  # monotonic
    timer: threading.Timer | None = None


class PodTroubles:
    """The open trouble of each pod, with a timer where its kind has a limit."""

    def __init__(
        self,
        limits_seconds: Mapping[TroubleKind, float],
        on_expired: ExpiredCallback,
        note: NoteCallback,
    ) -> None:
        self._limits = dict(limits_seconds)
        self._on_expired = on_expired
        self._note = note
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._closed = False

    def observe(self, pod: str, trouble: PodTrouble | None) -> None:
        """The pod's trouble as its latest state shows it (None: none)."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            old = self._open.get(pod)
            if trouble is None:
                if old is not None:
                    self._drop(pod)
                    self._note(
                        logging.INFO,
                        f"pod {pod}: {old.trouble.kind.value} over after {now - old.since:.0f}s",
                    )
                return
            if old is not None and old.trouble.kind == trouble.kind:
                if old.trouble != trouble:  # e.g. ErrImagePull -> ImagePullBackOff
                    old.trouble = trouble
                    self._note(logging.WARNING, f"pod {pod}: {trouble.line()}")
                return
            if old is not None:
                self._drop(pod)
            entry = _Open(trouble, now)
            limit = self._limits.get(trouble.kind)
            then = ""
            if limit:
                entry.timer = threading.Timer(limit, self._expire, args=(pod, entry))
                entry.timer.daemon = True
                entry.timer.start()
                then = f"; the node ends if this lasts {limit:g}s"
            self._open[pod] = entry
            self._note(logging.WARNING, f"pod {pod}: {trouble.line()}{then}")

    def forget(self, pod: str) -> None:
        """The pod's node ended: its trouble, if any, no longer matters."""
        with self._lock:
            self._drop(pod)

    def current(self) -> dict[str, tuple[PodTrouble, float]]:
        """Each troubled pod's trouble and how long it has lasted (seconds)."""
        now = time.monotonic()
        with self._lock:
            return {pod: (e.trouble, now - e.since) for pod, e in self._open.items()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for pod in list(self._open):
                self._drop(pod)

    def _drop(self, pod: str) -> None:
        entry = self._open.pop(pod, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()

    def _expire(self, pod: str, entry: _Open) -> None:
        with self._lock:
            if self._open.get(pod) is not entry:
                return  # over, changed or forgotten meanwhile
            del self._open[pod]
        self._on_expired(pod, entry.trouble, time.monotonic() - entry.since)
