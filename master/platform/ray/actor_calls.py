"""Calls to many node actors at once: answered within a deadline, or polled."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


# A node actor asked for a free port on its Ray node answers within this, or another is asked.
PORT_TIMEOUT_SECONDS = 2.0


def free_port_from_actors(ray: Any, actors: list[Any], ip: str) -> int | None:
    """A port free on the Ray node of `actors` (node actors running there), from the first
    that answers; None when none does (a task must then be scheduled there)."""
    for actor in actors:
        try:
            return int(ray.get(actor.free_port.remote(ip), timeout=PORT_TIMEOUT_SECONDS))
        except Exception as e:  # ended, unreachable, or of an older master without the method
            log.info("no free port from a node actor on %s: %s", ip, e)
    return None


def gather(ray: Any, refs: dict[int, Any], timeout: float) -> dict[int, Any]:
    """The answer to each call by node id; calls that failed or did not answer in `timeout`
    seconds (a dead actor, one on a lost Ray node) are left out."""
    if not refs:
        return {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    done = set(ready)
    answers = {}
    for node_id, ref in refs.items():
        if ref not in done:
            continue
        try:
            answers[node_id] = ray.get(ref, timeout=0)
        except Exception as e:  # a dead actor, or one of an older master without the method
            log.info("node id=%d did not answer: %s", node_id, e)
    return answers


class CpuSecondsPoll:
    """CPU seconds of running nodes, asked of their actors without ever blocking: each poll
    collects the answers to the previous poll's requests and asks again, so the figures are
    one poll old."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray
        self._pending: dict[int, Any] = {}  # node id -> the ref of its unanswered request
        self._used: dict[int, float] = {}

    def poll(self, actors: dict[int, Any]) -> dict[int, float]:
        """The latest figure of each node of `actors` (node id -> its actor) that has one."""
        pending = self._pending
        if pending:
            ready, _ = self._ray.wait(list(pending.values()), num_returns=len(pending), timeout=0)
            answered = set(ready)
            for node_id, ref in list(pending.items()):
                if ref not in answered:
                    continue
                del pending[node_id]
                try:
                    seconds = self._ray.get(ref, timeout=0)
                except Exception:  # a dead actor, or one of an older master without the method
                    seconds = None
                if seconds is not None:
                    self._used[node_id] = float(seconds)
        for node_id in set(self._used) - set(actors):
            del self._used[node_id]
        for node_id, actor in actors.items():
            if node_id not in pending:
                pending[node_id] = actor.cpu_seconds.remote()
        return {i: self._used[i] for i in actors if i in self._used}
