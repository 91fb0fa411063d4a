"""Calls to many node actors at once, answered within a deadline."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


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
