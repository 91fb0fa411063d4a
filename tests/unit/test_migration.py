"""PS migration steps, driven by hand: checkpoint request, retirement, completion, refusals."""

from __future__ import annotations

import time

import pytest

from master.client import CHECKPOINT_REQUESTS_KEY, checkpoint_request_key, pause_key
from master.kv.store import KVStore
from master.migration import MigrateResult, PSMigrator
from master.nodes.model import Node, NodeState
from master.state.sqlite import SQLiteStateStore


class Job:
    """The parts of a job master the migrator uses, with behaviour."""

    def __init__(self) -> None:
        self.kv = KVStore(SQLiteStateStore(":memory:"))
        self.ps = Node("ps", 0, id=1, state=NodeState.RUNNING, memory_mb=512)
        self.workers = [Node("worker", r, id=2 + r, state=NodeState.RUNNING) for r in range(2)]
        self.retired: list[int] = []
        self.events: list[tuple[str, str]] = []
        self.migrator = PSMigrator(
            self.kv,
            lambda t, r: self.ps if (t, r) == ("ps", 0) else None,
            lambda: self.workers,
            lambda node: self.retired.append(node.id),
            lambda kind, message, *a, **k: self.events.append((kind, message)),
        )


def test_a_migration_pauses_workers_checkpoints_retires_the_old_ps_then_completes():
    job = Job()
    done = job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="hot", replicas=1)
    job.migrator.advance()
    assert job.kv.get(pause_key(1), 0) == b"hot"  # workers asked to pause
    job.kv.set(pause_key(1, "ack/worker-0"), b"1")
    job.migrator.advance()
    assert job.kv.get(CHECKPOINT_REQUESTS_KEY, 0) is None  # worker-1 has not paused yet
    job.kv.set(pause_key(1, "ack/worker-1"), b"1")
    job.migrator.advance()
    # The chief's watcher sees request 1 in the KV store.
    assert job.kv.get(CHECKPOINT_REQUESTS_KEY, 0) == b"1"
    assert job.kv.get(checkpoint_request_key(1), 0) == b"hot"
    job.migrator.advance()
    assert job.retired == []  # no answer from the chief yet: the PS stays
    job.kv.set(checkpoint_request_key(2, "done"), b"999")  # another request's answer
    job.migrator.advance()
    assert job.retired == []
    job.kv.set(checkpoint_request_key(1, "done"), b"740")  # the chief saved on request
    job.migrator.advance()
    assert job.retired == [1]
    migration = job.migrator.on_exit(job.ps)
    assert migration is not None and migration.memory_mb == 2048
    new = Node("ps", 0, id=5, state=NodeState.RUNNING, memory_mb=2048)
    job.migrator.finished(migration, new)
    assert done.result(0) == MigrateResult(node_id=5, checkpoint_step=740)
    assert job.kv.get(pause_key(1, "release"), 0) == b"1"  # workers go on
    assert job.kv.get(checkpoint_request_key(1, "release"), 0) == b"1"  # and the chief
    assert [k for k, _ in job.events] == ["migration", "migrated"]
    assert job.migrator.on_exit(new) is None  # nothing in progress any more


def test_workers_that_do_not_pause_in_time_do_not_block_the_migration(monkeypatch):
    job = Job()
    job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="", replicas=1)
    job.migrator.advance()
    later = time.monotonic() + 1e6
    monkeypatch.setattr("master.migration.time.monotonic", lambda: later)
    job.migrator.advance()
    assert job.kv.get(CHECKPOINT_REQUESTS_KEY, 0) == b"1"  # went ahead without the acks
    assert "not every worker paused" in job.events[-1][1]


def test_an_unrelated_exit_is_not_taken_for_the_migrated_node():
    job = Job()
    job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="", replicas=1)
    job.migrator.advance()
    assert job.migrator.on_exit(job.ps) is None  # still checkpointing: a real failure


def test_no_checkpoint_in_time_fails_the_migration_and_touches_nothing(monkeypatch):
    job = Job()
    done = job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="", replicas=1)
    job.migrator.advance()
    for w in job.workers:
        job.kv.set(pause_key(1, f"ack/{w.name}"), b"1")
    job.migrator.advance()  # paused: the checkpoint is requested
    later = time.monotonic() + 1e6
    monkeypatch.setattr("master.migration.time.monotonic", lambda: later)
    job.migrator.advance()
    with pytest.raises(TimeoutError, match="elastic_model_fn"):
        done.result(0)
    assert job.retired == [] and job.events[-1][0] == "migration_failed"
    assert job.kv.get(pause_key(1, "release"), 0) == b"1"  # the paused workers go on


@pytest.mark.parametrize(
    "args, message",
    [
        (("worker", 0, 2048, 0), "cannot migrate 'worker'"),
        (("ps", 3, 2048, 0), "ps-3 does not exist"),
        (("ps", 0, 0, 0), "give --memory-mb or --cpu"),
        (("ps", 0, -1, 0), "must be >= 0"),
    ],
)
def test_bad_requests_are_refused_with_the_fix(args, message):
    job = Job()
    with pytest.raises(ValueError, match=message):
        job.migrator.request(*args, reason="", replicas=1)


def test_a_ps_that_is_not_running_cannot_be_migrated():
    job = Job()
    job.ps.state = NodeState.FAILED
    with pytest.raises(ValueError, match="ps-0 is not running"):
        job.migrator.request("ps", 0, 2048, 0, reason="", replicas=1)
