"""PS migration: move a PS to new CPU or memory while the job trains.

Protocol: ask the chief for a checkpoint at its next step (a request key in the master's KV
store, which `dlrover_tf.elastic_model_fn` watches) and wait for its report; stop the old PS;
start the new incarnation with the new resources at the same address (a local port, or a
Kubernetes headless service), so no node needs a new cluster spec; the chief's session fails,
it restores the checkpoint just made, the data position follows it, and workers resume.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from master.client import CHECKPOINT_REQUESTS_KEY, PAUSE_KEY, checkpoint_request_key, pause_key
from master.kv.store import KVStore
from master.nodes.model import Node, NodeState

# How long the chief may take to checkpoint before the migration gives up (nothing changed).
CHECKPOINT_TIMEOUT_SECONDS = 120.0
# How long workers get to reach a step boundary and pause; past it the checkpoint goes ahead
# (steps taken meanwhile are trained again after the restore, as without a pause).
PAUSE_TIMEOUT_SECONDS = 20.0
MIGRATABLE_TYPES = ("ps",)


@dataclass(frozen=True)
class MigrateResult:
    """The new incarnation and the checkpoint the model is restored from."""

    node_id: int
    checkpoint_step: int


@dataclass
class _Migration:
    node_type: str
    rank: int
    memory_mb: int
    cpu: float
    reason: str
    done: Future
    phase: str = "queued"  # queued -> pausing -> checkpoint -> stopping
    pause_number: int = 0
    pausing: tuple[str, ...] = ()  # the workers (TYPE-RANK) that must ack the pause
    deadline: float = 0.0
    request_number: int = 0
    checkpoint_step: int = 0
    old_id: int = 0
    extra: dict = field(default_factory=dict)


class PSMigrator:
    """Runs one migration at a time from the master's control loop (advance() every tick)."""

    def __init__(
        self,
        kv: KVStore,
        current: Callable[[str, int], Node | None],
        workers: Callable[[], list[Node]],
        retire_node: Callable[[Node], None],
        emit: Callable[..., None],
    ) -> None:
        self._kv = kv
        self._current = current
        self._workers = workers  # the running non-chief trainers, which pause
        self._retire_node = retire_node
        self._emit = emit
        self._requests: queue.SimpleQueue[_Migration] = queue.SimpleQueue()
        self._active: _Migration | None = None

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
        node = self._current(node_type, rank)
        if node is None or node.state != NodeState.RUNNING:
            raise ValueError(f"{node_type}-{rank} is not running; nothing to migrate")
        done: Future = Future()
        self._requests.put(_Migration(node_type, rank, memory_mb, cpu, reason, done))
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
        if m.phase == "pausing":
            acked = all(self._kv.check([pause_key(m.pause_number, f"ack/{w}")]) for w in m.pausing)
            if acked or time.monotonic() > m.deadline:
                if not acked:
                    self._emit(
                        "migration",
                        f"not every worker paused within {PAUSE_TIMEOUT_SECONDS:g}s; "
                        "checkpointing anyway",
                    )
                self._request_checkpoint(m)
            return
        if m.phase == "checkpoint":
            # The chief's answer to this very request: a checkpoint it made on its own schedule
            # may race with the request (and the chief may not be at a step boundary then).
            answer = self._kv.get(checkpoint_request_key(m.request_number, "done"), 0)
            if answer is not None:
                m.checkpoint_step = int(answer)
                self._stop_old(m)
            elif time.monotonic() > m.deadline:
                self._fail(
                    m,
                    f"the chief made no checkpoint within {CHECKPOINT_TIMEOUT_SECONDS:g}s; it "
                    "must run dlrover_tf.elastic_model_fn(model_fn) to checkpoint on request",
                )

    def on_exit(self, node: Node) -> _Migration | None:
        """The node ended: the migration replacing it, if one is (the caller starts the new one)."""
        m = self._active
        if m is None or m.phase != "stopping" or node.id != m.old_id:
            return None
        return m

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
        self._active = None

    def _start(self, m: _Migration) -> None:
        node = self._current(m.node_type, m.rank)
        if node is None or node.state != NodeState.RUNNING:
            self._fail(m, f"{m.node_type}-{m.rank} is not running any more")
            return
        # Workers stop at a step boundary first, so the checkpoint and the data position it is
        # saved with hold every step taken, and nothing is trained twice after the restore.
        m.phase = "pausing"
        m.deadline = time.monotonic() + PAUSE_TIMEOUT_SECONDS
        m.pausing = tuple(w.name for w in self._workers())
        m.pause_number = self._kv.add(PAUSE_KEY, 1)
        self._kv.set(pause_key(m.pause_number), (m.reason or "migration").encode())
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

    def _request_checkpoint(self, m: _Migration) -> None:
        m.phase = "checkpoint"
        m.deadline = time.monotonic() + CHECKPOINT_TIMEOUT_SECONDS
        m.request_number = self._kv.add(CHECKPOINT_REQUESTS_KEY, 1)
        self._kv.set(checkpoint_request_key(m.request_number), (m.reason or "migration").encode())

    def _release(self, m: _Migration) -> None:
        if m.pause_number:
            self._kv.set(pause_key(m.pause_number, "release"), b"1")
        if m.request_number:
            self._kv.set(checkpoint_request_key(m.request_number, "release"), b"1")

    def _stop_old(self, m: _Migration) -> None:
        node = self._current(m.node_type, m.rank)
        if node is None or node.state != NodeState.RUNNING:
            self._fail(m, f"{m.node_type}-{m.rank} ended during the migration")
            return
        m.phase = "stopping"
        m.old_id = node.id
        node.extra["migrating"] = True
        self._retire_node(node)

    def _fail(self, m: _Migration, reason: str) -> None:
        self._release(m)
        self._emit("migration_failed", f"migration of {m.node_type}-{m.rank}: {reason}")
        m.done.set_exception(TimeoutError(reason))
        self._active = None
