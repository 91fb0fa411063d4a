"""The agent's membership-change verdicts (dlrover_torch/membership.py), without processes."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from dlrover_torch.membership import (
    FailureFacts,
    FailureStep,
    RestartKind,
    failure_verdict,
    membership_wait,
    restart_verdict,
)

GRACE = 0.5
LOST = 12.0


def verdict(facts: FailureFacts) -> FailureStep:
    return failure_verdict(facts, GRACE, LOST).step


def facts(**kw) -> FailureFacts:
    base = {"group_world_size": 2, "exit_codes": (1,), "remaining_restarts": 3}
    return FailureFacts(**{**base, **kw})


def observe(start: FailureFacts, first: bool, waiting_at: float | None, poll: float = 0.05):
    """Drive the verdict as the agent does, on a fake clock; nodes appear at ``waiting_at``."""
    current, clock, asks, polls = start, 0.0, 0, 0
    while True:
        v = failure_verdict(current, GRACE, LOST)
        if v.step is FailureStep.ASK_FIRST:
            asks += 1
            current = replace(current, first_to_fail=first)
        elif v.step is FailureStep.POLL:
            if current.nodes_waiting is not None:
                clock += poll
            polls += 1
            waiting = 1 if waiting_at is not None and clock >= waiting_at else 0
            current = replace(current, nodes_waiting=waiting, waited_seconds=clock)
        else:
            return v, clock, asks, polls


@pytest.mark.parametrize("world", [None, 0, 1])
def test_a_single_node_failure_is_local_without_asking_the_counter(world):
    assert verdict(facts(group_world_size=world, nodes_waiting=5)) is FailureStep.LOCAL_FAULT


def test_with_peers_the_failure_counter_is_asked_first_even_when_the_verdict_is_clear():
    assert verdict(facts(exit_codes=(-signal.SIGKILL,))) is FailureStep.ASK_FIRST
    assert verdict(facts()) is FailureStep.ASK_FIRST


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV, signal.SIGINT])
def test_a_worker_killed_by_a_signal_is_a_local_fault(sig):
    v = failure_verdict(
        facts(exit_codes=(1, -sig), first_to_fail=False, nodes_waiting=2), GRACE, LOST
    )
    assert v.step is FailureStep.LOCAL_FAULT
    assert str(int(sig)) in v.reason


@pytest.mark.parametrize("codes", [(1,), (-signal.SIGTERM,), (1, -signal.SIGTERM), ()])
def test_exit_codes_and_the_agents_own_sigterm_make_it_watch_the_rendezvous(codes):
    assert verdict(facts(exit_codes=codes, first_to_fail=True)) is FailureStep.POLL


def test_nodes_waiting_make_a_membership_change_even_after_the_wait():
    got = failure_verdict(facts(first_to_fail=True, nodes_waiting=1, waited_seconds=99), GRACE, 0)
    assert got.step is FailureStep.MEMBERSHIP_CHANGE
    assert "1 node(s) waiting" in got.reason


def test_no_node_waiting_polls_until_the_wait_is_over():
    seen = facts(first_to_fail=True, nodes_waiting=0)
    assert verdict(replace(seen, waited_seconds=GRACE - 0.01)) is FailureStep.POLL
    assert verdict(replace(seen, waited_seconds=GRACE)) is FailureStep.LOCAL_FAULT


@pytest.mark.parametrize(
    ("first", "remaining", "wait"),
    [
        (True, 3, GRACE),
        (False, 3, 2 * GRACE),
        (True, 0, GRACE + LOST),
        (False, -1, 2 * GRACE + LOST),
    ],
)
def test_the_wait(first, remaining, wait):
    assert membership_wait(first, remaining, GRACE, LOST) == wait
    seen = facts(first_to_fail=first, remaining_restarts=remaining, nodes_waiting=0)
    assert verdict(replace(seen, waited_seconds=wait - 0.01)) is FailureStep.POLL
    assert verdict(replace(seen, waited_seconds=wait)) is FailureStep.LOCAL_FAULT


def test_the_first_node_to_report_is_charged_and_a_later_one_sees_its_peer_rejoin():
    # The first reporter gives up after one grace; a peer that reported second waits two, and
    # sees the first one's agent re-join in between.
    first, t_first, asks, _ = observe(facts(), first=True, waiting_at=None)
    assert (first.step, asks) == (FailureStep.LOCAL_FAULT, 1)
    assert GRACE <= t_first < GRACE + 0.05 + 1e-9
    second, t_second, _, _ = observe(facts(), first=False, waiting_at=t_first + 0.1)
    assert second.step is FailureStep.MEMBERSHIP_CHANGE
    assert t_second < 2 * GRACE


def test_nodes_already_waiting_decide_at_the_first_poll():
    got, clock, asks, polls = observe(facts(), first=False, waiting_at=0.0)
    assert (got.step, clock, asks, polls) == (FailureStep.MEMBERSHIP_CHANGE, 0.0, 1, 1)


def test_a_restart_after_a_failure_that_lost_a_node_is_given_back():
    got = restart_verdict(WorkerState.FAILED, 3, 2)
    assert (got.kind, got.refund) == (RestartKind.NODE_LOST, True)
    assert got.reason == (
        "continuing with 2 of 3 nodes; the restart after losing a node does not count against "
        "--max-restarts"
    )


def test_a_restart_of_a_healthy_group_is_for_new_nodes():
    got = restart_verdict(WorkerState.HEALTHY, 2, 3)
    assert (got.kind, got.refund) == (RestartKind.NEW_NODES, False)
    assert got.reason == "re-rendezvous for new nodes: now 3 nodes (was 2)"


@pytest.mark.parametrize(
    ("cause", "previous", "now"),
    [
        (WorkerState.FAILED, 2, 2),
        (WorkerState.FAILED, 2, 3),
        (WorkerState.FAILED, None, 1),
        (WorkerState.FAILED, 0, 0),
        (WorkerState.UNHEALTHY, 3, 2),  # a hang here: the restart stays spent
        (None, 3, 2),
    ],
)
def test_other_restarts_are_this_nodes_fault(cause, previous, now):
    got = restart_verdict(cause, previous, now)
    assert (got.kind, got.refund) == (RestartKind.FAULT, False)
