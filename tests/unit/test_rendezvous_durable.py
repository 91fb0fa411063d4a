"""Rendezvous state through the state store: a new service on the same store serves the same
round, members, ranks and waiting nodes, gives live nodes a fresh lease, and loses the silent."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from master.rendezvous.rounds import Participant, RoundConfig, RoundStateMachine, WaitStatus
from master.rendezvous.service import RESUME_GRACE_SECONDS, TABLE, RendezvousService
from master.state.sqlite import SQLiteStateStore

CONFIG = RoundConfig(min_nodes=2, max_nodes=2, last_call_seconds=0.0, lease_seconds=10.0)


class Clock:
    """Time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def node(rank: int) -> Participant:
    return Participant("worker", rank, 100 + rank, rank, local_world_size=2, host=f"h{rank}")


def round_one(path: str, clock: Clock) -> None:
    """Nodes 0 and 1 form round 1, node 2 waits for round 2; then this master is gone."""
    with SQLiteStateStore(path) as store:
        service = RendezvousService(store, clock=clock)
        for rank in (1, 0):
            service.join("run", CONFIG, node(rank))
        assert service.wait_round("run", ("worker", 0), 100, 1, 0).status == WaitStatus.DONE
        service.join("run", CONFIG, node(2))


def test_a_new_service_serves_the_same_round_ranks_and_waiting_node(tmp_path):
    path, clock = str(tmp_path / "s.sqlite"), Clock()
    round_one(path, clock)
    clock.now += 3600  # the master was away long past every lease
    with SQLiteStateStore(path) as store:
        service = RendezvousService(store, clock=clock)
        assert service.resuming
        service.resume()
        assert not service.resuming
        done = service.wait_round("run", ("worker", 1), 101, 1, 0)
        assert (done.status, done.round, done.rank) == (WaitStatus.DONE, 1, 1)
        assert done.members == (node(0), node(1))  # ranks, ids, hosts, local sizes kept
        # Node 2 still waits for round 2; the members learn that one node is waiting.
        assert service.wait_round("run", ("worker", 2), 102, 2, 0).status == WaitStatus.PENDING
        assert service.watch("run", ("worker", 0), 100, 1, 99, 0) == (0, False)


def test_live_nodes_get_a_fresh_lease_and_a_silent_one_is_lost_after_it(tmp_path):
    path, clock = str(tmp_path / "s.sqlite"), Clock()
    round_one(path, clock)
    with SQLiteStateStore(path) as store:
        service = RendezvousService(store, clock=clock)
        clock.now += 3600
        service.resume()
        lease = CONFIG.lease_seconds + RESUME_GRACE_SECONDS
        clock.now += lease - 1
        # Node 0 and the waiting node 2 call in; node 1 never does (it died meanwhile).
        assert service.watch("run", ("worker", 0), 100, 1, 0, 0) == (0, False)
        service.wait_round("run", ("worker", 2), 102, 2, 0)
        clock.now += 2
        # Node 1's lease ran out: round 1 is broken, so node 0 must re-rendezvous.
        waiting, _ = service.watch("run", ("worker", 0), 100, 1, 0, 0)
        assert waiting >= 1
        assert service.join("run", CONFIG, node(0)) == 2
        assert service.wait_round("run", ("worker", 0), 100, 2, 0).rank == 0
        assert service.current_round("run") == 2
    # The new round and its members were written as they changed.
    with SQLiteStateStore(path) as store:
        saved = json.loads(store.get(TABLE, "run"))
        assert saved["round"] == 2
        assert [m["rank"] for m in saved["members"]] == [0, 2]


def test_a_record_without_membership_restores_the_round_number_only():
    old = {"round": 3, "closed": False, "config": {"min_nodes": 1, "max_nodes": 2}}
    m = RoundStateMachine.restore(old, now=0.0)
    assert (m.number, m.current, m.in_progress) == (3, None, False)
    assert m.join(node(0), 0.0) == 4  # fencing goes on from the saved number


def test_snapshot_round_trips_through_json():
    m = RoundStateMachine(CONFIG)
    for rank in range(3):
        m.join(node(rank), 0.0)
    m.advance(0.0)
    m.leave(("worker", 1), 101)
    again = RoundStateMachine.restore(json.loads(json.dumps(m.snapshot())), now=5.0)
    assert again.snapshot() == m.snapshot()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("jltxc"), st.integers(0, 3)), max_size=30))
def test_every_change_a_restarted_master_needs_bumps_the_version(ops):
    m = RoundStateMachine(RoundConfig(1, 3, last_call_seconds=1.0, lease_seconds=5.0))
    now = 0.0
    for op, rank in ops:
        before, version = m.snapshot(), m.version
        key = ("worker", rank)
        now += 0.7
        if op == "j":
            m.join(node(rank), now)
        elif op == "l":
            m.leave(key, 100 + rank)
        elif op == "t":
            m.touch(key, 100 + rank, now)
        elif op == "x":
            m.lose(key, 100 + rank)
        else:
            m.advance(now)
        if m.snapshot() != before:
            assert m.version != version, (op, rank)
