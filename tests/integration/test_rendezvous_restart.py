"""Torch rendezvous rounds survive a master restart: a new master on the same state store serves
the same round to the same agents (no re-rendezvous), and still loses an agent that died while
no master was up.

Each master is a JobMaster with its gRPC server on one loopback port; the "restart" stops the
first server and closes its store (all its memory is gone), then a second JobMaster opens the same
SQLite file, serves on the same port and resumes (`run(resume=True)`). The nodes are two real
MasterRendezvousHandlers with their own clients, as a dlrover-run agent uses them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from dlrover_torch.rendezvous import MasterRendezvousHandler
from master.client import KVClient, MasterClient, NodeIdentity, RendezvousClient
from master.config import parse_job_spec
from master.job.master import JobMaster, JobRuntime
from master.platform.api import NodeLaunchSpec, Platform
from master.rendezvous.service import RESUME_GRACE_SECONDS
from master.rpc.server import start_server
from master.state.sqlite import SQLiteStateStore
from tests.integration.conftest import TOKEN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEASE_S = 2.0
DOWN_S = LEASE_S + 1.0  # the master stays away longer than a lease
TIMEOUT_S = 30.0  # generous: the machine is shared; nothing asserts on speed


class HandStartedNodes(Platform):
    """The nodes are this test's handlers: nothing to start, adopting only records them."""

    inherits_master_env = True

    def __init__(self) -> None:
        super().__init__()
        self.adopted: list[int] = []

    def address_for(self, node_type: str, rank: int) -> str:
        return f"127.0.0.1:{20000 + rank}"

    def launch(self, spec: NodeLaunchSpec) -> None:
        raise AssertionError(f"the master launched {spec.type}-{spec.rank}: nothing should be")

    def signal_node(self, node_id: int, sig: int = signal.SIGKILL) -> bool:
        return False

    def stop_node(self, node_id: int, grace_seconds: float) -> None:
        pass

    def shutdown(self, grace_seconds: float) -> None:
        pass

    def adopt(self, spec: NodeLaunchSpec, handle: dict) -> None:
        self.adopted.append(spec.id)

    def restore_addresses(self, addresses: dict[tuple[str, int], str]) -> None:
        pass


class Master:
    """One master instance on the state file: a JobMaster and its gRPC server."""

    def __init__(self, tmp_path, port: int = 0) -> None:
        spec = parse_job_spec(
            {
                "name": "rdzv-restart",
                "command": ["true"],
                "worker": {"replicas": 2},
                # The handlers send no node heartbeats: only rendezvous leases count here.
                "heartbeat_timeout_seconds": 600,
            },
            source="test",
            base_dir=str(tmp_path),
        )
        self.store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
        self.platform = HandStartedNodes()
        self.job = JobMaster(spec, self.platform, self.store, JobRuntime(str(tmp_path), "", ""))
        self.server, self.port = start_server(self.job, "127.0.0.1", port, TOKEN, 16, 1000)
        self._thread: threading.Thread | None = None

    def resume(self) -> None:
        self._thread = threading.Thread(target=self.job.run, kwargs={"resume": True}, daemon=True)
        self._thread.start()

    def kill(self) -> None:
        """Gone at once, as after SIGKILL: no goodbye to the nodes, nothing more written."""
        self.server.stop(grace=0).wait()
        if self._thread is not None:
            self.job.request_stop("test over")
            self._thread.join(TIMEOUT_S)
        self.job.sharding.close()
        self.store.close()


def start_first_master(tmp_path) -> tuple[Master, list[NodeIdentity]]:
    master = Master(tmp_path)
    job = master.job
    job._take_epoch()
    nodes = []
    for rank in range(2):
        node = job.nodes.new_incarnation("worker", rank, 0, 0)
        job.nodes.mark_running(node.id, master.platform.address_for("worker", rank), "", {})
        nodes.append(NodeIdentity("worker", rank, node.id))
    job._save_runtime()  # what `dlrover submit` records before it launches anything
    return master, nodes


def handler_for(addr: str, node: NodeIdentity) -> tuple[MasterClient, MasterRendezvousHandler]:
    # Retry UNAVAILABLE for a while, as an agent's client does while its master restarts.
    client = MasterClient(addr, TOKEN, node, retry_seconds=TIMEOUT_S)
    handler = MasterRendezvousHandler(
        RendezvousClient(client),
        KVClient(client),
        "job",
        node.rank,
        1,
        min_nodes=1,
        max_nodes=2,
        last_call_seconds=1.0,
        join_timeout_seconds=TIMEOUT_S,
        lease_seconds=LEASE_S,
        local_addr="127.0.0.1",
    )
    return client, handler


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {TIMEOUT_S}s: {what}")
        time.sleep(0.05)


@pytest.fixture
def two_agents_in_round_one(tmp_path):
    """Master 1 up, both handlers in round 1; yields (master, [(client, handler, info)])."""
    master, nodes = start_first_master(tmp_path)
    agents = [handler_for(f"127.0.0.1:{master.port}", n) for n in nodes]
    with ThreadPoolExecutor(2) as pool:
        infos = list(pool.map(lambda a: a[1].next_rendezvous(), agents))
    assert [(i.rank, i.world_size) for i in infos] == [(0, 2), (1, 2)]
    state = {"master": master}
    yield state, [(c, h, i) for (c, h), i in zip(agents, infos, strict=True)]
    for client, handler in agents:
        handler.shutdown()
        client.close()
    state["master"].kill()


def restart(tmp_path, state: dict) -> Master:
    old = state["master"]
    old.kill()
    time.sleep(DOWN_S)
    new = state["master"] = Master(tmp_path, port=old.port)
    new.resume()
    return new


@pytest.mark.slow
def test_agents_keep_their_round_and_ranks_through_a_master_restart(
    tmp_path, two_agents_in_round_one
):
    state, agents = two_agents_in_round_one
    new = restart(tmp_path, state)
    wait_until(lambda: new.platform.adopted, "the new master adopts the nodes")
    # Past the first lease the new master gives (grace + lease): only watches that reached it
    # and renewed the leases there keep the members in the round.
    time.sleep(RESUME_GRACE_SECONDS + LEASE_S + 1)
    assert [h.num_nodes_waiting() for _, h, _ in agents] == [0, 0]
    assert new.job.rendezvous.current_round("job") == 1
    for client, _, info in agents:
        # The new master serves round 1 with the same rank to each member...
        reply = RendezvousClient(client).wait_round("job", 1, 0)
        assert (reply.round, reply.rank, len(reply.members)) == (1, info.rank, 2)
        assert RendezvousClient(client).watch("job", 1, 0, 0).waiting == 0
    # ...and its round store still holds what the members published in it.
    boot = agents[1][2].bootstrap_store_info
    assert (
        agents[1][2].store.get(RendezvousStoreInfo.MASTER_PORT_KEY)
        == str(boot.master_port).encode()
    )
    # Round 1 closed once, under the first master: nobody re-rendezvoused under the new one.
    kinds = [e.kind for e in new.job.events]
    assert kinds.count("rendezvous_round") == 1
    assert kinds.index("rendezvous_round") < kinds.index("master_restarted")


_AGENT = """
import sys, time
sys.path.insert(0, {root!r})
from master.client import NodeIdentity
from tests.integration.test_rendezvous_restart import handler_for
client, handler = handler_for({addr!r}, NodeIdentity("worker", {rank}, {node_id}))
print("joining", flush=True)
info = handler.next_rendezvous()
print("rank", info.rank, info.world_size, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_an_agent_that_died_while_the_master_was_down_is_lost_after_its_lease(tmp_path):
    master, (node0, node1) = start_first_master(tmp_path)
    state = {"master": master}
    addr = f"127.0.0.1:{master.port}"
    code = _AGENT.format(root=ROOT, addr=addr, rank=node1.rank, node_id=node1.id)
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    client, survivor = handler_for(addr, node0)
    try:
        assert agent.stdout.readline().startswith("joining")
        assert (survivor.next_rendezvous().world_size, agent.stdout.readline()) == (2, "rank 1 2\n")
        old = state["master"]
        old.kill()
        agent.send_signal(signal.SIGKILL)  # dies while no master is up: nobody is told
        agent.wait(TIMEOUT_S)
        time.sleep(DOWN_S)
        new = state["master"] = Master(tmp_path, port=old.port)
        new.resume()
        wait_until(lambda: survivor.num_nodes_waiting() > 0, "the survivor learns its peer is lost")
        info = survivor.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert new.job.rendezvous.current_round("job") == 2
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        survivor.shutdown()
        client.close()
        state["master"].kill()
