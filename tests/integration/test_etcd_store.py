"""EtcdStateStore against a real etcd on loopback: the SQLite store's behaviour, plus durability,
fencing, the key layout and clear errors for unreachable or wrong endpoints."""

from __future__ import annotations

import base64
import json
import socket
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from master.state import etcd as etcd_module
from master.state.api import StateStore, StateStoreError
from master.state.etcd import EtcdStateStore, StateStoreFencedError
from master.state.factory import open_state_store
from tests.integration.etcd_server import EtcdServer, etcd_binary

# The store-agnostic behaviour tests of the SQLite store, collected here a second time: pytest
# resolves their `store` argument with this module's fixture, so they run against etcd.
from tests.unit.test_state_store import (  # noqa: F401
    Boom,
    test_any_strings_and_bytes,
    test_concurrent_writers,
    test_nested_failure_caught_by_outer_undoes_only_the_nested_block,
    test_nested_transactions_are_part_of_the_outer,
    test_put_get_delete_scan,
    test_transaction_commits,
    test_transaction_rolls_back_on_exception,
    test_type_errors,
    test_uncommitted_writes_are_invisible_to_other_threads,
)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(etcd_binary(), tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix per test, so tests sharing the server never see each other's keys."""
    return f"/test/{uuid.uuid4().hex}/"


@pytest.fixture
def store(etcd: EtcdServer, prefix: str) -> Iterator[EtcdStateStore]:
    s = EtcdStateStore(etcd.endpoint, prefix)
    yield s
    s.close()


def raw(endpoint: str, method: str, body: dict) -> dict:
    """One request to etcd's JSON gateway, bypassing the store."""
    request = urllib.request.Request(
        f"http://{endpoint}/v3/{method}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def b64(raw_bytes: bytes) -> str:
    return base64.b64encode(raw_bytes).decode()


def raw_keys(endpoint: str, prefix: str) -> list[bytes]:
    """Every key under prefix as etcd stores it."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    reply = raw(endpoint, "kv/range", {"key": b64(prefix.encode()), "range_end": b64(end.encode())})
    return [base64.b64decode(kv["key"]) for kv in reply.get("kvs", [])]


def revision(endpoint: str) -> int:
    return int(raw(endpoint, "kv/range", {"key": b64(b"/"), "limit": "1"})["header"]["revision"])


def test_is_a_state_store() -> None:
    assert issubclass(EtcdStateStore, StateStore)


def test_data_survives_a_new_client(etcd: EtcdServer, prefix: str) -> None:
    with EtcdStateStore(etcd.endpoint, prefix) as first:
        first.put("nodes", "worker-0", b"running")
        with first.transaction():
            first.put("nodes", "worker-1", b"pending")
        with pytest.raises(Boom), first.transaction():
            first.put("nodes", "worker-2", b"never")
            raise Boom
    with EtcdStateStore([f"http://{etcd.endpoint}"], prefix) as second:
        assert second.scan("nodes") == {"worker-0": b"running", "worker-1": b"pending"}
    with EtcdStateStore(etcd.endpoint, "/another/job/") as other_job:
        assert other_job.scan("nodes") == {}


def test_data_survives_etcd_killed_and_restarted(tmp_path: Path, prefix: str) -> None:
    server = EtcdServer(etcd_binary(), tmp_path / "data")
    server.start()
    try:
        with EtcdStateStore(server.endpoint, prefix) as store:
            with store.transaction():
                store.put("shards", "epoch-0", b"ledger")
                store.put("nodes", "ps-0", b"running")
            store.put("kv", "round", b"3")
        server.kill()  # SIGKILL: only what etcd had made durable before answering survives
        with pytest.raises(StateStoreError, match="unreachable"):
            EtcdStateStore(server.endpoint, prefix, timeout=2)
        server.start()  # same data dir, same ports
        with EtcdStateStore(server.endpoint, prefix) as store:
            assert store.scan("shards") == {"epoch-0": b"ledger"}
            assert store.get("nodes", "ps-0") == b"running"
            assert store.get("kv", "round") == b"3"
    finally:
        server.kill()


def test_unreachable_endpoint_is_a_clear_error() -> None:
    with socket.socket() as held:  # bound, not listening: connecting is refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises(StateStoreError) as info:
            EtcdStateStore(f"127.0.0.1:{port}", timeout=1)
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message
    assert "unreachable" in message and "--listen-client-urls" in message


def test_silent_endpoint_fails_within_the_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        with pytest.raises(StateStoreError) as info:
            EtcdStateStore(f"127.0.0.1:{port}", timeout=0.3)
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "did not answer" in message
    assert "0.3 s" in message


def test_peer_url_is_not_a_client_url(etcd: EtcdServer) -> None:
    with pytest.raises(StateStoreError, match="not an etcd >= 3.4 client URL.*advertise-client"):
        EtcdStateStore(etcd.peer_endpoint)


def test_bad_endpoint_strings() -> None:
    with pytest.raises(StateStoreError, match="not host:port"):
        EtcdStateStore("ftp://127.0.0.1:2379")
    with pytest.raises(StateStoreError, match="no etcd endpoint"):
        EtcdStateStore([])


def test_fails_over_to_the_next_endpoint(etcd: EtcdServer, prefix: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{held.getsockname()[1]}"
        with EtcdStateStore([dead, etcd.endpoint], prefix) as store:
            store.put("t", "k", b"v")
            assert store.get("t", "k") == b"v"


def test_key_layout_keeps_tables_apart(
    store: EtcdStateStore, etcd: EtcdServer, prefix: str
) -> None:
    store.put("a/b", "c", b"1")
    store.put("a", "b/c", b"2")
    store.put("a", "b", b"3")
    store.put("a%2Fb", "c", b"4")  # the encoded form of "a/b" is a different table
    assert store.scan("a") == {"b": b"3", "b/c": b"2"}
    assert store.scan("a/b") == {"c": b"1"}
    assert store.scan("a%2Fb") == {"c": b"4"}
    assert sorted(raw_keys(etcd.endpoint, prefix)) == [
        f"{prefix}a%252Fb/c".encode(),
        f"{prefix}a%2Fb/c".encode(),
        f"{prefix}a/b".encode(),
        f"{prefix}a/b%2Fc".encode(),
    ]


def test_scan_order_is_by_name_not_by_encoding(store: EtcdStateStore) -> None:
    names = ["a-", "a/", "a%", "a", "b", "a ", "ä", "A"]
    for name in names:
        store.put("t", name, name.encode())
    assert list(store.scan("t")) == sorted(names)


def test_scan_reads_page_by_page(store: EtcdStateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_module, "_SCAN_PAGE_KEYS", 2)
    expected = {f"k{i}": str(i).encode() for i in range(7)}
    for k, v in expected.items():
        store.put("t", k, v)
    store.put("u", "k0", b"other table")
    assert store.scan("t") == expected
    with store.transaction():
        store.delete("t", "k3")
        store.put("t", "k9", b"pending")
        assert store.scan("t") == {
            **{k: v for k, v in expected.items() if k != "k3"},
            "k9": b"pending",
        }


def test_a_transaction_is_one_etcd_txn(
    store: EtcdStateStore, etcd: EtcdServer, prefix: str
) -> None:
    store.put("t", "gone", b"x")
    other = EtcdStateStore(etcd.endpoint, prefix)  # another client: its own lock
    try:
        before = revision(etcd.endpoint)
        with store.transaction():
            for i in range(10):
                store.put("t", str(i), b"v")
            store.delete("t", "gone")
            store.put("t", "0", b"last write wins")
            assert other.scan("t") == {"gone": b"x"}  # nothing is written before the commit
            assert revision(etcd.endpoint) == before
        assert revision(etcd.endpoint) == before + 1  # all writes in one revision
        assert other.scan("t") == {"0": b"last write wins", **{str(i): b"v" for i in range(1, 10)}}
    finally:
        other.close()


def test_expect_is_compare_and_set(store: EtcdStateStore) -> None:
    with store.transaction(expect={("master", "epoch"): None}):  # absent: the first master
        store.put("master", "epoch", b"1")
    with store.transaction(expect={("master", "epoch"): b"1"}):
        store.put("master", "epoch", b"2")
        store.put("nodes", "w0", b"running")
    with (
        pytest.raises(StateStoreFencedError) as info,
        store.transaction(expect={("master", "epoch"): b"1"}),
    ):
        store.put("master", "epoch", b"2")
        store.put("nodes", "w0", b"stale")
    message = str(info.value)
    assert "'master/epoch' holds b'2', expected b'1'" in message
    assert "nothing was written" in message
    assert store.get("nodes", "w0") == b"running"
    # A nested block's condition is a condition of the whole commit.
    with pytest.raises(StateStoreFencedError), store.transaction():
        store.put("nodes", "w1", b"x")
        with store.transaction(expect={("master", "epoch"): None}):
            store.put("nodes", "w2", b"x")
    assert store.scan("nodes") == {"w0": b"running"}
    with store.transaction(expect={("master", "empty"): None}):
        store.put("master", "empty", b"")
    with store.transaction(expect={("master", "empty"): b""}):  # an empty value is not absent
        pass
    with (
        pytest.raises(StateStoreFencedError),
        store.transaction(expect={("master", "empty"): None}),
    ):
        pass


def test_fence_stops_a_replaced_master(
    store: EtcdStateStore, etcd: EtcdServer, prefix: str
) -> None:
    store.put("master", "epoch", b"1")
    store.set_fence({("master", "epoch"): b"1"})
    store.put("nodes", "w0", b"a")
    with store.transaction():
        store.put("nodes", "w1", b"b")
    with EtcdStateStore(etcd.endpoint, prefix) as successor:
        with successor.transaction(expect={("master", "epoch"): b"1"}):
            successor.put("master", "epoch", b"2")
        successor.set_fence({("master", "epoch"): b"2"})
        successor.put("nodes", "w0", b"new master")
    with pytest.raises(StateStoreFencedError, match="holds b'2', expected b'1'"):
        store.put("nodes", "w0", b"old master")
    with pytest.raises(StateStoreFencedError), store.transaction():
        store.delete("nodes", "w1")
    assert store.scan("nodes") == {"w0": b"new master", "w1": b"b"}  # reads are not fenced
    store.set_fence(None)
    store.put("nodes", "w2", b"c")
    assert store.get("nodes", "w2") == b"c"


def test_too_many_writes_in_one_transaction_is_a_clear_error(store: EtcdStateStore) -> None:
    with pytest.raises(StateStoreError, match="--max-txn-ops") as info, store.transaction():
        for i in range(200):  # etcd's default --max-txn-ops is 128
            store.put("t", str(i), b"x")
    assert "etcd at http://127.0.0.1:" in str(info.value)
    assert store.scan("t") == {}
    store.put("t", "after", b"ok")  # usable afterwards
    assert store.scan("t") == {"after": b"ok"}


def test_closed_store(store: EtcdStateStore) -> None:
    with pytest.raises(StateStoreError, match="inside a transaction"), store.transaction():
        store.close()
    store.close()
    store.close()  # twice is fine
    with pytest.raises(StateStoreError, match="is closed"):
        store.get("t", "k")
    with pytest.raises(StateStoreError, match="is closed"):
        store.put("t", "k", b"v")
    with pytest.raises(StateStoreError, match="is closed"), store.transaction():
        pass


def test_open_state_store_picks_etcd(etcd: EtcdServer, tmp_path: Path) -> None:
    with open_state_store(f"etcd://{etcd.endpoint}/jobs/one", job="ignored") as s:
        assert isinstance(s, EtcdStateStore) and s.prefix == "/jobs/one/"
        s.put("t", "k", b"v")
    with open_state_store(f"etcd://{etcd.endpoint}", job="two") as s:
        assert isinstance(s, EtcdStateStore) and s.prefix == "/dlrover/two/"
        assert s.get("t", "k") is None
    with open_state_store(f"etcd://{etcd.endpoint}/jobs/one/") as s:
        assert s.get("t", "k") == b"v"
