"""Node registry: incarnations, registration, heartbeats and pending commands."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import defaultdict

from master.nodes.model import ExitReason, GpuStat, Node, NodeState
from master.pb import nodes_pb2
from master.state.api import StateStore

NODE_TABLE = "nodes"
# The rank a standby node (a spare process waiting to replace a rank) talks to the master with.
STANDBY_RANK = -1
# A node's step time is the median over its last STEP_SAMPLES_KEPT step reports of each
# report's time per step (a median of reports, not of steps: a pause of the whole machine or a
# wait for shards falls into one report, even one that covers many coalesced steps, and so does
# not make a straggler), recomputed every STEP_TIME_EVERY reports (the samples kept:
# master.nodes.model.STEP_SAMPLES_KEPT).
STEP_TIME_EVERY = 8


def step_time_samples(node: Node) -> int:
    """How many timed step reports the node's step time rests on."""
    return len(node.step_samples)


class StaleNodeError(Exception):
    """A request from a node incarnation the master does not (or no longer) run."""


class MasterResumingError(Exception):
    """A restarted master has not restored its nodes yet: the request is to be retried."""


class NodeManager:
    """Keeps every node incarnation; the current one per (type, rank) is the only one accepted."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._lock = threading.RLock()
        self._by_id: dict[int, Node] = {}
        self._current: dict[tuple[str, int], int] = {}
        self._commands: dict[int, list[nodes_pb2.Command]] = defaultdict(list)
        self._next_id = 1
        self._standby_ids: set[int] = set()  # ids handed to standby processes
        self._step_clocks_from = 0.0  # a report whose gap began before this is not timed

    def reserve_standby_id(self) -> int:
        """An id for a standby process of any type: it may call the master as rank
        STANDBY_RANK, and becomes a node incarnation only when promoted."""
        with self._lock:
            node_id = self._next_id
            self._next_id += 1
            self._standby_ids.add(node_id)
            return node_id

    def allow_standby_id(self, node_id: int) -> None:
        """Accept calls from standby `node_id` (a restarted master, so it can retire it)."""
        with self._lock:
            self._standby_ids.add(node_id)

    def skip_ids_below(self, node_id: int) -> None:
        """Never hand out an id below node_id (a restarted master learns of a standby's id)."""
        with self._lock:
            self._next_id = max(self._next_id, node_id)

    def promote_standby(
        self, node_id: int, node_type: str, rank: int, relaunches: int, memory_mb: int
    ) -> Node:
        """The standby `node_id` becomes the current incarnation of (type, rank)."""
        with self._lock:
            if node_id not in self._standby_ids or node_id in self._by_id:
                raise ValueError(f"id {node_id} is not a waiting standby")
            return self._new(node_type, rank, relaunches, memory_mb, node_id)

    def restore(self) -> list[Node]:
        """Load every incarnation a previous master recorded; returns the current ones."""
        with self._lock:
            for raw in self._store.scan(NODE_TABLE).values():
                node = Node.from_record(json.loads(raw))
                now = time.monotonic()
                # Give every live node a full timeout to reach the new master.
                node.last_heartbeat = node.last_progress = now
                self._by_id[node.id] = node
                key = (node.type, node.rank)
                if node.id > self._current.get(key, 0):
                    self._current[key] = node.id
                self._next_id = max(self._next_id, node.id + 1)
            return [self._by_id[i] for i in self._current.values()]

    def restart_liveness_clocks(self) -> None:
        """Every live node's heartbeat and progress clocks start now: a restarted master calls
        this once it has adopted them, so adoption's time (seconds on a loaded Ray cluster)
        does not count against the nodes' first beat to it."""
        now = time.monotonic()
        with self._lock:
            for node_id in self._current.values():
                node = self._by_id[node_id]
                if not node.state.ended:
                    node.last_heartbeat = max(node.last_heartbeat, now)
                    node.last_progress = max(node.last_progress, now)

    def new_incarnation(self, node_type: str, rank: int, relaunches: int, memory_mb: int) -> Node:
        """Allocate a new id for (type, rank); the previous incarnation becomes stale."""
        with self._lock:
            self._next_id += 1
            return self._new(node_type, rank, relaunches, memory_mb, self._next_id - 1)

    def _new(
        self, node_type: str, rank: int, relaunches: int, memory_mb: int, node_id: int
    ) -> Node:
        with self._lock:
            node = Node(
                type=node_type,
                rank=rank,
                id=node_id,
                relaunches=relaunches,
                memory_mb=memory_mb,
                started_at=time.time(),
                last_heartbeat=time.monotonic(),
            )
            self._by_id[node.id] = node
            self._current[(node_type, rank)] = node.id
            self._save(node)
            return node

    def _save(self, node: Node) -> None:
        self._store.put(NODE_TABLE, str(node.id), json.dumps(node.to_record()).encode())

    def get(self, node_id: int) -> Node | None:
        with self._lock:
            return self._by_id.get(node_id)

    def current(self, node_type: str, rank: int) -> Node | None:
        with self._lock:
            node_id = self._current.get((node_type, rank))
            return self._by_id.get(node_id) if node_id is not None else None

    def all_current(self) -> list[Node]:
        with self._lock:
            return [self._by_id[i] for i in self._current.values()]

    def history(self) -> list[Node]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda n: n.id)

    def check(self, node_type: str, rank: int, node_id: int) -> Node:
        """The node behind a request; StaleNodeError if it is not a live current incarnation."""
        with self._lock:
            if rank == STANDBY_RANK and node_id in self._standby_ids:
                return Node(type=node_type, rank=rank, id=node_id)  # a standby, not a node yet
            node = self._by_id.get(node_id)
            if node is None:
                raise StaleNodeError(f"unknown node id {node_id} ({node_type}-{rank})")
            if node.type != node_type or node.rank != rank:
                raise StaleNodeError(
                    f"node id {node_id} is {node.name}, not {node_type}-{rank} as the request says"
                )
            if self._current.get((node_type, rank)) != node_id:
                raise StaleNodeError(
                    f"{node.name} id {node_id} is an old incarnation; the current one is "
                    f"id {self._current.get((node_type, rank))}"
                )
            if node.state.ended:
                raise StaleNodeError(f"{node.name} id {node_id} has already ended")
            return node

    def mark_running(
        self, node_id: int, address: str, log_path: str, handle: dict | None = None
    ) -> None:
        with self._lock:
            node = self._by_id[node_id]
            node.state = NodeState.RUNNING
            node.address = address
            node.log_path = log_path
            node.platform_handle = dict(handle or {})
            node.last_heartbeat = node.last_progress = time.monotonic()
            self._save(node)

    def on_register(self, node: Node) -> None:
        with self._lock:
            node.registered = True
            node.last_heartbeat = time.monotonic()

    def on_heartbeat(
        self, node: Node, stats: nodes_pb2.ResourceStats, global_step: int
    ) -> list[nodes_pb2.Command]:
        """Record liveness and stats; hand back the commands queued for this node."""
        with self._lock:
            self._beat(node, stats, global_step)
            return self._commands.pop(node.id, [])

    def on_carried_heartbeat(
        self, node: Node, stats: nodes_pb2.ResourceStats, global_step: int
    ) -> None:
        """A heartbeat that rode another message (a progress report): liveness and stats; the
        queued commands wait for the node's next Heartbeat call."""
        with self._lock:
            self._beat(node, stats, global_step)

    def _beat(self, node: Node, stats: nodes_pb2.ResourceStats, global_step: int) -> None:
        """Liveness, stats and step of one heartbeat (under the lock)."""
        node.registered = True
        node.last_heartbeat = time.monotonic()
        node.cpu_percent = stats.cpu_percent
        node.memory_rss_bytes = stats.memory_rss_bytes
        node.memory_limit_bytes = stats.memory_limit_bytes
        node.gpus = tuple(
            GpuStat(g.index, g.utilization_percent, g.memory_used_bytes, g.memory_total_bytes)
            for g in stats.gpus
        )
        node.global_step = max(node.global_step, global_step)

    def save(self, node: Node) -> None:
        """Write a node's record after a change the manager did not make (stop requested)."""
        with self._lock:
            self._save(node)

    def restart_step_clocks(self, now: float) -> None:
        """The whole job is paused (its start, a PS recovery): a report whose gap spans the
        pause times the pause, not the node's steps, and is not a step time sample."""
        self._step_clocks_from = now

    def note_progress(self, node: Node, stepped: bool = True, steps: int = 1) -> None:
        """The node took a shard or (`stepped`) finished `steps` steps since its last report
        (a coalesced report covers several; the time since the last is spread over them):
        hang and straggler detection."""
        now = time.monotonic()
        node.last_progress = now
        if not stepped:
            return
        steps = max(1, steps)
        with self._lock:
            if node.steps and node.last_step_at >= self._step_clocks_from:
                node.step_samples.append((now - node.last_step_at) / steps)
                node.timed_reports += 1
                timed = node.timed_reports
                if timed < STEP_TIME_EVERY or timed % STEP_TIME_EVERY == 0:
                    node.step_seconds = statistics.median(node.step_samples)
            node.steps += steps
            node.last_step_at = now

    def queue_command(self, node_id: int, command: nodes_pb2.Command) -> None:
        with self._lock:
            self._commands[node_id].append(command)

    def mark_exited(
        self, node_id: int, exit_code: int, reason: ExitReason, message: str = ""
    ) -> Node | None:
        """Record the end of an incarnation; None if it had already ended or is unknown."""
        with self._lock:
            node = self._by_id.get(node_id)
            if node is None or node.state.ended:
                return None
            node.exit_code = exit_code
            node.exit_reason = reason
            node.exit_message = message
            node.ended_at = time.time()
            if reason == ExitReason.SUCCEEDED:
                node.state = NodeState.SUCCEEDED
            elif reason == ExitReason.STOPPED:
                node.state = NodeState.DELETED
            else:
                node.state = NodeState.FAILED
            self._commands.pop(node_id, None)
            self._save(node)
            return node
