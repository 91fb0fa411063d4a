"""How a node's pod ended, read from the pod's status (exit code, OOM, eviction, lost node).

Pure functions of the pod object as the API returns it; no `kubernetes` import. The node is
the trainer container, found by name (`trainer`): sidecars a webhook injected (service mesh
proxies, log shippers) neither keep a node alive nor give it their exit code.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# A container waiting for one of these will not start without a change to the pod.
FATAL_WAITING_REASONS = frozenset(
    {"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
)
# Pod status reasons for pods that the node, not the program, ended.
NODE_ENDED_REASONS = frozenset({"Evicted", "NodeLost", "Shutdown", "Terminated", "NodeShutdown"})
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class PodEnd:
    """How a pod's node ended, read from its status (exit_code < 0: killed by that signal)."""

    exit_code: int
    oom_killed: bool = False
    message: str = ""
    reason: str = ""  # OOMKilled, Evicted, NodeLost, Deleted, Error, Completed, ...
    force_delete: bool = False  # the pod will never end by itself (or sidecars run): delete it
    node_lost: bool = False  # its node is gone: the pod cannot run any more, deleted or not


def condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    """The pod condition of type `kind` (Ready, PodScheduled, DisruptionTarget, ...)."""
    for c in status.get("conditions") or []:
        if c.get("type") == kind:
            return c
    return None


def trainer_status(pod: Mapping[str, Any], trainer: str) -> Mapping[str, Any] | None:
    """The trainer container's status, by name; a pod of one container: that one."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for cs in statuses:
        if cs.get("name") == trainer:
            return cs
    return statuses[0] if len(statuses) == 1 else None


def _state(cs: Mapping[str, Any] | None, state: str) -> dict[str, Any] | None:
    return ((cs or {}).get("state") or {}).get(state) or None


def node_not_ready(status: Mapping[str, Any]) -> bool:
    """The node controller marked the pod not Ready because its node is not Ready (Unknown or
    False): Ready is not True while ContainersReady is not False (the kubelet, when a container
    is not ready, sets both)."""
    ready = condition(status, "Ready")
    containers = condition(status, "ContainersReady")
    if ready is None or ready.get("status") == "True":
        return False
    return containers is None or containers.get("status") != "False"


def _taint_manager_deletion(pod: Mapping[str, Any]) -> bool:
    disruption = condition(pod.get("status") or {}, "DisruptionTarget")
    return bool(
        (pod.get("metadata") or {}).get("deletionTimestamp")
        and disruption is not None
        and disruption.get("reason") == "DeletionByTaintManager"
    )


def _from_trainer(terminated: Mapping[str, Any], reason: str) -> PodEnd:
    code = int(terminated.get("exitCode", 1))
    why = terminated.get("reason", "")
    message = terminated.get("message", "") or ""
    if why == "OOMKilled":
        message = message or "OOMKilled: the container went over its memory limit"
        return PodEnd(code, oom_killed=True, message=message, reason=why)
    return PodEnd(code, message=message, reason=reason or why)


def pod_end(
    pod: Mapping[str, Any], trainer: str, deleted: bool = False, kill_signal: int = 0
) -> PodEnd | None:
    """The end of a node's pod from its status; None while its trainer is pending or running.

    `deleted`: the pod object is gone (its last state is `pod`). `kill_signal`: the master
    asked for the pod's end with this signal (deleted with or without a grace period).
    """
    status = pod.get("status") or {}
    phase = status.get("phase", "")
    terminated = _state(trainer_status(pod, trainer), "terminated")
    if phase in TERMINAL_PHASES:
        reason = status.get("reason", "")
        if reason in NODE_ENDED_REASONS:
            detail = status.get("message", "")
            return PodEnd(
                -signal.SIGKILL,
                message=f"{reason}: {detail}".rstrip(": "),
                reason=reason,
                node_lost=reason == "NodeLost",
            )
        if terminated is not None:
            return _from_trainer(terminated, "" if terminated.get("reason") else phase)
        if phase == "Succeeded":
            return PodEnd(0, reason=phase)
        detail = f"{reason}: {status.get('message', '')}".strip(": ")
        return PodEnd(-signal.SIGKILL, message=detail or "pod failed", reason=reason or phase)
    if deleted:
        if terminated is not None:
            end = _from_trainer(terminated, "")
            return end if end.oom_killed else dataclasses.replace(end, reason="Deleted")
        if kill_signal:
            return PodEnd(-kill_signal, message="pod deleted by the master", reason="Deleted")
        return PodEnd(
            -signal.SIGKILL,
            message="pod deleted outside the master (kubectl, eviction, or its node was lost)",
            reason="Deleted",
        )
    if terminated is not None:
        # The trainer ended but other containers (sidecars) keep the pod Running: the node has
        # ended; the pod is deleted to stop them.
        end = _from_trainer(terminated, "")
        return PodEnd(
            end.exit_code,
            oom_killed=end.oom_killed,
            message=end.message,
            reason=end.reason or "Error",
            force_delete=True,
        )
    if status.get("reason") == "NodeLost" or (
        _taint_manager_deletion(pod) and node_not_ready(status)
    ):
        # On a healthy node (a NoExecute taint alone) the kubelet stops the pod and reports.
        return PodEnd(
            -signal.SIGKILL,
            message="NodeLost: the pod's node stopped responding",
            reason="NodeLost",
            force_delete=True,
            node_lost=True,
        )
    waiting = _state(trainer_status(pod, trainer), "waiting")
    if waiting and waiting.get("reason") in FATAL_WAITING_REASONS:
        why = waiting["reason"]
        return PodEnd(
            1,
            message=f"{why}: {waiting.get('message', '')}".rstrip(": "),
            reason=why,
            force_delete=True,
        )
    return None
