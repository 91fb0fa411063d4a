"""What the platform says about itself, as job events: retried API calls and held-up nodes.

`new_notices` and `trouble_changes` are pure (what is new since the last look); `PlatformNews`
is the part of the job that looks every few seconds and emits `platform` events."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from master.job.events import Emit
from master.nodes.manager import NodeManager
from master.platform.api import Platform

LOOK_EVERY_SECONDS = 1.0


def new_notices(seen: Sequence[str], now: Sequence[str]) -> list[str]:
    """The lines of `now` after the longest tail of `seen` it starts with (the platform keeps
    a bounded list of its latest lines, so old ones fall off the front)."""
    for start in range(len(seen)):
        tail = seen[start:]
        if list(now[: len(tail)]) == list(tail):
            return list(now[len(tail) :])
    return list(now)


def trouble_changes(before: Mapping[int, str], now: Mapping[int, str]) -> list[tuple[int, str]]:
    """(node id, what holds it up) for each trouble that began or changed kind, and (id, '')
    for each that ended. The duration a platform appends in parentheses is not a change."""

    def kind(text: str) -> str:
        return text.split(" (for ", 1)[0]

    changes = [(i, t) for i, t in now.items() if kind(before.get(i, "")) != kind(t)]
    changes += [(i, "") for i in before if i not in now]
    return changes


class PlatformNews:
    """Turns the platform's notices and node troubles into `platform` events."""

    def __init__(self, platform: Platform, nodes: NodeManager, emit: Emit) -> None:
        self._platform = platform
        self._nodes = nodes
        self._emit = emit
        self._next_at = 0.0
        self._notices: list[str] = []
        self._troubles: dict[int, str] = {}

    def tick(self) -> None:
        """Control loop: at most once every LOOK_EVERY_SECONDS."""
        now = time.monotonic()
        if now < self._next_at:
            return
        self._next_at = now + LOOK_EVERY_SECONDS
        notices = self._platform.notices()
        for line in new_notices(self._notices, notices):
            self._emit("platform", line, reason="notice")
        self._notices = notices
        troubles = self._platform.troubles()
        for node_id, text in trouble_changes(self._troubles, troubles):
            node = self._nodes.get(node_id)
            name = node.name if node else f"node id {node_id}"
            message = f"{name}: {text}" if text else f"{name}: no longer held up"
            self._emit("platform", message, node, "held_up" if text else "going")
        self._troubles = troubles
