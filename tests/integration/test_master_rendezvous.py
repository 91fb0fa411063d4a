"""MasterRendezvousHandler instances forming rounds on a live job master over loopback gRPC."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from dlrover_torch.rendezvous import MasterRendezvousHandler
from master.client import (
    KVClient,
    MasterClient,
    NodeIdentity,
    RendezvousClient,
    StaleNodeError,
)
from tests.integration.conftest import TOKEN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONDITION_TIMEOUT = 30.0  # generous: the machine is shared; no test asserts on speed


def make_handler(client: MasterClient, run_id: str = "job", **kw) -> MasterRendezvousHandler:
    settings = dict(
        min_nodes=2,
        max_nodes=4,
        last_call_seconds=0.5,
        join_timeout_seconds=60,
        lease_seconds=2.0,
        local_addr="127.0.0.1",
    )
    settings.update(kw)
    return MasterRendezvousHandler(
        RendezvousClient(client),
        KVClient(client),
        run_id,
        client.node.rank,
        1,
        **settings,
    )


def rendezvous_all(handlers: list[MasterRendezvousHandler]) -> list[RendezvousInfo]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers))


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + CONDITION_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {CONDITION_TIMEOUT}s: {what}")
        time.sleep(0.05)


@pytest.fixture
def handlers(harness):
    made = [make_handler(harness.client(i)) for i in range(4)]
    yield made
    for h in made:
        h.shutdown()


def test_three_nodes_form_a_round_with_distinct_ranks_and_one_bootstrap(handlers):
    infos = rendezvous_all(handlers[:3])
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    # rank hints are the node ranks here: ranks follow them
    assert [i.rank for i in infos] == [0, 1, 2]
    boot = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(boot) == 1 and boot.pop()[1] > 0
    # The returned store is shared by the round's members.
    infos[0].store.set("hello", "from rank 0")
    assert infos[2].store.get("hello") == b"from rank 0"
    assert handlers[0].num_nodes_waiting() == 0
    assert handlers[0].get_backend() == "dlrover" and handlers[0].get_run_id() == "job"


def test_a_newcomer_makes_members_re_rendezvous_into_a_fresh_store_and_port(handlers):
    first = rendezvous_all(handlers[:3])
    with ThreadPoolExecutor(1) as pool:
        newcomer = pool.submit(handlers[3].next_rendezvous)
        wait_until(
            lambda: all(h.num_nodes_waiting() > 0 for h in handlers[:3]),
            "members see the waiting newcomer",
        )
        second = rendezvous_all(handlers[:3]) + [newcomer.result(timeout=CONDITION_TIMEOUT)]
    assert sorted(i.rank for i in second) == [0, 1, 2, 3]
    assert {i.world_size for i in second} == {4}
    assert second[0].bootstrap_store_info.master_port != first[0].bootstrap_store_info.master_port
    first[0].store.set("old-round-key", "x")
    assert not second[0].store.check(["old-round-key"])
    assert all(h.num_nodes_waiting() == 0 for h in handlers)


def test_a_stale_round_is_refused(harness, handlers):
    rendezvous_all(handlers[:2])
    rendezvous_all(handlers[:2])  # round 2
    raw = RendezvousClient(harness.client(0))
    with pytest.raises(StaleNodeError, match="round"):
        raw.watch("job", 1, 0, 0)
    with pytest.raises(StaleNodeError, match="round"):
        raw.wait_round("job", 1, 0)
    raw.watch("job", 2, 0, 0)  # the current round is served


def test_an_old_incarnation_cannot_join(harness):
    node = harness.nodes[1]
    old = MasterClient(harness.addr, TOKEN, NodeIdentity(node.type, node.rank, node.id + 99))
    with pytest.raises(RendezvousStateError, match="incarnation|unknown node"):
        make_handler(old).next_rendezvous()
    old.close()


def test_set_closed_ends_the_rendezvous_for_everyone(handlers):
    rendezvous_all(handlers[:2])
    handlers[0].set_closed()
    assert handlers[0].is_closed()
    wait_until(handlers[1].is_closed, "the other member learns that the rendezvous is closed")
    with pytest.raises(RendezvousClosedError):
        handlers[2].next_rendezvous()


def test_join_timeout_when_too_few_nodes_come(harness):
    lonely = make_handler(harness.client(0), run_id="lonely", join_timeout_seconds=1.0)
    with pytest.raises(RendezvousTimeoutError, match="min_nodes=2"):
        lonely.next_rendezvous()


_AGENT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from master.client import MasterClient, NodeIdentity
    from tests.integration.test_master_rendezvous import make_handler
    client = MasterClient({addr!r}, {token!r}, NodeIdentity("worker", {rank}, {node_id}))
    handler = make_handler(client, **{settings!r})
    print("joining", flush=True)
    info = handler.next_rendezvous()
    print("rank", info.rank, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_a_killed_agent_is_lost_and_the_rest_continue_smaller(harness):
    # A long last call so the three join one round although the agent starts slowly.
    settings = dict(run_id="lost", max_nodes=3, last_call_seconds=3.0)
    node = harness.nodes[2]
    code = _AGENT.format(
        root=ROOT,
        addr=harness.addr,
        token=TOKEN,
        rank=node.rank,
        node_id=node.id,
        settings=settings,
    )
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    members = [make_handler(harness.client(i), **settings) for i in range(2)]
    try:
        assert agent.stdout.readline().startswith("joining")
        infos = rendezvous_all(members)
        assert {i.world_size for i in infos} == {3}
        assert agent.stdout.readline().startswith("rank")
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=CONDITION_TIMEOUT)
        wait_until(
            lambda: all(h.num_nodes_waiting() > 0 for h in members),
            "the members learn that a member was lost",
        )
        smaller = rendezvous_all(members)
        assert sorted(i.rank for i in smaller) == [0, 1]
        assert {i.world_size for i in smaller} == {2}
    finally:
        for h in members:
            h.shutdown()
        if agent.poll() is None:
            agent.kill()
            agent.wait()
