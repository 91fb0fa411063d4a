"""PS migration steps, driven by hand: checkpoint request, retirement, completion, refusals."""

from __future__ import annotations

import json
import time

import pytest

from master.client import CHECKPOINT_REQUESTS_KEY, checkpoint_request_key, pause_key
from master.job.migration import MigrateResult, MigrationFailedError, PSMigrator
from master.kv.store import KVStore
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
        self.saved: dict | None = None
        self.migrator = self.new_migrator()

    def new_migrator(self) -> PSMigrator:
        """A migrator as a (restarted) master builds it, saving its change in self.saved."""
        return PSMigrator(
            self.kv,
            lambda t, r: {("ps", 0): self.ps, ("chief", 0): self.chief}.get((t, r)),
            lambda: self.workers,
            lambda node: self.retired.append(node.id),
            lambda kind, message, *a, **k: self.events.append((kind, message)),
            **self.cluster_callbacks(),
            save=self.save,
        )

    def cluster_callbacks(self) -> dict:
        return {}

    def save(self, record: dict | None) -> None:
        self.saved = json.loads(json.dumps(record))  # as the state store keeps it


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


def test_the_migrator_names_the_answers_it_waits_for():
    """The master's loop advances a change at once when one of these keys is written."""
    job = Job()
    job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="hot", replicas=1)
    assert not job.migrator.awaits(pause_key(1, "ack/worker-0"))  # not started yet
    job.migrator.advance()
    assert job.migrator.awaits(pause_key(1, "ack/worker-0"))
    assert job.migrator.awaits(pause_key(1, "ack/worker-1"))
    assert not job.migrator.awaits(pause_key(1, "ack/worker-7"))  # not waited for
    assert not job.migrator.awaits(checkpoint_request_key(1, "done"))  # not asked yet
    for w in ("worker-0", "worker-1"):
        job.kv.set(pause_key(1, f"ack/{w}"), b"1")
    job.migrator.advance()
    assert job.migrator.awaits(checkpoint_request_key(1, "done"))
    assert not job.migrator.awaits(checkpoint_request_key(2, "done"))
    assert not job.migrator.awaits(pause_key(1, "ack/worker-0"))
    job.kv.set(checkpoint_request_key(1, "done"), b"740")
    job.migrator.advance()
    assert not job.migrator.awaits(checkpoint_request_key(1, "done"))  # stopping the old PS


def test_workers_that_do_not_pause_in_time_do_not_block_the_migration(monkeypatch):
    job = Job()
    job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="", replicas=1)
    job.migrator.advance()
    later = time.monotonic() + 1e6
    monkeypatch.setattr("master.job.migration.time.monotonic", lambda: later)
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
    monkeypatch.setattr("master.job.migration.time.monotonic", lambda: later)
    job.migrator.advance()
    with pytest.raises(MigrationFailedError, match="elastic_model_fn"):
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

    def cluster_callbacks(self) -> dict:
        return {"stop_cluster": self._stop, "start_cluster": self._start}

    def _stop(self, ps_count: int) -> list[Node]:
        nodes = [n for n in (self.ps, self.chief, *self.workers) if n.state == NodeState.RUNNING]
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
    from master.job.migration import ResizeResult

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
    with pytest.raises(MigrationFailedError, match="training ended"):
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


def test_a_restarted_master_carries_a_migration_on_from_its_saved_record():
    job = Job()
    first = job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="hot", replicas=1)
    job.migrator.advance()
    for w in job.workers:
        job.kv.set(pause_key(1, f"ack/{w.name}"), b"1")
    job.migrator.advance()
    assert job.saved["phase"] == "checkpoint" and job.saved["request_number"] == 1
    # The master dies; a new one restores the change (its KV store is durable too).
    job.migrator = job.new_migrator()
    job.migrator.restore(job.saved)
    assert job.migrator.settle() is None  # nothing cut short in the checkpoint phase
    # The client's retry of the same migrate call joins the restored change.
    retried = job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="hot", replicas=1)
    job.kv.set(checkpoint_request_key(1, "done"), b"640")
    job.migrator.advance()
    assert job.retired == [1] and job.saved["phase"] == "stopping"
    job.ps.state = NodeState.DELETED
    migration = job.migrator.on_exit(job.ps)
    job.migrator.finished(migration, Node("ps", 0, id=5, state=NodeState.RUNNING))
    assert retried.result(0) == MigrateResult(node_id=5, checkpoint_step=640)
    assert job.saved is None
    assert not first.done()  # that caller's master is gone; its client retried


def test_a_restarted_master_stops_again_what_a_cut_short_count_change_left_running():
    job = ResizableJob()
    job.migrator.request_resize(2, current=1, reason="")
    _through_checkpoint(job, b"300")
    record = job.saved
    assert record["phase"] == "stopping" and record["stopping"] == [1, 2, 3, 9]
    # The master died as it began stopping: worker-1 got no signal and still runs.
    job.retired.clear()
    for node in (job.ps, job.chief, job.workers[0]):
        node.state = NodeState.DELETED
    job.migrator = job.new_migrator()
    job.migrator.restore(record)
    job.migrator.settle()
    assert job.retired == [3] and job.started == []  # the stop is redone for what runs
    job.workers[1].state = NodeState.DELETED
    job.migrator.on_exit(job.workers[1])
    assert job.started == [2] and job.saved is None


def test_a_restarted_master_starts_again_a_cut_short_count_change():
    job = ResizableJob()
    job.migrator.request_resize(2, current=1, reason="")
    _through_checkpoint(job, b"300")
    for node in (job.ps, job.chief, *job.workers):
        node.state = NodeState.DELETED
        job.migrator.on_exit(node)
    assert job.started == [2]
    # Suppose it died while starting: the record still said "starting".
    job.saved = _starting_record()
    job.migrator = job.new_migrator()
    job.migrator.restore(job.saved)
    job.migrator.settle()
    assert job.started == [2, 2]  # started again (the master starts only what does not run)
    assert job.saved is None


def _starting_record() -> dict:
    from master.job.migration import _Migration

    m = _Migration("ps", 0, 0, 0.0, "", None, phase="starting", ps_count=2, previous_count=1)
    m.checkpoint_step = 300
    return m.record()


def test_a_chief_that_takes_no_step_gets_the_paused_workers_released(monkeypatch):
    import master.job.migration

    monkeypatch.setattr(master.job.migration, "CHIEF_STEP_WAIT_SECONDS", 0.0)
    job = Job()
    done = job.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="", replicas=1)
    job.migrator.advance()
    for w in job.workers:
        job.kv.set(pause_key(1, f"ack/{w.name}"), b"1")
    job.migrator.advance()  # checkpoint requested
    assert job.kv.get(pause_key(1, "release"), 0) is None
    time.sleep(0.01)
    job.migrator.advance()  # no answer yet: the workers go on, so the chief gets data
    assert job.kv.get(pause_key(1, "release"), 0) == b"1"
    assert job.kv.get(checkpoint_request_key(1, "release"), 0) is None  # the chief still waits
    job.kv.set(checkpoint_request_key(1, "done"), b"800")
    job.migrator.advance()
    assert job.retired == [1] and not done.done()


def test_a_retry_just_after_a_change_completed_gets_that_change_not_a_new_one(monkeypatch):
    """The retried call of a client whose answer died with a master can reach the restarted
    master just after it completed the change: it gets that change's answer, not a no-op
    (ps 2 -> 2) or a second move; later, the same request is a new one."""
    from master.job import migration
    from master.job.migration import ResizeResult

    job = ResizableJob()
    done = job.migrator.request_resize(2, current=1, reason="more ps")
    _through_checkpoint(job, b"300")
    for node in (job.ps, job.chief, *job.workers):
        node.state = NodeState.DELETED
        job.migrator.on_exit(node)
    assert done.result(0) == ResizeResult(1, 2, 2, 300)
    retried = job.migrator.request_resize(2, current=2, reason="more ps")
    assert retried.result(0) == ResizeResult(1, 2, 2, 300)
    assert job.started == [2]  # nothing started again

    moved = Job()
    first = moved.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="hot", replicas=1)
    moved.migrator.advance()
    for w in moved.workers:
        moved.kv.set(pause_key(1, f"ack/{w.name}"), b"1")
    moved.migrator.advance()
    moved.kv.set(checkpoint_request_key(1, "done"), b"740")
    moved.migrator.advance()
    new = Node("ps", 0, id=5, state=NodeState.RUNNING, memory_mb=2048)
    moved.migrator.finished(moved.migrator.on_exit(moved.ps), new)
    moved.ps = new
    again = moved.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="hot", replicas=1)
    assert again.result(0) == first.result(0) == MigrateResult(node_id=5, checkpoint_step=740)
    assert moved.retired == [1]  # the new PS is not moved again

    monkeypatch.setattr(migration, "RETRY_WINDOW_SECONDS", -1.0)  # the window has passed
    later = moved.migrator.request("ps", 0, memory_mb=2048, cpu=0, reason="hot", replicas=1)
    assert not later.done()  # a new move, queued
    moved.migrator.advance()
    assert moved.kv.get(pause_key(2), 0) == b"hot"
