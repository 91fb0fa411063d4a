"""Membership-change verdicts: whether a failure or a restart of the local worker group came
with a peer node restarting, joining or being lost, so that it spends none of this node's restarts.

Pure functions of values the agent observed; the agent observes what they ask for and acts on
what they decide.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import Enum

from torch.distributed.elastic.agent.server.api import WorkerState

# The stop reason for a restart of a healthy group: torch restarts one only for waiting nodes.
NEW_NODES_STOP_REASON = "membership change: new nodes are waiting to join"


class FailureStep(Enum):
    """A decision on a worker failure, or the observation still needed to make it."""

    LOCAL_FAULT = "local_fault"  # this node's failure: torch spends a restart on it
    MEMBERSHIP_CHANGE = "membership_change"  # re-rendezvous without spending a restart
    ASK_FIRST = "ask_first"  # observe next: whether this node reported the round's first failure
    POLL = "poll"  # observe next (after a pause when polled before): nodes waiting to join


@dataclass(frozen=True)
class FailureFacts:
    """What the agent has observed of its failed worker group so far."""

    group_world_size: int | None
    exit_codes: tuple[int, ...]
    remaining_restarts: int
    first_to_fail: bool | None = None  # None: the round's failure counter was not asked yet
    nodes_waiting: int | None = None  # None: the rendezvous was not polled yet
    waited_seconds: float = 0.0  # since the failure counter answered


@dataclass(frozen=True)
class FailureVerdict:
    """A step with the reason for it."""

    step: FailureStep
    reason: str


def membership_wait(
    first_to_fail: bool,
    remaining_restarts: int,
    grace_seconds: float,
    lost_node_wait_seconds: float,
) -> float:
    """How long the rendezvous is watched for a node re-joining before a failure counts here."""
    # The first node to report waits less than the others, so exactly one node spends a
    # restart even when a node killed by a signal (which re-joins at once) reported second.
    wait = grace_seconds if first_to_fail else 2 * grace_seconds
    if remaining_restarts <= 0:  # nothing left to spend: wait out the lease for a lost node
        wait += lost_node_wait_seconds
    return wait


def failure_verdict(
    facts: FailureFacts, grace_seconds: float, lost_node_wait_seconds: float
) -> FailureVerdict:
    """Whether a failed local group followed a peer node's restart or loss, or what to observe."""
    if not facts.group_world_size or facts.group_world_size < 2:
        return FailureVerdict(FailureStep.LOCAL_FAULT, "no peer node in the group")
    if facts.first_to_fail is None:  # counted also when the verdict is clear
        return FailureVerdict(FailureStep.ASK_FIRST, "peers may have failed first")
    killed = [c for c in facts.exit_codes if c < 0 and c != -signal.SIGTERM]
    if killed:  # a signal other than the agent's own SIGTERM: a local fault
        return FailureVerdict(
            FailureStep.LOCAL_FAULT, f"a worker was killed by signal {-killed[0]}"
        )
    wait = membership_wait(
        facts.first_to_fail, facts.remaining_restarts, grace_seconds, lost_node_wait_seconds
    )
    if facts.nodes_waiting is None:
        return FailureVerdict(FailureStep.POLL, f"watch the rendezvous for up to {wait:g} s")
    if facts.nodes_waiting > 0:
        reason = f"{facts.nodes_waiting} node(s) waiting to join: a peer restarted or was lost"
        return FailureVerdict(FailureStep.MEMBERSHIP_CHANGE, reason)
    if facts.waited_seconds >= wait:
        return FailureVerdict(FailureStep.LOCAL_FAULT, f"no node waiting to join within {wait:g} s")
    return FailureVerdict(FailureStep.POLL, f"no node waiting to join yet (up to {wait:g} s)")


class RestartKind(Enum):
    """What a restart of the worker group was."""

    NEW_NODES = "new_nodes"  # the group was healthy and nodes waited: torch spent no restart
    NODE_LOST = "node_lost"  # a failure with fewer nodes after it: give back the spent restart
    FAULT = "fault"  # a failure or hang of this node: the restart stays spent


@dataclass(frozen=True)
class RestartVerdict:
    """A restart's kind with a one-line account of it."""

    kind: RestartKind
    reason: str

    @property
    def refund(self) -> bool:
        """Whether the restart torch spent is given back."""
        return self.kind is RestartKind.NODE_LOST


def restart_verdict(
    cause: WorkerState | None, previous_nodes: int | None, now_nodes: int | None
) -> RestartVerdict:
    """Judge a finished restart by the group state that caused it and the node counts around it."""
    shrank = bool(previous_nodes) and now_nodes is not None and now_nodes < previous_nodes
    if cause == WorkerState.FAILED and shrank:
        return RestartVerdict(
            RestartKind.NODE_LOST,
            f"continuing with {now_nodes} of {previous_nodes} nodes; the restart after losing "
            "a node does not count against --max-restarts",
        )
    if cause == WorkerState.HEALTHY:
        return RestartVerdict(
            RestartKind.NEW_NODES,
            f"re-rendezvous for new nodes: now {now_nodes} nodes (was {previous_nodes})",
        )
    return RestartVerdict(RestartKind.FAULT, "a failure or hang of this node's worker group")
