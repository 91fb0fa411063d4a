"""The rendezvous round state machine: closing rules, node_unit, last call, loss, fencing."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from master.rendezvous.rounds import (
    Participant,
    RendezvousClosedError,
    RoundConfig,
    RoundStateMachine,
    StaleRoundError,
    WaitStatus,
)
from master.rendezvous.service import RendezvousService
from master.state.sqlite import SQLiteStateStore


def node(rank: int, hint: int | None = None, node_id: int | None = None) -> Participant:
    return Participant(
        "worker", rank, 100 + rank if node_id is None else node_id, rank if hint is None else hint
    )


def machine(min_nodes=2, max_nodes=4, unit=1, last_call=1.0, lease=10.0) -> RoundStateMachine:
    return RoundStateMachine(RoundConfig(min_nodes, max_nodes, unit, last_call, lease))


def join_all(m: RoundStateMachine, nodes, now: float = 0.0) -> int:
    numbers = {m.join(p, now) for p in nodes}
    assert len(numbers) == 1
    return numbers.pop()


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_nodes": 0, "max_nodes": 2}, "min_nodes"),
        ({"min_nodes": 3, "max_nodes": 2}, "max_nodes"),
        ({"min_nodes": 1, "max_nodes": 2, "node_unit": 0}, "node_unit"),
        ({"min_nodes": 3, "max_nodes": 3, "node_unit": 2}, "node_unit"),
        ({"min_nodes": 1, "max_nodes": 2, "last_call_seconds": -1}, "last_call_seconds"),
        ({"min_nodes": 1, "max_nodes": 2, "lease_seconds": 0}, "lease_seconds"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RoundConfig(**kwargs)


@given(
    min_nodes=st.integers(1, 20),
    extra=st.integers(0, 20),
    unit=st.integers(1, 8),
    available=st.integers(0, 64),
)
def test_round_size_is_the_largest_admissible_multiple(min_nodes, extra, unit, available):
    max_nodes = min_nodes + extra
    if (max_nodes // unit) * unit < min_nodes:
        return  # refused by the config (tested above)
    config = RoundConfig(min_nodes, max_nodes, unit)
    size = config.round_size(available)
    admissible = [
        n for n in range(0, available + 1) if n % unit == 0 and min_nodes <= n <= max_nodes
    ]
    assert size == (max(admissible) if admissible else 0)


# -- closing --------------------------------------------------------------------------------------


def test_round_closes_at_once_when_max_nodes_joined():
    m = machine(min_nodes=2, max_nodes=3, last_call=100.0)
    number = join_all(m, [node(0), node(1)], now=0.0)
    assert m.advance(0.0) is None  # min reached, last call still open
    m.join(node(2), 0.0)
    closed = m.advance(0.0)
    assert closed is not None and closed.number == number == 1
    assert [p.rank for p in closed.members] == [0, 1, 2]


def test_last_call_closes_after_quiet_window_and_a_newcomer_restarts_it():
    m = machine(min_nodes=2, max_nodes=8, last_call=1.0)
    join_all(m, [node(0), node(1)], now=0.0)
    assert m.advance(0.9) is None
    m.join(node(2), 0.9)  # a newcomer extends the last call
    assert m.advance(1.5) is None
    assert m.next_deadline() == pytest.approx(1.9)
    closed = m.advance(1.9)
    assert closed is not None and len(closed.members) == 3


def test_no_round_below_min_nodes_however_long_it_waits():
    m = machine(min_nodes=3, max_nodes=4)
    join_all(m, [node(0), node(1)])
    assert m.advance(5.0) is None
    assert m.wait_status(("worker", 0), 100, 1).status == WaitStatus.PENDING


def test_node_unit_rounds_down_and_the_rest_waits_for_the_next_round():
    m = machine(min_nodes=2, max_nodes=8, unit=2)
    join_all(m, [node(r) for r in range(5)])
    closed = m.advance(2.0)
    assert closed is not None and len(closed.members) == 4
    # The first four arrivals are admitted; the fifth waits and learns the next round number.
    assert m.wait_status(("worker", 4), 104, 1).status == WaitStatus.NEXT
    assert m.wait_status(("worker", 4), 104, 1).round == 2
    # One waiting node cannot make a bigger multiple of 2: members carry on.
    assert m.waiting(("worker", 0), 100, 1) == 0
    m.join(node(5), 2.0)
    assert m.waiting(("worker", 0), 100, 1) == 2


def test_ranks_follow_rank_hint_not_arrival_order():
    m = machine(min_nodes=3, max_nodes=3)
    for p in [node(0, hint=2), node(1, hint=0), node(2, hint=1)]:
        m.join(p, 0.0)
    closed = m.advance(0.0)
    assert [p.rank for p in closed.members] == [1, 2, 0]
    assert m.wait_status(("worker", 0), 100, 1).rank == 2


@settings(max_examples=50)
@given(st.permutations(range(5)), st.lists(st.integers(0, 3), min_size=5, max_size=5))
def test_ranks_do_not_depend_on_join_order(order, hints):
    ranks = []
    for perm in (list(range(5)), order):
        m = machine(min_nodes=5, max_nodes=5)
        for r in perm:
            m.join(node(r, hint=hints[r]), 0.0)
        closed = m.advance(0.0)
        ranks.append([p.rank for p in closed.members])
    assert ranks[0] == ranks[1]


# -- membership changes ---------------------------------------------------------------------------


def test_a_newcomer_waits_and_members_learn_they_must_re_rendezvous():
    m = machine(min_nodes=2, max_nodes=4)
    join_all(m, [node(0), node(1)])
    assert m.advance(1.0) is not None
    assert m.waiting(("worker", 0), 100, 1) == 0
    m.join(node(2), 2.0)
    # The newcomer does not form a round of its own while the members run ...
    assert m.advance(10.0) is None
    assert m.waiting(("worker", 0), 100, 1) == 1
    assert m.waiting(("worker", 1), 101, 1) == 1
    # ... until the members re-join: then all three form round 2.
    join_all(m, [node(0), node(1)], now=10.0)
    closed = m.advance(11.0)
    assert closed.number == 2 and len(closed.members) == 3


def test_a_newcomer_that_cannot_be_admitted_does_not_disturb_the_members():
    m = machine(min_nodes=1, max_nodes=2)
    join_all(m, [node(0), node(1)])
    assert m.advance(0.0) is not None
    m.join(node(2), 1.0)
    assert m.waiting(("worker", 0), 100, 1) == 0  # the round is already at max_nodes


def test_a_member_re_joining_makes_the_others_re_rendezvous():
    m = machine(min_nodes=1, max_nodes=3)
    join_all(m, [node(0), node(1), node(2)])
    assert m.advance(0.0) is not None
    m.join(node(1), 5.0)  # its workers failed: it re-joins
    assert m.waiting(("worker", 0), 100, 1) == 1


def test_a_lost_member_breaks_the_round_and_the_rest_continue_smaller():
    m = machine(min_nodes=2, max_nodes=3, last_call=1.0, lease=5.0)
    join_all(m, [node(0), node(1), node(2)])
    assert m.advance(0.0).number == 1
    for t in (3.0, 6.0):  # nodes 0 and 1 stay in touch, node 2 goes silent
        m.touch(("worker", 0), 100, t)
        m.touch(("worker", 1), 101, t)
        m.advance(t)
    assert m.waiting(("worker", 0), 100, 1) >= 1
    join_all(m, [node(0), node(1)], now=6.0)
    closed = m.advance(7.0)
    assert closed.number == 2 and [p.rank for p in closed.members] == [0, 1]
    with pytest.raises(StaleRoundError):
        m.wait_status(("worker", 2), 102, 1)  # the lost node is out of every round


def test_a_member_the_master_saw_die_is_lost_at_once_not_at_its_lease():
    m = machine(min_nodes=2, max_nodes=3, last_call=1.0, lease=60.0)
    join_all(m, [node(0), node(1), node(2)])
    assert m.advance(0.0).number == 1
    m.lose(("worker", 2), 999)  # another incarnation's death: ignored
    assert m.waiting(("worker", 0), 100, 1) == 0
    m.lose(("worker", 2), 102)
    assert m.waiting(("worker", 0), 100, 1) >= 1  # long before the 60 s lease ran out
    join_all(m, [node(0), node(1)], now=0.5)
    closed = m.advance(2.0)
    assert closed.number == 2 and [p.rank for p in closed.members] == [0, 1]


def test_when_fewer_than_min_remain_no_round_forms():
    m = machine(min_nodes=2, max_nodes=2, lease=5.0)
    join_all(m, [node(0), node(1)])
    m.advance(0.0)
    m.touch(("worker", 0), 100, 4.0)
    m.advance(6.0)  # node 1 lost
    m.join(node(0), 6.0)
    assert m.advance(100.0) is None


def test_a_lost_joiner_is_not_counted():
    m = machine(min_nodes=2, max_nodes=4, lease=5.0)
    join_all(m, [node(0), node(1)], now=0.0)
    m.touch(("worker", 0), 100, 5.5)
    assert m.advance(5.5) is None  # joined node 1 went silent: only one left
    assert m.joining_count == 1


def test_a_graceful_leave_is_not_a_loss():
    m = machine(min_nodes=1, max_nodes=2, lease=5.0)
    join_all(m, [node(0), node(1)])
    m.advance(0.0)
    m.leave(("worker", 1), 101)
    m.touch(("worker", 0), 100, 9.0)
    m.advance(9.0)
    assert m.waiting(("worker", 0), 100, 1) == 0


# -- fencing --------------------------------------------------------------------------------------


def test_stale_round_is_refused():
    m = machine(min_nodes=2, max_nodes=2)
    join_all(m, [node(0), node(1)])
    m.advance(0.0)
    join_all(m, [node(0), node(1)], now=1.0)
    m.advance(1.0)
    assert m.number == 2
    with pytest.raises(StaleRoundError, match="round 1 is over"):
        m.waiting(("worker", 0), 100, 1)
    m.join(node(0), 2.0)
    with pytest.raises(StaleRoundError):
        m.wait_status(("worker", 0), 100, 2)  # it left round 2 by joining round 3
    with pytest.raises(StaleRoundError):
        m.wait_status(("worker", 0), 100, 7)  # a round nobody announced


def test_an_old_incarnation_is_refused_and_its_replacement_breaks_the_round():
    m = machine(min_nodes=1, max_nodes=2)
    join_all(m, [node(0), node(1)])
    m.advance(0.0)
    m.join(node(1, node_id=555), 1.0)  # worker-1 was relaunched
    with pytest.raises(StaleRoundError, match="old incarnation"):
        m.waiting(("worker", 1), 101, 1)
    assert m.waiting(("worker", 0), 100, 1) >= 1


def test_closed_rendezvous_refuses_joins_and_ends_waits():
    m = machine(min_nodes=2, max_nodes=2)
    m.join(node(0), 0.0)
    m.set_closed()
    assert m.wait_status(("worker", 0), 100, 1).status == WaitStatus.CLOSED
    with pytest.raises(RendezvousClosedError):
        m.join(node(1), 0.0)


# -- invariants over random histories -------------------------------------------------------------

_events = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 7)),
        st.tuples(st.just("tick"), st.floats(0.0, 4.0)),
        st.tuples(st.just("touch_all"), st.just(0)),
        st.tuples(st.just("leave"), st.integers(0, 7)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    events=_events,
    min_nodes=st.integers(1, 4),
    extra=st.integers(0, 4),
    unit=st.integers(1, 3),
)
def test_every_closed_round_obeys_the_config(events, min_nodes, extra, unit):
    max_nodes = min_nodes + extra
    if (max_nodes // unit) * unit < min_nodes:
        return
    m = machine(min_nodes, max_nodes, unit, last_call=1.0, lease=6.0)
    now = 0.0
    numbers = itertools.count(1)
    for kind, arg in events:
        if kind == "join":
            m.join(node(arg), now)
        elif kind == "tick":
            now += arg
        elif kind == "touch_all":
            for r in range(8):
                m.touch(("worker", r), 100 + r, now)
        else:
            m.leave(("worker", arg), 100 + arg)
        closed = m.advance(now)
        if closed is not None:
            size = len(closed.members)
            assert min_nodes <= size <= max_nodes and size % unit == 0
            assert closed.number == next(numbers)
            assert len({p.key for p in closed.members}) == size
            # Admitted nodes no longer wait; every member knows its rank.
            for rank, p in enumerate(closed.members):
                assert m.wait_status(p.key, p.id, closed.number).rank == rank


# -- the thread-safe service ----------------------------------------------------------------------


def test_service_resumes_round_numbers_from_the_state_store(tmp_path):
    path = str(tmp_path / "state.sqlite")
    config = RoundConfig(1, 1, last_call_seconds=0.0)
    with SQLiteStateStore(path) as store:
        service = RendezvousService(store)
        number = service.join("run", config, node(0))
        assert service.wait_round("run", ("worker", 0), 100, number, 5.0).status == WaitStatus.DONE
    with SQLiteStateStore(path) as store:
        resumed = RendezvousService(store)
        assert resumed.current_round("run") == 1
        # Fencing survives: the next round is 2, never a reused 1.
        assert resumed.join("run", config, node(0, node_id=7)) == 2


def test_service_refuses_a_different_config_for_the_same_run():
    service = RendezvousService()
    service.join("run", RoundConfig(1, 2), node(0))
    with pytest.raises(ValueError, match="same settings"):
        service.join("run", RoundConfig(1, 3), node(1))
