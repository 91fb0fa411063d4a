"""The shard service's writes to the state store: durable before a call returns, incremental
(a head row and a row per held shard), grouped under concurrency, and retried after a failure."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from master.sharding.group_commit import GroupCommitter
from master.sharding.ledger import DatasetLedger, DatasetSpec
from master.sharding.service import (
    LEASE_TABLE,
    LEDGER_TABLE,
    ShardGrant,
    ShardingService,
    ShardStatus,
)
from master.state.api import StateStoreError
from master.state.sqlite import SQLiteStateStore

SPEC = DatasetSpec("ds", size=10_000, batch_size=10, records_per_shard=100)


class CountingStore(SQLiteStateStore):
    """SQLite store that counts committed outermost transactions and can fail the next ones."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.commits = 0
        self.fail_next = 0
        self.gate: threading.Event | None = None  # when set, writes wait for it to open
        self.writing = threading.Event()  # set once a write waits at the gate
        self._nesting = threading.local()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            depth = getattr(self._nesting, "depth", 0)
            if depth == 0 and self.fail_next:
                self.fail_next -= 1
                raise StateStoreError("disk full (injected)")
            gate = self.gate if depth == 0 else None
            if gate is not None:
                self.writing.set()
                gate.wait(10)
            self._nesting.depth = depth + 1
            try:
                with super().transaction():
                    yield
            finally:
                self._nesting.depth = depth
            if depth == 0:
                self.commits += 1


def reopened(path: Path) -> ShardingService:
    """What a restarted master would load, read through a connection of its own."""
    return ShardingService(SQLiteStateStore(str(path)), flush_seconds=3600)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state.sqlite"


def test_grant_and_completion_are_stored_before_the_call_returns(path: Path) -> None:
    svc = ShardingService(SQLiteStateStore(str(path)), flush_seconds=3600)  # no background flush
    svc.create(SPEC)
    grant = svc.get_shard("ds", holder=7, request_id=1)
    assert grant.status == ShardStatus.SHARD
    assert reopened(path)._datasets["ds"].ledger.held_by(7) == [grant.shard]

    svc.report("ds", 7, [(grant.shard.shard_id, grant.shard.size)])
    after = reopened(path)._datasets["ds"].ledger
    assert after.held_by(7) == []
    assert after.records_done == grant.shard.size
    assert SQLiteStateStore(str(path)).scan(LEASE_TABLE) == {}
    svc.close()


def test_a_write_stores_the_head_and_the_changed_lease_only(path: Path) -> None:
    store = SQLiteStateStore(str(path))
    svc = ShardingService(store, flush_seconds=3600)
    svc.create(SPEC)
    shards = [svc.get_shard("ds", holder=h, request_id=1).shard for h in range(5)]
    head = json.loads(store.get(LEDGER_TABLE, "ds"))
    assert "doing" not in head
    rows = store.scan(LEASE_TABLE)
    assert len(rows) == 5
    assert {json.loads(v)["shard_id"] for v in rows.values()} == {s.shard_id for s in shards}
    # Partial progress is flushed later, and then only its own row changes.
    svc.report("ds", 2, [(shards[2].shard_id, 30)])
    svc.flush()
    assert reopened(path)._datasets["ds"].ledger.consumed(2, shards[2].shard_id) == 30
    svc.close()


def test_grants_waiting_for_a_write_share_the_next_one(path: Path) -> None:
    store = CountingStore(str(path))
    svc = ShardingService(store, flush_seconds=3600)
    svc.create(SPEC)
    before = store.commits
    gate, writing = threading.Event(), threading.Event()
    store.gate, store.writing = gate, writing
    got: dict[int, object] = {}

    def node(holder: int) -> None:
        got[holder] = svc.get_shard("ds", holder, request_id=1).shard

    first = threading.Thread(target=node, args=(0,))
    first.start()
    assert writing.wait(10)  # node 0's grant is being written, and that write is held
    others = [threading.Thread(target=node, args=(h,)) for h in range(1, 9)]
    for t in others:
        t.start()
    deadline = time.monotonic() + 10
    while svc._datasets["ds"].ledger.holders() != set(range(9)) and time.monotonic() < deadline:
        time.sleep(0.01)  # until every other node has its shard in memory, waiting for the write
    assert all(t.is_alive() for t in others)  # none answered before its grant is stored
    store.gate = None
    gate.set()
    for t in [first, *others]:
        t.join(10)
    assert store.commits - before == 2  # node 0's write, then one for the other eight
    ledger = reopened(path)._datasets["ds"].ledger
    for holder, shard in got.items():
        assert ledger.held_by(holder) == [shard]
    svc.close()


def test_a_failed_write_is_retried_by_the_retried_ask(path: Path) -> None:
    store = CountingStore(str(path))
    svc = ShardingService(store, flush_seconds=3600)
    svc.create(SPEC)
    store.fail_next = 1
    with pytest.raises(StateStoreError):
        svc.get_shard("ds", holder=3, request_id=5)
    assert reopened(path)._datasets["ds"].ledger.held_by(3) == []
    again = svc.get_shard("ds", holder=3, request_id=5)  # the node retries the same ask
    assert reopened(path)._datasets["ds"].ledger.held_by(3) == [again.shard]
    svc.close()


def test_a_whole_ledger_row_of_the_old_layout_loads_and_is_rewritten(path: Path) -> None:
    ledger = DatasetLedger(SPEC)
    held = ledger.next_shard(4, request_id=9)
    store = SQLiteStateStore(str(path))
    store.put(LEDGER_TABLE, "ds", json.dumps(ledger.snapshot()).encode())
    svc = ShardingService(store, flush_seconds=3600)
    assert svc.get_shard("ds", 4, request_id=9).shard == held  # the retried ask, answered again
    svc.get_shard("ds", 5, request_id=1)
    assert "doing" not in json.loads(store.get(LEDGER_TABLE, "ds"))
    assert len(store.scan(LEASE_TABLE)) == 2
    assert reopened(path)._datasets["ds"].ledger.held_by(4) == [held]
    svc.close()


def test_restoring_a_snapshot_drops_the_rows_of_shards_it_gives_back(path: Path) -> None:
    store = SQLiteStateStore(str(path))
    svc = ShardingService(store, flush_seconds=3600)
    svc.create(SPEC)  # saves the snapshot of step 0
    for h in range(3):
        svc.get_shard("ds", holder=h, request_id=1)
    assert len(store.scan(LEASE_TABLE)) == 3
    svc.restore_snapshot("ds", 0)
    assert store.scan(LEASE_TABLE) == {}
    ledger = reopened(path)._datasets["ds"].ledger
    assert ledger.holders() == set()
    assert ledger.next_shard_id == 3  # ids handed out before the restore are never reused
    svc.close()


def test_a_write_of_too_many_rows_stores_the_whole_ledger_instead(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import master.sharding.service as service

    monkeypatch.setattr(service, "MAX_LEASE_ROWS_PER_WRITE", 3)
    store = SQLiteStateStore(str(path))
    store.max_writes_per_transaction = 128  # as etcd: a limited transaction size
    svc = ShardingService(store, flush_seconds=3600)
    svc.create(SPEC)
    shards = {h: svc.get_shard("ds", holder=h, request_id=1).shard for h in range(5)}
    assert len(store.scan(LEASE_TABLE)) == 5  # one row per grant so far
    svc.restore_snapshot("ds", 0)  # gives back all five: five rows to drop, over the limit
    head = json.loads(store.get(LEDGER_TABLE, "ds"))
    assert head["doing"] == []  # the whole ledger, in the head row
    assert len(store.scan(LEASE_TABLE)) == 2  # three stale rows dropped in the same write
    assert reopened(path)._datasets["ds"].ledger.holders() == set()

    again = svc.get_shard("ds", holder=9, request_id=2).shard  # rows: 2 stale + 1 held
    assert "doing" not in json.loads(store.get(LEDGER_TABLE, "ds"))  # small again
    rows = store.scan(LEASE_TABLE)
    assert [json.loads(v)["shard_id"] for v in rows.values()] == [again.shard_id]
    assert again.start == shards[0].start  # the given-back records are served first
    assert reopened(path)._datasets["ds"].ledger.held_by(9) == [again]
    svc.close()


def test_a_store_without_a_transaction_limit_gets_only_the_changed_rows(path: Path) -> None:
    store = SQLiteStateStore(str(path))
    svc = ShardingService(store, flush_seconds=3600)
    svc.create(DatasetSpec("ds", size=100_000, batch_size=10, records_per_shard=100))
    for h in range(150):  # more held shards than an etcd transaction could rewrite
        assert svc.get_shard("ds", holder=h, request_id=1).shard is not None
    assert len(store.scan(LEASE_TABLE)) == 150
    svc.restore_snapshot("ds", 0)  # gives back all 150 in one write
    assert "doing" not in json.loads(store.get(LEDGER_TABLE, "ds"))  # never the whole ledger
    assert store.scan(LEASE_TABLE) == {}
    held = svc.get_shard("ds", holder=7, request_id=2).shard
    assert "doing" not in json.loads(store.get(LEDGER_TABLE, "ds"))
    assert reopened(path)._datasets["ds"].ledger.held_by(7) == [held]
    svc.close()


# -- deferred commits, made durable from an event loop (the aio server) ----------------------


def test_deferred_grants_and_ends_are_stored_only_when_the_caller_commits(path: Path) -> None:
    svc = ShardingService(SQLiteStateStore(str(path)), flush_seconds=3600)
    svc.create(SPEC)
    with svc.deferred_commits() as pending:
        grant = svc.get_shard("ds", holder=7, request_id=1)
    assert grant.status == ShardStatus.SHARD
    assert len(pending) == 1
    assert reopened(path)._datasets["ds"].ledger.held_by(7) == []  # not stored yet
    entry, version = pending[0]
    svc.commit(entry, version)
    assert reopened(path)._datasets["ds"].ledger.held_by(7) == [grant.shard]
    # Outside the block, calls write as before.
    svc.report("ds", 7, [(grant.shard.shard_id, grant.shard.size)])
    assert reopened(path)._datasets["ds"].ledger.records_done == grant.shard.size
    svc.close()


def test_group_committer_stores_every_waiters_change_in_fewer_writes(path: Path) -> None:
    store = CountingStore(str(path))
    svc = ShardingService(store, flush_seconds=3600)
    svc.create(SPEC)
    committer = GroupCommitter(svc)
    store.gate = threading.Event()  # the first write waits while the other grants are made
    before = store.commits

    async def ask(holder: int) -> ShardGrant:
        with svc.deferred_commits() as pending:
            grant = svc.get_shard("ds", holder=holder, request_id=1)
        await committer.durable(pending)
        return grant

    async def main() -> list[ShardGrant]:
        first = asyncio.ensure_future(ask(1))
        await asyncio.sleep(0)  # the first ask starts its write, which waits at the gate
        await asyncio.get_running_loop().run_in_executor(None, store.writing.wait, 10)
        rest = [asyncio.ensure_future(ask(h)) for h in range(2, 11)]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in [first, *rest])  # nobody answered before its write
        store.gate.set()
        return await asyncio.gather(first, *rest)

    grants = asyncio.run(main())
    committer.close()
    # One write for the first grant, one for the nine made while it ran.
    assert store.commits - before == 2
    ledger = reopened(path)._datasets["ds"].ledger
    for holder, grant in enumerate(grants, start=1):
        assert ledger.held_by(holder) == [grant.shard]
    svc.close()


def test_a_failed_group_write_fails_its_waiters_and_the_next_write_stores_all(
    path: Path,
) -> None:
    store = CountingStore(str(path))
    svc = ShardingService(store, flush_seconds=3600)
    svc.create(SPEC)
    committer = GroupCommitter(svc)

    async def ask(holder: int) -> None:
        with svc.deferred_commits() as pending:
            svc.get_shard("ds", holder=holder, request_id=1)
        await committer.durable(pending)

    store.fail_next = 1
    with pytest.raises(StateStoreError, match="disk full"):
        asyncio.run(ask(1))
    assert reopened(path)._datasets["ds"].ledger.held_by(1) == []
    asyncio.run(ask(2))  # its write holds holder 1's grant too
    committer.close()
    ledger = reopened(path)._datasets["ds"].ledger
    assert len(ledger.held_by(1)) == 1 and len(ledger.held_by(2)) == 1
    svc.close()


def test_a_write_done_but_not_yet_forgotten_is_not_awaited_again(path: Path) -> None:
    # The write's done-callback (which forgets it) runs on a later loop turn; a waiter that
    # needs a newer version meanwhile must start the next write, not spin on the finished one.
    svc = ShardingService(SQLiteStateStore(str(path)), flush_seconds=3600)
    svc.create(SPEC)
    committer = GroupCommitter(svc)

    async def main() -> None:
        entry = svc._datasets["ds"]
        finished = asyncio.get_running_loop().create_future()
        finished.set_result(None)
        committer._writing[entry] = finished  # covered nothing of what follows
        with svc.deferred_commits() as pending:
            svc.get_shard("ds", holder=3, request_id=1)
        await committer.durable(pending)

    # In a thread: a coroutine that never yields cannot be timed out by its own loop.
    runner = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive(), "the waiter spins on the finished write"
    committer.close()
    assert len(reopened(path)._datasets["ds"].ledger.held_by(3)) == 1
    svc.close()


def _dataset_service(store: SQLiteStateStore) -> ShardingService:
    """A shard service on `store` with SPEC created, without a periodic flush."""
    svc = ShardingService(store, flush_seconds=3600)
    svc.create(SPEC)
    return svc


class TimedStore(SQLiteStateStore):
    """SQLite store that notes when each outermost write begins."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.starts: list[float] = []

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self.starts.append(time.monotonic())
            with super().transaction():
                yield


def _ask(svc: ShardingService, committer: GroupCommitter, holders: range) -> None:
    """Grants to `holders` made together, then awaited until stored (one write)."""

    async def main() -> None:
        with svc.deferred_commits() as pending:
            for holder in holders:
                svc.get_shard("ds", holder=holder, request_id=holder)
        await committer.durable(pending)

    asyncio.run(main())


def test_writes_of_a_busy_ledger_are_spaced_and_a_quiet_one_is_written_at_once(
    path: Path,
) -> None:
    store = TimedStore(str(path))
    svc = _dataset_service(store)
    spacing = 1.0
    committer = GroupCommitter(svc, spacing_seconds=spacing, space_after=4)
    # Writes that covered fewer than 4 changes: the next one is not held back.
    began = time.monotonic()
    for holder in range(0, 9, 3):
        _ask(svc, committer, range(holder, holder + 3))
    assert time.monotonic() - began < spacing
    assert len(store.starts) >= 3
    # A write that covered 4 changes: the next one starts a spacing after it began.
    _ask(svc, committer, range(10, 14))
    busy_start = store.starts[-1]
    _ask(svc, committer, range(20, 22))
    assert store.starts[-1] - busy_start >= spacing
    # That one covered 2 changes: the next is written at once again.
    began = time.monotonic()
    _ask(svc, committer, range(30, 31))
    assert time.monotonic() - began < spacing
    ledger = reopened(path)._datasets["ds"].ledger
    for holder in [*range(9), *range(10, 14), 20, 21, 30]:
        assert len(ledger.held_by(holder)) == 1, holder
    committer.close()
    svc.close()


def test_a_busy_ledgers_next_write_starts_once_as_many_changes_are_made_again(
    path: Path,
) -> None:
    store = TimedStore(str(path))
    svc = _dataset_service(store)
    spacing = 30.0  # never reached here: the count starts each write
    committer = GroupCommitter(svc, spacing_seconds=spacing, space_after=4)
    writes_before = len(store.starts)
    began = time.monotonic()
    for first in range(0, 40, 10):
        _ask(svc, committer, range(first, first + 5))  # 5 changes: busy, the next batch is 4
    assert time.monotonic() - began < spacing
    assert len(store.starts) - writes_before == 4
    ledger = reopened(path)._datasets["ds"].ledger
    for holder in [h for first in range(0, 40, 10) for h in range(first, first + 5)]:
        assert len(ledger.held_by(holder)) == 1, holder
    committer.close()
    svc.close()


def test_soon_stores_a_change_nobody_waits_for_and_those_made_while_a_write_ran(
    path: Path,
) -> None:
    store = CountingStore(str(path))
    svc = _dataset_service(store)  # no periodic flush to help
    committer = GroupCommitter(svc)
    store.gate = threading.Event()  # the first write waits while the second change is made

    async def main() -> None:
        with svc.deferred_commits() as pending:
            svc.get_shard("ds", holder=1, request_id=1)
        committer.soon(pending)
        await asyncio.get_running_loop().run_in_executor(None, store.writing.wait, 10)
        with svc.deferred_commits() as pending:
            svc.get_shard("ds", holder=2, request_id=1)
        committer.soon(pending)  # a write runs: this change needs the next one
        store.gate.set()
        entry, version = pending[0]
        deadline = time.monotonic() + 10
        while entry.durable < version and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    committer.close()
    ledger = reopened(path)._datasets["ds"].ledger
    assert len(ledger.held_by(1)) == 1 and len(ledger.held_by(2)) == 1
    svc.close()


def test_a_failed_write_that_nobody_waits_for_is_logged_and_the_next_one_stores_it(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CountingStore(str(path))
    svc = _dataset_service(store)
    committer = GroupCommitter(svc)
    store.fail_next = 1

    async def main() -> None:
        with svc.deferred_commits() as pending:
            svc.get_shard("ds", holder=1, request_id=1)
        committer.soon(pending)
        entry, _ = pending[0]
        deadline = time.monotonic() + 10
        while store.fail_next and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        while entry in committer._writing and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # until the failed write's callback has run
        assert reopened(path)._datasets["ds"].ledger.held_by(1) == []
        with svc.deferred_commits() as pending:
            svc.get_shard("ds", holder=2, request_id=1)
        await committer.durable(pending)  # its write holds holder 1's grant too

    with caplog.at_level(logging.WARNING, logger="master.sharding.group_commit"):
        asyncio.run(main())
    committer.close()
    assert "disk full" in caplog.text
    ledger = reopened(path)._datasets["ds"].ledger
    assert len(ledger.held_by(1)) == 1 and len(ledger.held_by(2)) == 1
    svc.close()
