"""How a node's pod ended, read from the pod's status (exit code, OOM, eviction, lost node).

Pure functions of the pod object as the API returns it; no `kubernetes` import.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# A container waiting for one of these will not start without a change to the pod.
FATAL_WAITING_REASONS = frozenset(
    {"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
)
# Pod status reasons for pods that the node, not the program, ended.
NODE_ENDED_REASONS = frozenset({"Evicted", "NodeLost", "Shutdown", "Terminated", "NodeShutdown"})


@dataclass(frozen=True)
class PodEnd:
    """How a pod's node ended, read from its status (exit_code < 0: killed by that signal)."""

    exit_code: int
    oom_killed: bool = False
    message: str = ""
    reason: str = ""  # OOMKilled, Evicted, NodeLost, Deleted, Error, Completed, ...
    force_delete: bool = False  # the pod will never end by itself: delete it now


def _container_state(status: Mapping[str, Any], state: str) -> dict[str, Any] | None:
    for cs in status.get("containerStatuses") or []:
        value = (cs.get("state") or {}).get(state)
        if value:
            return value
    return None


def _node_lost(status: Mapping[str, Any]) -> bool:
    if status.get("reason") == "NodeLost":
        return True
    return any(
        c.get("type") == "DisruptionTarget" and c.get("reason") == "DeletionByTaintManager"
        for c in status.get("conditions") or []
    )


def pod_end(pod: Mapping[str, Any], deleted: bool = False, kill_signal: int = 0) -> PodEnd | None:
    """The end of a node's pod from its status; None while it is pending or running.

    `deleted`: the pod object is gone (its last state is `pod`). `kill_signal`: the master
    asked for the pod's end with this signal (deleted with or without a grace period).
    """
    status = pod.get("status") or {}
    phase = status.get("phase", "")
    terminated = _container_state(status, "terminated")
    if phase in ("Succeeded", "Failed"):
        reason = status.get("reason", "")
        if reason in NODE_ENDED_REASONS:
            detail = status.get("message", "")
            return PodEnd(
                -signal.SIGKILL, message=f"{reason}: {detail}".rstrip(": "), reason=reason
            )
        if terminated is not None:
            code = int(terminated.get("exitCode", 1))
            why = terminated.get("reason", "")
            message = terminated.get("message", "") or ""
            if why == "OOMKilled":
                message = message or "OOMKilled: the container went over its memory limit"
                return PodEnd(code, oom_killed=True, message=message, reason=why)
            return PodEnd(code, message=message, reason=why or phase)
        if phase == "Succeeded":
            return PodEnd(0, reason=phase)
        detail = f"{reason}: {status.get('message', '')}".strip(": ")
        return PodEnd(-signal.SIGKILL, message=detail or "pod failed", reason=reason or phase)
    if deleted:
        if terminated is not None:
            code = int(terminated.get("exitCode", 1))
            return PodEnd(code, message=terminated.get("message", "") or "", reason="Deleted")
        if kill_signal:
            return PodEnd(-kill_signal, message="pod deleted by the master", reason="Deleted")
        return PodEnd(
            -signal.SIGKILL,
            message="pod deleted outside the master (kubectl, eviction, or its node was lost)",
            reason="Deleted",
        )
    if (pod.get("metadata") or {}).get("deletionTimestamp") and _node_lost(status):
        return PodEnd(
            -signal.SIGKILL,
            message="NodeLost: the pod's node stopped responding",
            reason="NodeLost",
            force_delete=True,
        )
    waiting = _container_state(status, "waiting")
    if waiting and waiting.get("reason") in FATAL_WAITING_REASONS:
        why = waiting["reason"]
        return PodEnd(
            1,
            message=f"{why}: {waiting.get('message', '')}".rstrip(": "),
            reason=why,
            force_delete=True,
        )
    return None
