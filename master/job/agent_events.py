"""What torch node agents report through the KV store (hangs, restarts, replaced launcher
flags), as job events: `agent_event` reads one key and value (pure)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from master.client import AGENT_EVENTS_KEY

_RESERVED = frozenset({"time", "message", "node", "node_type"})


@dataclass(frozen=True)
class AgentEvent:
    """One agent event: its kind, its text, the node rank that sent it and the rest."""

    kind: str
    reason: str
    node_rank: int
    details: dict[str, Any]


def agent_event(key: bytes, value: bytes) -> AgentEvent | None:
    """The agent event stored under `key`, or None when the key is not one (or unreadable)."""
    if not key.startswith(AGENT_EVENTS_KEY + b"/"):
        return None
    try:
        doc = json.loads(value)
        kind, reason, rank = str(doc.pop("kind")), str(doc.pop("reason")), int(doc.pop("node_rank"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    # Names the event record itself uses are not details.
    details = {k: v for k, v in doc.items() if k not in _RESERVED}
    return AgentEvent(kind, reason, rank, details)
