"""Where the seconds of a PS recovery go: one timeline per PS failure, migration or job start.

A timeline opens at its cause (the PS's end, the migrate call, the master's start) and each
phase is stamped once, in wall time, as the master learns of it: the PS's end detected, the
replacement PS started (a new process, or a standby promoted), the PS serving (its own report),
the chief's new session made and the model restored (its restore report), workers told (the
chief announced its session; waiting workers wake on it), the first step after the restore.
`RecoveryTracker` is the part of the job that stamps them and emits the `recovery` event when
training has resumed.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from master.client import CHIEF_SESSION_KEY, PS_SERVING_KEY
from master.job.events import Emit

log = logging.getLogger(__name__)


class RecoveryPhase(str, enum.Enum):
    """The phases of one recovery, in the order they happen; each is stamped at most once.

    A PS failure goes detected -> ps_started -> ps_serving -> chief_restored -> workers_told ->
    first_step; a migration or a PS count change starts with paused -> checkpointed; a job
    start may stamp only some of them. A timeline ends at first_step (or expires)."""

    PAUSED = "paused"  # migration: workers stopped at a step boundary
    CHECKPOINTED = "checkpointed"  # migration: the chief's checkpoint made on request
    DETECTED = "detected"  # the old PS's end seen by the master
    PS_STARTED = "ps_started"  # a replacement PS process launched, or a standby promoted
    PS_SERVING = "ps_serving"  # the PS's gRPC server is up (reported by the PS)
    CHIEF_RESTORED = "chief_restored"  # the chief's new session: model restored
    WORKERS_TOLD = "workers_told"  # the chief announced that session; waiting workers go on
    FIRST_STEP = "first_step"  # a step trained after the restore


class RecoveryKind(str, enum.Enum):
    """What a timeline is about: what opened it."""

    PS_FAILURE = "ps_failure"
    PS_MIGRATION = "ps_migration"
    PS_RESIZE = "ps_resize"
    JOB_START = "job_start"


PHASES = tuple(p.value for p in RecoveryPhase)
PHASE_LABELS = {
    "paused": "workers paused",
    "checkpointed": "checkpoint made",
    "detected": "failure detected",
    "ps_started": "PS process started",
    "ps_serving": "PS serving",
    "chief_restored": "sessions rebuilt, checkpoint restored",
    "workers_told": "workers told",
    "first_step": "first step",
}
PS_FAILURE = RecoveryKind.PS_FAILURE
PS_MIGRATION = RecoveryKind.PS_MIGRATION
PS_RESIZE = RecoveryKind.PS_RESIZE
JOB_START = RecoveryKind.JOB_START
# A timeline nobody finished (the job ended, a PS died again) is dropped after this.
TIMELINE_EXPIRY_SECONDS = 600.0


@dataclass
class RecoveryTimeline:
    """The wall-clock times of one recovery's phases, from its cause (`started`)."""

    kind: RecoveryKind | str
    node: str  # the PS it is about, TYPE-RANK ("" for a job start)
    started: float
    phases: dict[str, float] = field(default_factory=dict)
    restored_step: int | None = None
    standby: bool = False  # the replacement was a standby promoted
    # A job start whose trainers step with no restore report (no TF chief: a custom loop on
    # the built-in PS): training runs, though the timeline waits for a restore to finish.
    stepped: bool = False

    def mark(self, phase: str | RecoveryPhase, at: float | None = None) -> bool:
        """Stamp `phase` (the first stamp wins); whether this one counted."""
        name = str(phase.value if isinstance(phase, RecoveryPhase) else phase)
        if name not in PHASES or name in self.phases:
            return False
        self.phases[name] = time.time() if at is None else at
        return True

    @property
    def resumed(self) -> bool:
        """Training has moved on after the restore."""
        return "first_step" in self.phases

    def expired(self, now: float) -> bool:
        return now - self.started > TIMELINE_EXPIRY_SECONDS

    def offsets(self) -> dict[str, float]:
        """Each stamped phase in seconds from the cause, in phase order."""
        return {p: round(self.phases[p] - self.started, 3) for p in PHASES if p in self.phases}

    def total(self) -> float:
        """Seconds from the cause to the first step (or to the latest phase so far)."""
        return round(max(self.phases.values(), default=self.started) - self.started, 3)

    def summary(self) -> dict[str, Any]:
        """The JSON form kept in the `recovery` event's details."""
        return {
            "recovery": str(RecoveryKind(self.kind).value),
            "ps": self.node,
            "started": self.started,
            "seconds": self.total(),
            "phases": self.offsets(),
            "restored_step": self.restored_step,
            "standby": self.standby,
        }


def format_timeline(summary: dict[str, Any]) -> str:
    """One line: '<kind> ps-0: resumed in 1.23 s (failure detected +0.01 s, ...)'."""
    parts = ", ".join(f"{PHASE_LABELS.get(p, p)} +{s:.2f} s" for p, s in summary["phases"].items())
    what = summary["recovery"].replace("_", " ") + (f" {summary['ps']}" if summary["ps"] else "")
    via = " (standby promoted)" if summary.get("standby") else ""
    return f"{what}{via}: resumed in {summary['seconds']:.2f} s ({parts})"


def serving_report(value: bytes) -> tuple[int, float] | None:
    """(node id, unix time) from a PS's serving report; None if it is not one."""
    try:
        doc = json.loads(value)
        return int(doc["node_id"]), float(doc["at"])
    except (ValueError, KeyError, TypeError):
        return None


class RecoveryTracker:
    """Keeps the open recovery timeline (at most one) and emits it when training resumed.
    Thread-safe: phases are stamped from the control loop and from RPC threads."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self._timeline: RecoveryTimeline | None = None
        self._lock = threading.Lock()
        self._chief_session = 0

    def open(self, kind: RecoveryKind, node: str, started: float | None = None) -> None:
        """A new recovery begins (any open one is dropped: this one supersedes it)."""
        with self._lock:
            self._timeline = RecoveryTimeline(
                kind, node, time.time() if started is None else started
            )

    def recovering(self) -> bool:
        """A recovery (or the job's start) has not reached its first step yet."""
        with self._lock:
            t = self._timeline
            return t is not None and not t.stepped and not t.expired(time.time())

    def mark(self, phase: RecoveryPhase, at: float | None = None, **facts: Any) -> None:
        """Stamp a phase of the open timeline, if any (`restored_step`, `standby`: facts)."""
        with self._lock:
            t = self._timeline
            if t is None:
                return
            if t.expired(time.time()):
                self._timeline = None
                return
            t.mark(phase, at)
            if "restored_step" in facts and t.restored_step is None:
                t.restored_step = facts["restored_step"]
            if facts.get("standby"):
                t.standby = True

    def on_kv(self, key: bytes, value: bytes) -> None:
        """KV listener: a PS serving report, or the chief announcing a new session."""
        if key.startswith(PS_SERVING_KEY + b"/"):
            report = serving_report(value)
            if report is not None:
                self.mark(RecoveryPhase.PS_SERVING, report[1])
        elif key == CHIEF_SESSION_KEY:
            # Workers read the counter with add(0) too: only a new session counts.
            session = int(value)
            with self._lock:
                newer, self._chief_session = (
                    session > self._chief_session,
                    max(session, self._chief_session),
                )
            if newer:
                self.mark(RecoveryPhase.WORKERS_TOLD)

    def on_restore(self, step: int) -> None:
        """The chief reported its new session, with the model loaded at `step`."""
        self.mark(RecoveryPhase.CHIEF_RESTORED, restored_step=step)

    def on_step(self, step: int) -> None:
        """A step was reported: the first one after the restore (and, for a PS failure, after
        the replacement PS started) ends the open timeline."""
        with self._lock:
            t = self._timeline
            if t is not None and t.kind == JOB_START and step > 0:
                t.stepped = True
            if t is None or t.restored_step is None or step <= t.restored_step:
                return
            if t.kind == PS_FAILURE and "ps_started" not in t.phases:
                return  # a step before the replacement PS exists resumed nothing
            t.mark(RecoveryPhase.FIRST_STEP)
            self._timeline = None
        summary = t.summary()
        self._emit("recovery", format_timeline(summary), reason=summary["recovery"], **summary)
