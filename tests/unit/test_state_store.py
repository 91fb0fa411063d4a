"""SQLiteStateStore: key-value semantics, atomic nested transactions, durability, threads."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from master.state.api import StateStore, StateStoreError
from master.state.sqlite import SQLiteStateStore


class Boom(Exception):
    pass


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SQLiteStateStore]:
    path = ":memory:" if request.param == "memory" else str(tmp_path / "state.db")
    s = SQLiteStateStore(path)
    yield s
    s.close()


def test_is_a_state_store() -> None:
    assert issubclass(SQLiteStateStore, StateStore)
    with pytest.raises(TypeError):
        StateStore()  # type: ignore[abstract]


def test_put_get_delete_scan(store: SQLiteStateStore) -> None:
    assert store.get("nodes", "a") is None
    assert store.scan("nodes") == {}
    store.put("nodes", "b", b"2")
    store.put("nodes", "a", b"1")
    store.put("shards", "a", b"other table")
    assert store.get("nodes", "a") == b"1"
    store.put("nodes", "a", bytearray(b"1'"))  # replaces; bytes-like accepted
    assert store.get("nodes", "a") == b"1'"
    assert list(store.scan("nodes").items()) == [("a", b"1'"), ("b", b"2")]  # ordered by key
    store.delete("nodes", "a")
    store.delete("nodes", "missing")  # not an error
    assert store.get("nodes", "a") is None
    assert store.scan("nodes") == {"b": b"2"}
    assert store.scan("shards") == {"a": b"other table"}


def test_any_strings_and_bytes(store: SQLiteStateStore) -> None:
    odd_names = ["", "with space", "quote'\"; DROP TABLE kv; --", "ünïcødé/键", "a\nb"]
    payload = bytes(range(256)) * 4
    for name in odd_names:
        store.put(name, name, payload)
        store.put(name, "empty", b"")
    for name in odd_names:
        assert store.get(name, name) == payload
        assert store.scan(name) == {name: payload, "empty": b""}
    assert isinstance(store.get("", ""), bytes)


def test_type_errors(store: SQLiteStateStore) -> None:
    with pytest.raises(TypeError, match="value must be bytes"):
        store.put("t", "k", "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="table and key must be str"):
        store.get("t", 1)  # type: ignore[arg-type]


def test_transaction_commits(store: SQLiteStateStore) -> None:
    with store.transaction():
        store.put("t", "a", b"1")
        store.put("t", "b", b"2")
        store.delete("t", "a")
        assert store.get("t", "b") == b"2"  # visible inside
    assert store.scan("t") == {"b": b"2"}


def test_transaction_rolls_back_on_exception(store: SQLiteStateStore) -> None:
    store.put("t", "keep", b"old")
    with pytest.raises(Boom), store.transaction():
        store.put("t", "keep", b"new")
        store.put("t", "added", b"x")
        store.delete("t", "keep")
        raise Boom
    assert store.scan("t") == {"keep": b"old"}
    # The store is usable afterwards.
    with store.transaction():
        store.put("t", "after", b"y")
    assert store.get("t", "after") == b"y"


def test_nested_transactions_are_part_of_the_outer(store: SQLiteStateStore) -> None:
    with pytest.raises(Boom), store.transaction():
        store.put("t", "outer", b"1")
        with store.transaction():
            store.put("t", "inner", b"2")
        assert store.get("t", "inner") == b"2"
        raise Boom  # the outer fails after the inner finished: nothing of either survives
    assert store.scan("t") == {}

    with store.transaction():
        store.put("t", "outer", b"1")
        with store.transaction(), store.transaction():
            store.put("t", "inner", b"2")
    assert store.scan("t") == {"inner": b"2", "outer": b"1"}


def test_nested_failure_caught_by_outer_undoes_only_the_nested_block(
    store: SQLiteStateStore,
) -> None:
    with store.transaction():
        store.put("t", "outer", b"1")
        try:
            with store.transaction():
                store.put("t", "inner", b"2")
                store.delete("t", "outer")
                raise Boom
        except Boom:
            pass
        assert store.scan("t") == {"outer": b"1"}
        store.put("t", "later", b"3")
    assert store.scan("t") == {"later": b"3", "outer": b"1"}


def test_uncommitted_writes_are_invisible_to_other_threads(store: SQLiteStateStore) -> None:
    inside = threading.Event()
    release = threading.Event()
    seen: list[bytes | None] = []

    def writer() -> None:
        with store.transaction():
            store.put("t", "k", b"v")
            inside.set()
            release.wait(5)

    def reader() -> None:
        seen.append(store.get("t", "k"))  # blocks until the writer's transaction ends

    w = threading.Thread(target=writer)
    w.start()
    assert inside.wait(5)
    r = threading.Thread(target=reader)
    r.start()
    r.join(0.2)
    assert r.is_alive() and seen == []  # not reading a half-done transaction
    release.set()
    w.join(5)
    r.join(5)
    assert seen == [b"v"]


def test_concurrent_writers(store: SQLiteStateStore) -> None:
    threads_n, rounds = 8, 100
    errors: list[BaseException] = []
    start = threading.Barrier(threads_n)

    def work(i: int) -> None:
        try:
            start.wait()
            for r in range(rounds):
                store.put(f"w{i}", str(r), f"{i}:{r}".encode())
                # Read-modify-write of a shared counter: lost updates would show in the total.
                with store.transaction():
                    current = int(store.get("shared", "counter") or b"0")
                    store.put("shared", "counter", str(current + 1).encode())
                if r % 10 == 0:
                    with pytest.raises(Boom), store.transaction():
                        store.put("shared", "counter", b"-1000000")
                        raise Boom
        except BaseException as e:  # surfaced below; a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert store.get("shared", "counter") == str(threads_n * rounds).encode()
    for i in range(threads_n):
        assert store.scan(f"w{i}") == {str(r): f"{i}:{r}".encode() for r in range(rounds)}


def test_persists_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "state.db"  # parent directories are created
    with SQLiteStateStore(str(path)) as first:
        first.put("nodes", "worker-0", b"running")
        with first.transaction():
            first.put("nodes", "worker-1", b"pending")
        with pytest.raises(Boom), first.transaction():
            first.put("nodes", "worker-2", b"never")
            raise Boom
    assert path.exists()
    second = SQLiteStateStore(str(path))
    try:
        assert second.scan("nodes") == {"worker-0": b"running", "worker-1": b"pending"}
        second.delete("nodes", "worker-0")
    finally:
        second.close()
    with SQLiteStateStore(str(path)) as third:
        assert third.scan("nodes") == {"worker-1": b"pending"}


def test_file_uses_wal(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    SQLiteStateStore(str(path)).close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_unwritable_path_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StateStoreError) as info:
        SQLiteStateStore(str(blocker / "state.db"))
    message = str(info.value)
    assert str(blocker / "state.db") in message
    assert "cannot create directory" in message and "writable file" in message

    with pytest.raises(StateStoreError, match="it is a directory"):
        SQLiteStateStore(str(tmp_path))

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateStoreError, match="garbage.db.*cannot open it for writing"):
        SQLiteStateStore(str(garbage))


def test_closed_store(tmp_path: Path) -> None:
    s = SQLiteStateStore(str(tmp_path / "s.db"))
    with pytest.raises(StateStoreError, match="inside a transaction"), s.transaction():
        s.close()
    s.close()
    s.close()  # twice is fine
    with pytest.raises(StateStoreError, match="is closed"):
        s.get("t", "k")
    with pytest.raises(StateStoreError, match="is closed"), s.transaction():
        pass
