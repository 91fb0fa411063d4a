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
        self.workers = [
            Node("worker", r, id=2 + r, state=NodeState.RUNNING, steps=5) for r in range(2)
        ]
        self.chief = Node("chief", 0, id=9, state=NodeState.RUNNING, steps=5)
        self.retired: list[int] = []
        self.events: list[tuple[str, str]] = []
        self.migrator = PSMigrator(
            self.kv,
            lambda t, r: {("ps", 0): self.ps, ("chief", 0): self.chief}.get((t, r)),
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


class ResizableJob(Job):
    """A job with a chief, whose cluster the migrator can stop and start for a PS count change."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 1
        self.started: list[int] = []
        self.migrator = PSMigrator(
            self.kv,
            lambda t, r: {("ps", 0): self.ps, ("chief", 0): self.chief}.get((t, r)),
            lambda: self.workers,
            lambda node: self.retired.append(node.id),
            lambda kind, message, *a, **k: self.events.append((kind, message)),
            stop_cluster=self._stop,
            start_cluster=self._start,
        )

    def _stop(self, ps_count: int) -> list[Node]:
        nodes = [self.ps, self.chief, *self.workers]
        self.retired.extend(n.id for n in nodes)
        return nodes

    def _start(self, ps_count: int) -> int:
        self.started.append(ps_count)
        self.version += 1
        return self.version


def _through_checkpoint(job: ResizableJob, step: bytes) -> None:
    job.migrator.advance()  # starts: workers asked to pause
    for w in job.workers:
        job.kv.set(pause_key(1, f"ack/{w.name}"), b"1")
    job.migrator.advance()  # every worker paused: checkpoint requested
    job.kv.set(checkpoint_request_key(1, "done"), step)
    job.migrator.advance()  # checkpoint made: the cluster is stopped


def test_a_ps_count_change_restarts_the_cluster_only_once_every_node_ended():
    from master.migration import ResizeResult

    job = ResizableJob()
    done = job.migrator.request_resize(2, current=1, reason="more ps")
    _through_checkpoint(job, b"300")
    assert sorted(job.retired) == [1, 2, 3, 9]
    assert job.started == []
    for node in (job.ps, job.workers[0], job.chief):
        node.state = NodeState.DELETED
        assert job.migrator.on_exit(node) is not None  # taken care of: not relaunched
    assert job.started == [] and not done.done()  # worker-1 still holds its port
    assert job.migrator.on_exit(Node("worker", 5, id=77)) is None  # not one it stopped
    job.workers[1].state = NodeState.DELETED
    job.migrator.on_exit(job.workers[1])
    assert job.started == [2]
    assert done.result(0) == ResizeResult(1, 2, 2, 300)
    assert job.kv.get(pause_key(1, "release"), 0) == b"1"
    assert [k for k, _ in job.events] == ["ps_resize", "ps_resized"]


@pytest.mark.parametrize(
    ("count", "current", "message"),
    [(0, 1, "in \\[1, 64\\]"), (65, 1, "in \\[1, 64\\]"), (2, 0, "no PS")],
)
def test_a_ps_count_change_refuses_bad_counts(count, current, message):
    with pytest.raises(ValueError, match=message):
        ResizableJob().migrator.request_resize(count, current, "")


def test_a_ps_count_change_needs_a_running_chief():
    job = ResizableJob()
    job.chief.state = NodeState.FAILED
    with pytest.raises(ValueError, match="running chief"):
        job.migrator.request_resize(2, 1, "")


def test_a_worker_still_starting_is_not_waited_for():
    job = Job()
    job.workers.append(Node("worker", 2, id=7, state=NodeState.RUNNING))  # no step yet
    job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="", replicas=1)
    job.migrator.advance()
    for w in job.workers[:2]:
        job.kv.set(pause_key(1, f"ack/{w.name}"), b"1")
    job.migrator.advance()
    assert job.kv.get(CHECKPOINT_REQUESTS_KEY, 0) == b"1"  # went ahead without worker-2


def test_training_that_ends_first_fails_the_migration_and_releases_everyone():
    job = Job()
    done = job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="", replicas=1)
    job.migrator.advance()
    job.chief.state = NodeState.SUCCEEDED
    job.migrator.advance()
    with pytest.raises(TimeoutError, match="training ended"):
        done.result(0)
    assert job.kv.get(pause_key(1, "release"), 0) == b"1"
    assert job.retired == []


def test_abort_fails_the_active_and_the_queued_migrations():
    job = Job()
    first = job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="", replicas=1)
    second = job.migrator.request("ps", 0, memory_mb=4096, cpu=0, reason="", replicas=1)
    job.migrator.advance()
    job.migrator.abort("the job stopped")
    for done in (first, second):
        with pytest.raises(Exception, match="the job stopped"):
            done.result(0)
