"""MasterStore against torch's documented Store behaviour, over real gRPC on loopback.

Every semantic test runs twice: on MasterStore and on torch's own TCPStore. The TCPStore run
shows the expectation is torch's documented behaviour, not a quirk of our implementation.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import time
import traceback
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dlrover_torch.store import MasterStore
from master.client import KVClient, MasterClient, MasterError, NodeIdentity, StaleNodeError
from master.kv.store import KVStore
from master.rpc.standalone import start_standalone_master
from master.state.sqlite import SQLiteStateStore
from tests.integration.conftest import TOKEN
from tests.integration.dlrover_run_helpers import wait_for

TIMEOUT = timedelta(seconds=30)
SHORT = timedelta(milliseconds=300)


@pytest.fixture(scope="module")
def standalone():
    server, port, token = start_standalone_master()
    client = MasterClient(f"127.0.0.1:{port}", token, NodeIdentity("worker", 0, 1))
    client.token = token
    yield client
    client.close()
    server.stop(grace=0).wait()


@pytest.fixture(params=["master", "torch_tcp"])
def stores(request, standalone) -> tuple[dist.Store, dist.Store]:
    """Two handles (as two ranks would hold) on one fresh store: ours, or torch's TCPStore."""
    if request.param == "master":
        # A fresh prefix per test: the module's master is shared.
        prefix = f"{uuid.uuid4().hex}/"
        other = MasterClient(standalone.addr, standalone.token, NodeIdentity("worker", 1, 2))
        yield (
            MasterStore(KVClient(standalone), prefix, TIMEOUT),
            MasterStore(KVClient(other), prefix, TIMEOUT),
        )
        other.close()
        return
    server = dist.TCPStore("127.0.0.1", 0, 2, True, TIMEOUT, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, TIMEOUT)
    yield server, client
    del client, server


@pytest.fixture
def store(stores) -> dist.Store:
    return stores[0]


def _set_later(store: dist.Store, key: str, value: str, delay: float = 0.2) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)  # ordering only: the reader is (very likely) blocked by then
        store.set(key, value)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


# -- set / get ------------------------------------------------------------------------------------


def test_set_then_get_returns_bytes_and_set_overwrites(store):
    store.set("k", "first")
    assert store.get("k") == b"first"
    store.set("k", b"\x00\xffsecond")
    assert store.get("k") == b"\x00\xffsecond"


def test_get_blocks_until_another_rank_sets_the_key(stores):
    store, other = stores
    writer = _set_later(other, "late", "here")
    assert store.get("late") == b"here"
    writer.join()


def test_get_of_a_missing_key_raises_dist_store_error_after_the_timeout(store):
    store.set_timeout(SHORT)
    assert store.timeout == SHORT
    with pytest.raises(dist.DistStoreError):
        store.get("never")


# -- add ------------------------------------------------------------------------------------------


def test_add_creates_the_counter_at_zero_and_returns_the_new_value(store):
    assert store.add("n", 5) == 5
    assert store.add("n", -2) == 3
    assert store.add("n", 0) == 3
    assert store.get("n") == b"3"  # stored as decimal text


def test_add_is_atomic_across_ranks(stores):
    def bump(s: dist.Store) -> None:
        for _ in range(20):
            s.add("c", 1)

    threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stores[0].add("c", 0) == 40


# -- compare_set ----------------------------------------------------------------------------------


def test_compare_set_sets_on_match_and_returns_the_new_value(store):
    store.set("cas", "old")
    assert store.compare_set("cas", "old", "new") == b"new"
    assert store.get("cas") == b"new"


def test_compare_set_on_mismatch_keeps_and_returns_the_stored_value(store):
    store.set("cas", "stored")
    assert store.compare_set("cas", "other", "new") == b"stored"
    assert store.get("cas") == b"stored"


def test_compare_set_on_a_missing_key_with_empty_expected_inserts(store):
    assert store.compare_set("fresh", "", "v") == b"v"
    assert store.get("fresh") == b"v"


def test_compare_set_on_a_missing_key_with_expected_sets_nothing(store):
    assert store.compare_set("absent", "x", "v") == b"x"
    assert store.check(["absent"]) is False


# -- wait / check ---------------------------------------------------------------------------------


def test_wait_returns_once_every_key_is_set(stores):
    store, other = stores
    store.set("a", "1")
    writer = _set_later(other, "b", "2")
    store.wait(["a", "b"])
    assert store.check(["a", "b"])
    writer.join()


def test_wait_raises_dist_store_error_when_a_key_never_comes(store):
    store.set("a", "1")
    with pytest.raises(dist.DistStoreError):
        store.wait(["a", "missing"], SHORT)
    store.set_timeout(SHORT)
    with pytest.raises(dist.DistStoreError):
        store.wait(["missing"])  # the store's own timeout


def test_check_tells_whether_all_keys_exist_without_waiting(store):
    store.set("x", "1")
    assert store.check(["x"]) is True
    assert store.check(["x", "y"]) is False


# -- delete_key / num_keys ------------------------------------------------------------------------


def test_delete_key_returns_whether_it_deleted(store):
    store.set("d", "1")
    assert store.delete_key("d") is True
    assert store.delete_key("d") is False
    assert store.check(["d"]) is False


def test_num_keys_counts_distinct_keys(store):
    # torch documents that a store may hold one extra coordination key: compare differences.
    base = store.num_keys()
    store.set("n1", "1")
    store.add("n2", 1)
    assert store.num_keys() == base + 2
    store.set("n1", "overwritten")
    assert store.num_keys() == base + 2
    store.delete_key("n1")
    assert store.num_keys() == base + 1


def test_works_under_torch_prefix_store(store):
    prefixed = dist.PrefixStore("group0", store)
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v"
    assert prefixed.add("c", 2) == 2
    assert store.check(["group0/k"])


# -- MasterStore specifics ------------------------------------------------------------------------


def test_prefixes_isolate_stores(standalone):
    a = MasterStore(KVClient(standalone), "a/", TIMEOUT)
    b = MasterStore(KVClient(standalone), "b/", SHORT)
    a.set("k", "1")
    with pytest.raises(dist.DistStoreError):
        b.get("k")


def test_add_to_a_non_integer_value_names_the_key(standalone):
    s = MasterStore(KVClient(standalone), "nonint/", TIMEOUT)
    s.set("text", "abc")
    with pytest.raises(ValueError, match="nonint/text"):
        s.add("text", 1)


def test_unreachable_master_raises_dist_network_error():
    client = MasterClient("127.0.0.1:1", "t", NodeIdentity("worker", 0, 1), retry_seconds=0.2)
    s = MasterStore(KVClient(client), "", SHORT)
    with pytest.raises(dist.DistNetworkError, match="cannot reach the master"):
        s.set("k", "v")
    client.close()


def test_job_master_refuses_a_wrong_token_and_a_stale_node(harness):
    with pytest.raises(MasterError, match="token"):
        KVClient(harness.client(0, token="wrong")).set(b"k", b"v")
    node = harness.nodes[0]
    stale = MasterClient(harness.addr, TOKEN, NodeIdentity(node.type, node.rank, node.id + 999))
    with pytest.raises(StaleNodeError):
        KVClient(stale).set(b"k", b"v")
    stale.close()
    KVClient(harness.client(0)).set(b"k", b"v")  # the current incarnation is served


def test_kv_entries_survive_a_master_restart(tmp_path):
    path = str(tmp_path / "state.sqlite")
    with SQLiteStateStore(path) as state:
        kv = KVStore(state)
        kv.set(b"\x00bin", b"v")
        kv.add(b"counter", 41)
        kv.set(b"gone", b"x")
        kv.delete(b"gone")
    with SQLiteStateStore(path) as state:
        kv = KVStore(state)
        assert kv.get(b"\x00bin", 0) == b"v"
        assert kv.add(b"counter", 1) == 42
        assert kv.num_keys() == 2


# -- a real process group through MasterStore -----------------------------------------------------


def _all_reduce_worker(addr: str, token: str, node: tuple, rank: int, world: int, out) -> None:
    client = MasterClient(addr, token, NodeIdentity(*node))
    store = MasterStore(KVClient(client), "pg-test/", timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    out.put((rank, t.item()))
    dist.destroy_process_group()
    client.close()


@pytest.mark.slow
def test_gloo_process_group_all_reduce_through_master_store(harness):
    """Three ranks (this process and two spawned ones) form a gloo group on MasterStore."""
    world = 3
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    node = harness.nodes
    procs = [
        ctx.Process(
            target=_all_reduce_worker,
            args=(harness.addr, TOKEN, (node[r].type, node[r].rank, node[r].id), r, world, out),
        )
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    try:
        q: multiprocessing.Queue = multiprocessing.Queue()
        _all_reduce_worker(
            harness.addr, TOKEN, (node[0].type, node[0].rank, node[0].id), 0, world, q
        )
        results = dict([q.get(timeout=10)] + [out.get(timeout=120) for _ in range(1, world)])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == {r: 6.0 for r in range(world)}
    assert all(p.exitcode == 0 for p in procs)


def test_standalone_master_makes_a_token_and_refuses_others():
    server, port, token = start_standalone_master()
    try:
        assert len(token) >= 16
        good = MasterClient(f"127.0.0.1:{port}", token, NodeIdentity("worker", 0, 1))
        KVClient(good).set(b"k", b"v")
        bad = MasterClient(f"127.0.0.1:{port}", "not-" + token, NodeIdentity("worker", 0, 1))
        with pytest.raises(MasterError, match="token"):
            KVClient(bad).get(b"k", 0)
        good.close()
        bad.close()
    finally:
        server.stop(grace=0).wait()


def test_a_cancelled_wait_frees_its_thread_before_the_timeout():
    kv = KVStore()
    active = threading.Event()
    active.set()
    result: list = []
    waiter = threading.Thread(
        target=lambda: result.append(kv.get(b"never", 600, is_active=active.is_set))
    )
    waiter.start()
    active.clear()  # what the RPC's end callback reports for a client that went away
    kv.wake()
    waiter.join(timeout=60)
    assert not waiter.is_alive() and result == [None]


def test_closing_the_store_ends_every_wait_now_and_later():
    """The master closes its store when the job ends: a node's wait still open must not hold
    a server thread, and so the master's exit, until its timeout."""
    kv = KVStore()
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(kv.wait([b"never"], 600)))
    waiter.start()
    kv.close()
    waiter.join(timeout=60)
    assert not waiter.is_alive() and result == [False]
    late = threading.Thread(target=lambda: result.append(kv.get(b"never", 600)))
    late.start()
    late.join(timeout=60)
    assert not late.is_alive() and result == [False, None]
    kv.set(b"k", b"v")  # what is there is still answered
    assert kv.get(b"k", 600) == b"v"


_WAIT_FOR_A_KEY_THAT_NEVER_COMES = """
import sys
import master.client.kv as kv
from master.client import KVClient, MasterClient, NodeIdentity
kv.MAX_WAIT_CHUNK_MS = 60_000  # one call that waits a minute on the server
client = MasterClient(sys.argv[1], sys.argv[2], NodeIdentity("worker", 0, int(sys.argv[3])))
print("waiting", flush=True)
KVClient(client).wait([b"never"], 60)
"""


def _threads_in_kv_waits() -> int:
    return sum(
        any(f.name == "_wait_for" and f.filename.endswith("kv/store.py") for f in stack)
        for stack in map(traceback.extract_stack, sys._current_frames().values())
    )


def test_a_dead_clients_kv_wait_frees_its_server_thread_on_both_servers(harness):
    """A node SIGKILLed in a minute-long KV wait: the server's handler thread returns soon after
    (grpc.aio runs a sync handler's end callbacks only once it returned, so the aio server
    runs its waits from coroutines that end them with the call)."""
    node = harness.nodes[0]
    argv = [harness.addr, TOKEN, str(node.id)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _WAIT_FOR_A_KEY_THAT_NEVER_COMES, *argv],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "waiting"
        wait_for(_threads_in_kv_waits, 30, "the wait to reach the server")
    finally:
        proc.kill()
        proc.wait()
    # Half the wait: a thread held to its end fails.
    wait_for(lambda: _threads_in_kv_waits() == 0, 30, "the dead client's wait to free its thread")
