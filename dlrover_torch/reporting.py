"""Where the agent reports what happened (hangs, restarts, node checks): the log and the master."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Protocol

from master.client import AGENT_EVENTS_KEY

log = logging.getLogger(__name__)

EVENTS_PREFIX = AGENT_EVENTS_KEY.decode()
NODE_CHECK_PREFIX = "dlrover/node_check"


class KVSetter(Protocol):
    """The part of the master's KV client the reporter needs."""

    def set(self, key: bytes, value: bytes) -> Any: ...


class AgentReporter:
    """Logs every agent event and, with a master, stores it in the master's KV under the run."""

    def __init__(self, run_id: str, node_rank: int, kv: KVSetter | None = None) -> None:
        self.run_id = run_id
        self.node_rank = node_rank
        self._kv = kv
        self._seq = 0
        self.events: list[dict[str, Any]] = []

    def _put(self, key: str, payload: dict[str, Any]) -> None:
        if self._kv is None:
            return
        try:
            self._kv.set(key.encode(), json.dumps(payload, sort_keys=True).encode())
        except Exception as e:  # the master being away must not stop training
            log.warning("could not report %s to the master: %s", key, e)

    def event(self, kind: str, reason: str, **fields: Any) -> None:
        """One agent event (e.g. kind="hang", reason="local rank 1 reported no step ...")."""
        self._seq += 1
        payload = {"kind": kind, "reason": reason, "node_rank": self.node_rank, "time": time.time()}
        payload.update(fields)
        self.events.append(payload)
        log.warning("[%s] %s", kind, reason)
        self._put(f"{EVENTS_PREFIX}/{self.run_id}/{self.node_rank}/{self._seq}", payload)

    def node_check(self, round_id: int, payload: dict[str, Any]) -> None:
        """The result of a node check round as this node saw it."""
        log.info("node check: %s", json.dumps(payload, sort_keys=True))
        self._put(f"{NODE_CHECK_PREFIX}/{self.run_id}/{round_id}/{self.node_rank}", payload)
