"""PS set changes while the job trains: move a PS to new CPU or memory, or change the PS count.

Both start alike: workers pause at a step boundary, then the chief checkpoints at its next step
(request keys in the master's KV store, which `dlrover_tf.elastic_model_fn` watches) and reports.

- Move: stop the old PS and start the new incarnation with the new resources at the same
  address (a local port, or a Kubernetes headless service), so no node needs a new cluster spec;
  the chief's session fails, it restores the checkpoint just made, the data position follows
  it, and workers resume.
- Count change: the cluster spec changes, and a TF1 server cannot join a new cluster in
  process, so every PS, the chief and the workers are stopped at that step boundary and started
  again with the new `TF_CONFIG` (a bumped cluster version). The chief restores the checkpoint,
  re-partitioned over the new PS set by TF's saver, and the data position follows it.
"""

from __future__ import annotations

import dataclasses
import enum
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from master.client import CHECKPOINT_REQUESTS_KEY, PAUSE_KEY, checkpoint_request_key, pause_key
from master.job.recovery_timeline import RecoveryPhase
from master.kv.store import KVStore
from master.nodes.model import Node, NodeState

# How long the chief may take to checkpoint before the migration gives up (nothing changed).
CHECKPOINT_TIMEOUT_SECONDS = 120.0
# How long workers get to reach a step boundary and pause; past it the checkpoint goes ahead
# (steps taken meanwhile are trained again after the restore, as without a pause).
PAUSE_TIMEOUT_SECONDS = 20.0
# The chief checkpoints at its next step; if it takes none this long, it may be waiting for
# data the paused workers hold (at the end of an epoch): they go on, so the chief gets data.
# Their steps meanwhile are in the checkpoint, so nothing is lost; only the one batch in
# flight per worker is no longer exact.
CHIEF_STEP_WAIT_SECONDS = 5.0
# A retried call (its first answer died with a master) may reach the restarted master just after
# it completed the change: within this long, the retry gets that change's result.
RETRY_WINDOW_SECONDS = 60.0
MIGRATABLE_TYPES = ("ps",)
# The nodes a PS count change restarts: those whose TF_CONFIG holds the PS list.
CLUSTER_TYPES = ("ps", "chief", "worker")
MAX_PS = 64


class MigrationPhase(str, enum.Enum):
    """Where a PS change stands. queued -> pausing (workers stop at a step boundary) ->
    checkpoint (the chief saves on request) -> stopping (the old PS, or for a count change the
    whole cluster) -> done; a count change goes stopping -> starting (the new cluster) -> done.
    A failure at any phase ends the change with nothing changed past what was stopped."""

    QUEUED = "queued"
    PAUSING = "pausing"
    CHECKPOINT = "checkpoint"
    STOPPING = "stopping"
    STARTING = "starting"


class MigrationFailedError(RuntimeError):
    """A PS migration or PS count change ended without being applied; the message says why."""


@dataclass(frozen=True)
class MigrateResult:
    """The new incarnation and the checkpoint the model is restored from."""

    node_id: int
    checkpoint_step: int


@dataclass(frozen=True)
class ResizeResult:
    """A PS count change applied: the cluster version the nodes were restarted with."""

    previous: int
    ps_count: int
    cluster_version: int
    checkpoint_step: int


@dataclass
class _Migration:
    node_type: str
    rank: int
    memory_mb: int
    cpu: float
    reason: str
    done: Future
    phase: MigrationPhase = MigrationPhase.QUEUED
    pause_number: int = 0
    pausing: tuple[str, ...] = ()  # the workers (TYPE-RANK) that must ack the pause
    deadline: float = 0.0
    request_number: int = 0
    checkpoint_step: int = 0
    old_id: int = 0
    pause_released: bool = False
    ps_count: int = 0  # a count change to this many PS (0: a move of one PS)
    previous_count: int = 0
    stopping: set[int] = field(default_factory=set)  # ids a count change waits to see end

    def record(self) -> dict:
        """What a restarted master needs to carry the change on (no future, no deadline)."""
        fields = dataclasses.asdict(
            dataclasses.replace(self, done=None, stopping=sorted(self.stopping))
        )
        del fields["done"], fields["deadline"]
        return fields


class PSMigrator:
    """Runs one migration at a time from the master's control loop (advance() every tick)."""

    def __init__(
        self,
        kv: KVStore,
        current: Callable[[str, int], Node | None],
        workers: Callable[[], list[Node]],
        retire_node: Callable[[Node], None],
        emit: Callable[..., None],
        stop_cluster: Callable[[int], list[Node]] | None = None,
        start_cluster: Callable[[int], int] | None = None,
        save: Callable[[dict | None], None] | None = None,
        on_phase: Callable[[RecoveryPhase], None] | None = None,
    ) -> None:
        self._kv = kv
        self._current = current
        self._workers = workers  # the running non-chief trainers, which pause
        self._retire_node = retire_node
        self._emit = emit
        self._stop_cluster = stop_cluster  # (new PS count) -> the nodes being stopped
        self._start_cluster = start_cluster  # (new PS count) -> the new cluster version
        self._save = save  # writes the active change's record (None: no change active)
        self._on_phase = on_phase or (lambda phase: None)  # a move's phases, for its timeline
        self._requests: queue.SimpleQueue[_Migration] = queue.SimpleQueue()
        self._active: _Migration | None = None
        self._completed: dict[tuple, tuple[float, Future]] = {}  # change -> (when, its answer)

    def request(
        self, node_type: str, rank: int, memory_mb: int, cpu: float, reason: str, replicas: int
    ) -> Future:
        """Queue a migration; the future ends with a MigrateResult or the reason it failed."""
        if node_type not in MIGRATABLE_TYPES:
            raise ValueError(
                f"cannot migrate {node_type!r} nodes; migratable: {', '.join(MIGRATABLE_TYPES)} "
                "(workers are scaled instead: dlrover scale worker=N)"
            )
        if not 0 <= rank < replicas:
            raise ValueError(f"{node_type}-{rank} does not exist (the job has {replicas})")
        if memory_mb < 0 or cpu < 0:
            raise ValueError(f"memory_mb and cpu must be >= 0, got {memory_mb} and {cpu}")
        if memory_mb == 0 and cpu == 0:
            raise ValueError("give --memory-mb or --cpu: a migration moves a node to new resources")
        same = self._same_as_active(node_type, rank, memory_mb, cpu)
        if same is None:
            same = self._just_completed(("move", node_type, rank, memory_mb, cpu))
        if same is not None:
            return same  # a retry (the first answer died with a master): the same change
        node = self._current(node_type, rank)
        if node is None or node.state != NodeState.RUNNING:
            raise ValueError(f"{node_type}-{rank} is not running; nothing to migrate")
        done: Future = Future()
        self._requests.put(_Migration(node_type, rank, memory_mb, cpu, reason, done))
        return done

    def request_resize(self, ps_count: int, current: int, reason: str) -> Future:
        """Queue a PS count change; the future ends with a ResizeResult or why it failed."""
        if self._stop_cluster is None or self._start_cluster is None:
            raise ValueError("this master cannot change the PS count")
        if current == 0:
            raise ValueError("the job has no PS: it does not run in parameter-server mode")
        if not 1 <= ps_count <= MAX_PS:
            raise ValueError(f"ps replicas must be in [1, {MAX_PS}], got {ps_count}")
        m = self._active
        if m is not None and m.ps_count == ps_count:
            return m.done  # a retry (the first answer died with a master): the same change
        done = self._just_completed(("resize", ps_count))
        if done is not None:
            return done  # the same, just completed
        chief = self._current("chief", 0)
        if chief is None or chief.state != NodeState.RUNNING:
            raise ValueError(
                "changing the PS count needs a running chief to checkpoint the model first"
            )
        done: Future = Future()
        self._requests.put(
            _Migration("ps", 0, 0, 0.0, reason, done, ps_count=ps_count, previous_count=current)
        )
        return done

    def advance(self) -> None:
        """Move the active migration on (or start the next one)."""
        m = self._active
        if m is None:
            try:
                m = self._active = self._requests.get_nowait()
            except queue.Empty:
                return
            self._start(m)
            return
        if m.phase in (MigrationPhase.PAUSING, MigrationPhase.CHECKPOINT):
            chief = self._current("chief", 0)
            if chief is None or chief.state == NodeState.SUCCEEDED:
                self._fail(
                    m, "training ended before the chief made the checkpoint; nothing changed"
                )
                return
        if m.phase == MigrationPhase.PAUSING:
            acked = all(self._kv.check([pause_key(m.pause_number, f"ack/{w}")]) for w in m.pausing)
            if acked or time.monotonic() > m.deadline:
                self._on_phase(RecoveryPhase.PAUSED)
                if not acked:
                    self._emit(
                        "migration",
                        f"not every worker paused within {PAUSE_TIMEOUT_SECONDS:g}s; "
                        "checkpointing anyway",
                    )
                self._request_checkpoint(m)
            return
        if m.phase == MigrationPhase.CHECKPOINT:
            # The chief's answer to this very request: a checkpoint it made on its own schedule
            # may race with the request (and the chief may not be at a step boundary then).
            answer = self._kv.get(checkpoint_request_key(m.request_number, "done"), 0)
            waited = CHECKPOINT_TIMEOUT_SECONDS - (m.deadline - time.monotonic())
            if answer is None and waited > CHIEF_STEP_WAIT_SECONDS and not m.pause_released:
                self._emit(
                    "migration",
                    f"the chief took no step in {CHIEF_STEP_WAIT_SECONDS:g}s (it may wait for "
                    "data the paused workers hold): workers go on until it checkpoints",
                )
                self._release_pause(m)
            if answer is not None:
                m.checkpoint_step = int(answer)
                self._on_phase(RecoveryPhase.CHECKPOINTED)
                if m.ps_count:
                    self._stop_for_resize(m)
                else:
                    self._stop_old(m)
            elif time.monotonic() > m.deadline:
                self._fail(
                    m,
                    f"the chief made no checkpoint within {CHECKPOINT_TIMEOUT_SECONDS:g}s; it "
                    "must run dlrover_tf.elastic_model_fn(model_fn) to checkpoint on request",
                )

    def on_exit(self, node: Node) -> _Migration | None:
        """The node ended: the migration replacing it, if one is (the caller starts the new one).
        A node a count change stopped is taken care of here (its start waits for all of them)."""
        m = self._active
        if m is None or m.phase != MigrationPhase.STOPPING:
            return None
        if m.ps_count:
            if node.id not in m.stopping:
                return None
            m.stopping.discard(node.id)
            if not m.stopping:
                self._finish_resize(m)
            return m
        if node.id != m.old_id:
            return None
        self._on_phase(RecoveryPhase.DETECTED)
        return m

    def claims(self, node: Node) -> bool:
        """Whether `node`'s end belongs to the active change: the PS being moved, or a node a
        count change stopped (on_exit then takes it). Changes nothing."""
        m = self._active
        if m is None or m.phase != MigrationPhase.STOPPING:
            return False
        return node.id in m.stopping if m.ps_count else node.id == m.old_id

    def awaits(self, key: bytes) -> bool:
        """Whether `key` is an answer the active change waits for (a worker's pause ack, the
        chief's checkpoint): the master's loop then advances it at once, not at its next tick."""
        m = self._active
        if m is None:
            return False
        if m.phase == MigrationPhase.PAUSING:
            return any(key == pause_key(m.pause_number, f"ack/{w}") for w in m.pausing)
        return m.phase == MigrationPhase.CHECKPOINT and key == checkpoint_request_key(
            m.request_number, "done"
        )

    @property
    def active(self) -> _Migration | None:
        return self._active

    def restore(self, record: dict) -> _Migration:
        """A restarted master carries on the change its predecessor saved (the caller then
        settles a phase that was cut short; see master.job.ps_change.PSChanges.resume)."""
        m = _Migration(
            **{
                **record,
                "done": Future(),
                "stopping": set(record["stopping"]),
                "phase": MigrationPhase(record["phase"]),
            }
        )
        m.pausing = tuple(m.pausing)
        m.deadline = time.monotonic() + (
            PAUSE_TIMEOUT_SECONDS
            if m.phase == MigrationPhase.PAUSING
            else CHECKPOINT_TIMEOUT_SECONDS
        )
        self._active = m
        self._emit(
            "migration",
            f"carrying on the PS change the previous master began (phase {m.phase.value})",
            phase=m.phase.value,
        )
        return m

    def settle(self) -> _Migration | None:
        """After restore(): redo a stopping or starting phase the previous master may have cut
        short (both are idempotent). Returns a move whose old PS ended with no new one yet."""
        m = self._active
        if m is None or m.phase not in (MigrationPhase.STOPPING, MigrationPhase.STARTING):
            return None
        if m.ps_count:
            if m.phase == MigrationPhase.STARTING:
                self._finish_resize(m)
            else:
                self._stop_for_resize(m)
            return None
        node = self._current(m.node_type, m.rank)
        if node is None:
            self._fail(m, f"{m.node_type}-{m.rank} is unknown to the restarted master")
        elif node.id != m.old_id:
            self.finished(m, node)  # the new one was launched before the master died
        elif node.state.ended:
            return m  # the caller launches the new one
        else:
            self._retire_node(node)
        return None

    def _just_completed(self, change: tuple) -> Future | None:
        """The answer of `change` if it completed within RETRY_WINDOW_SECONDS."""
        now = time.monotonic()
        self._completed = {
            c: (at, done)
            for c, (at, done) in self._completed.items()
            if now - at <= RETRY_WINDOW_SECONDS
        }
        completed = self._completed.get(change)
        return completed[1] if completed is not None else None

    def _same_as_active(self, node_type: str, rank: int, memory_mb: int, cpu: float):
        m = self._active
        if m is None or m.ps_count:
            return None
        if (m.node_type, m.rank, m.memory_mb, m.cpu) == (node_type, rank, memory_mb, cpu):
            return m.done
        return None

    def _persist(self, m: _Migration | None) -> None:
        if self._save is not None:
            self._save(m.record() if m is not None else None)

    def abort(self, reason: str) -> None:
        """Fail the active migration and every queued one (the job or its chief ended)."""
        if self._active is not None:
            self._fail(self._active, reason)
        while True:
            try:
                m = self._requests.get_nowait()
            except queue.Empty:
                return
            m.done.set_exception(MigrationFailedError(reason))

    def finished(self, m: _Migration, new: Node) -> None:
        """The new incarnation runs: the migration is complete."""
        self._emit(
            "migrated",
            f"{m.node_type}-{m.rank} moved: now id {new.id} with {new.memory_mb} MB"
            + (f", {m.cpu:g} CPU" if m.cpu else "")
            + f"; restoring the checkpoint of step {m.checkpoint_step}",
            new,
            reason=m.reason,
            checkpoint_step=m.checkpoint_step,
        )
        self._release(m)
        m.done.set_result(MigrateResult(new.id, m.checkpoint_step))
        self._completed[("move", m.node_type, m.rank, m.memory_mb, m.cpu)] = (
            time.monotonic(),
            m.done,
        )
        self._active = None
        self._persist(None)

    def _start(self, m: _Migration) -> None:
        if m.ps_count:
            self._start_resize(m)
            return
        node = self._current(m.node_type, m.rank)
        if node is None or node.state != NodeState.RUNNING:
            self._fail(m, f"{m.node_type}-{m.rank} is not running any more")
            return
        # Workers stop at a step boundary first, so the checkpoint and the data position it is
        # saved with hold every step taken, and nothing is trained twice after the restore.
        self._pause_workers(m)
        self._persist(m)
        self._emit(
            "migration",
            f"moving {m.node_type}-{m.rank} to "
            + ", ".join(
                part
                for part in (
                    f"{m.memory_mb} MB" if m.memory_mb else "",
                    f"{m.cpu:g} CPU" if m.cpu else "",
                )
                if part
            )
            + (f" ({m.reason})" if m.reason else "")
            + ": pausing the workers, then a checkpoint on the chief",
            node,
            reason=m.reason,
        )

    def _pause_workers(self, m: _Migration) -> None:
        m.phase = MigrationPhase.PAUSING
        m.deadline = time.monotonic() + PAUSE_TIMEOUT_SECONDS
        # Only workers already stepping can ack; one still starting pauses at its first step
        # (its hook sees the pause in force) but is not waited for.
        m.pausing = tuple(w.name for w in self._workers() if w.steps > 0)
        m.pause_number = self._kv.add(PAUSE_KEY, 1)
        self._kv.set(pause_key(m.pause_number), (m.reason or "migration").encode())

    def _start_resize(self, m: _Migration) -> None:
        previous = m.previous_count
        chief = self._current("chief", 0)
        if chief is None or chief.state != NodeState.RUNNING:
            self._fail(m, "the chief is not running any more")
            return
        if m.ps_count == previous:
            m.done.set_result(ResizeResult(previous, previous, -1, -1))
            self._active = None
            return
        self._pause_workers(m)
        self._persist(m)
        self._emit(
            "ps_resize",
            f"ps {previous} -> {m.ps_count}"
            + (f" ({m.reason})" if m.reason else "")
            + ": pausing the workers, then a checkpoint on the chief; then PS, chief and "
            "workers restart with the new cluster spec",
            reason=m.reason,
            previous=previous,
            ps_count=m.ps_count,
        )

    def _stop_for_resize(self, m: _Migration) -> None:
        m.phase = MigrationPhase.STOPPING
        self._persist(m)  # a restarted master stops (again) whatever still runs
        # The set is filled before any node is stopped: a platform that cannot signal reports
        # the exit at once, re-entering on_exit.
        stopping = self._stop_cluster(m.ps_count)
        m.stopping = {n.id for n in stopping if not n.state.ended}
        self._persist(m)
        if not m.stopping:
            self._finish_resize(m)

    def _finish_resize(self, m: _Migration) -> None:
        previous = m.previous_count
        m.phase = MigrationPhase.STARTING
        self._persist(m)  # a restarted master starts (again) whatever is not running
        version = self._start_cluster(m.ps_count)
        self._emit(
            "ps_resized",
            f"ps {previous} -> {m.ps_count}: cluster version {version}; restoring the "
            f"checkpoint of step {m.checkpoint_step}, re-partitioned over {m.ps_count} PS",
            reason=m.reason,
            previous=previous,
            ps_count=m.ps_count,
            cluster_version=version,
            checkpoint_step=m.checkpoint_step,
        )
        self._release(m)
        m.done.set_result(ResizeResult(previous, m.ps_count, version, m.checkpoint_step))
        self._completed[("resize", m.ps_count)] = (time.monotonic(), m.done)
        self._active = None
        self._persist(None)

    def _request_checkpoint(self, m: _Migration) -> None:
        m.phase = MigrationPhase.CHECKPOINT
        m.deadline = time.monotonic() + CHECKPOINT_TIMEOUT_SECONDS
        m.request_number = self._kv.add(CHECKPOINT_REQUESTS_KEY, 1)
        self._persist(m)
        self._kv.set(checkpoint_request_key(m.request_number), (m.reason or "migration").encode())

    def _release_pause(self, m: _Migration) -> None:
        m.pause_released = True
        if m.pause_number:
            self._kv.set(pause_key(m.pause_number, "release"), b"1")

    def _release(self, m: _Migration) -> None:
        self._release_pause(m)
        if m.request_number:
            self._kv.set(checkpoint_request_key(m.request_number, "release"), b"1")

    def _stop_old(self, m: _Migration) -> None:
        node = self._current(m.node_type, m.rank)
        if node is None or node.state != NodeState.RUNNING:
            self._fail(m, f"{m.node_type}-{m.rank} ended during the migration")
            return
        m.phase = MigrationPhase.STOPPING
        m.old_id = node.id
        self._persist(m)
        self._retire_node(node)

    def _fail(self, m: _Migration, reason: str) -> None:
        self._release(m)
        self._emit("migration_failed", f"migration of {m.node_type}-{m.rank}: {reason}")
        m.done.set_exception(MigrationFailedError(reason))
        self._active = None
        self._persist(None)
