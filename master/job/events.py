"""Structured job events: every decision and incident, kept in memory and in events.jsonl."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from master.nodes.model import Node

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
# Events a live display need not print: routine state changes (still in the file and API).
ROUTINE_KINDS = frozenset({"node_running", "node_exited", "checkpoint"})
# Events a live display marks as incidents.
INCIDENT_KINDS = frozenset(
    {"fault", "node_failed", "heartbeat_lost", "hang", "straggler", "diagnosis", "stuck"}
)


class Emit(Protocol):
    """The port every part of the job records its events through (JobMaster.emit)."""

    def __call__(
        self, kind: str, message: str, node: Node | None = None, reason: str = "", **details: Any
    ) -> JobEvent: ...


@dataclass
class JobEvent:
    """One decision or incident: what happened, to which node, why, and its details."""

    time: float
    kind: str
    message: str
    node_type: str = ""
    node_rank: int = -1
    node_id: int = 0
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def node(self) -> str:
        """The node's name (TYPE-RANK), or '' for job-wide events."""
        return f"{self.node_type}-{self.node_rank}" if self.node_type else ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to events.jsonl and served by the dashboard."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobEvent:
        """Read back one events.jsonl line (unknown keys are ignored)."""
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


class EventLog:
    """Keeps a job's events in order, appends each to a JSON-lines file, notifies listeners."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self.events: list[JobEvent] = []
        self._listeners: list[Callable[[JobEvent], None]] = []
        self._lock = threading.Lock()

    def add_listener(self, listener: Callable[[JobEvent], None]) -> None:
        """Call `listener(event)` for every event appended from now on."""
        self._listeners.append(listener)

    def append(self, event: JobEvent) -> None:
        """Record an event; a file that cannot be written is logged, never fatal."""
        with self._lock:
            self.events.append(event)
            if self.path:
                try:
                    with open(self.path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(event.to_dict(), default=str) + "\n")
                except OSError as e:
                    log.warning("cannot append to %s: %s", self.path, e)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a broken display must not stop the control loop
                log.exception("event listener failed on %s", event.kind)

    def preload(self, events: list[JobEvent]) -> None:
        """Put earlier events (a previous master's, read back from the file) first, unwritten."""
        with self._lock:
            self.events[:0] = events

    def since(self, index: int) -> list[JobEvent]:
        """Events from position `index` on (0: all), for incremental readers."""
        with self._lock:
            return self.events[max(0, index) :]

    def __len__(self) -> int:
        with self._lock:
            return len(self.events)


def read_events(run_dir: str) -> list[JobEvent]:
    """The events a run wrote to <run_dir>/events.jsonl (empty if there is none)."""
    path = os.path.join(run_dir, EVENTS_FILE)
    events = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    events.append(JobEvent.from_dict(json.loads(line)))
    except FileNotFoundError:
        return []
    return events
