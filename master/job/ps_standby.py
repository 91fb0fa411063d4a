"""A standby PS: a spare `dlrover_tf.ps_standby` process with TensorFlow loaded, kept ready by
the master and promoted when a PS fails or is moved, instead of starting a fresh process.

The promoted process keeps the PS's task index and address (the `TF_CONFIG` of the task it
replaces comes with the promotion), so no other node needs a new cluster spec: the chief and
the workers rebuild their sessions against the same address, as with a relaunch. A standby is
not a node until promoted: it talks to the master as rank `STANDBY_RANK` with an id reserved for
it, and is never counted, health-checked or shown as one. The pure part decides when one is
wanted and whether one may replace a given PS; `StandbyKeeper` is the part of the job that
runs it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from master.client import ps_standby_key
from master.config import JobSpec
from master.job.cluster import Cluster
from master.job.events import Emit
from master.job.launch import launch_spec, node_env, tf_config
from master.job.model import JobRuntime, NodeStart
from master.job.recovery_timeline import RecoveryPhase, RecoveryTracker
from master.kv.store import KVStore
from master.nodes.manager import STANDBY_RANK, NodeManager
from master.nodes.model import Node
from master.platform.api import NodeEvent, Platform, PlatformError
from master.state.api import StateStore
from master.state.job_record import JOB_TABLE

log = logging.getLogger(__name__)

STANDBY_MODULE = "dlrover_tf.ps_standby"
STANDBY_RECORD_KEY = "ps_standby"  # the standby's id in the job table, for a restarted master
# Loading TensorFlow takes a core for seconds, which a job starting or recovering needs more:
# a standby starts once training runs with no recovery in progress, at least this long after
# the last one was promoted or died, and at the latest MAX_DELAY_SECONDS after that.
RESPAWN_DELAY_SECONDS = 1.0
MAX_DELAY_SECONDS = 60.0
RESUME_DELAY_SECONDS = 30.0  # a restarted master's first standby, at the earliest


@dataclass
class Standby:
    """The standby process the master keeps: its reserved id and log."""

    id: int
    log_path: str
    memory_mb: int
    cpu: float
    ready_at: float = 0.0  # unix time it said TensorFlow is loaded (0: still loading)


def standby_wanted(
    spec: JobSpec, ps_replicas: int, platform_runs_standby: bool, training_done: bool
) -> bool:
    """Whether the job should keep a standby PS now: asked for, a PS job on the built-in PS
    server (a user's own PS command has no standby mode), a platform that can run one, and
    training not over."""
    return (
        spec.ps_standby
        and ps_replicas > 0
        and not spec.ps.command
        and platform_runs_standby
        and not training_done
    )


def standby_due(now: float, earliest: float, training: bool, recovering: bool) -> bool:
    """Whether to start the standby now: not before `earliest`; then as soon as training runs
    with no recovery in progress, or in any case MAX_DELAY_SECONDS later."""
    if now < earliest:
        return False
    return (training and not recovering) or now >= earliest + MAX_DELAY_SECONDS


def may_replace(
    standby: Standby | None,
    current: Node | None,
    memory_mb: int,
    cpu: float,
    platform_enforces_resources: bool,
) -> bool:
    """Whether the standby may become the next incarnation of `current`'s rank with these
    resources: it must be ready (a standby still loading TensorFlow, at idle priority, would
    make the recovery wait for it; a new PS process is started instead), its id the newest of
    that rank (a restarted master takes the highest id as current), and where the platform
    enforces resources they must be the standby's."""
    if standby is None or not standby.ready_at:
        return False
    if current is not None and standby.id <= current.id:
        return False
    if platform_enforces_resources and (memory_mb, cpu) != (standby.memory_mb, standby.cpu):
        return False
    return True


def promotion_message(tf_config_json: str, node_id: int) -> bytes:
    """What a standby is promoted with: the TF_CONFIG of the task it becomes."""
    return json.dumps({"tf_config": tf_config_json, "node_id": node_id}).encode()


def retire_message() -> bytes:
    """The promotion key's value that tells a standby to end instead."""
    return json.dumps({"retire": True}).encode()


class StandbyKeeper:
    """Keeps at most one standby PS: starts it when due, promotes it, retires it."""

    def __init__(
        self,
        spec: JobSpec,
        runtime: JobRuntime,
        platform: Platform,
        nodes: NodeManager,
        kv: KVStore,
        store: StateStore,
        cluster: Cluster,
        recovery: RecoveryTracker,
        emit: Emit,
        save: Callable[[], None],
    ) -> None:
        self._spec = spec
        self._runtime = runtime
        self._platform = platform
        self._nodes = nodes
        self._kv = kv
        self._store = store
        self._cluster = cluster
        self._recovery = recovery
        self._emit = emit
        self._save = save  # writes the runtime record once a promoted PS runs
        self._standby: Standby | None = None
        self._due = time.monotonic()  # no new standby starts before this

    def keep(self, training_started: bool, training_done: bool, recovering: bool) -> None:
        """Control loop: start a standby when one is wanted and due; retire it when not.
        `recovering`: a recovery or a PS change runs (it restarts PS processes)."""
        wanted = standby_wanted(
            self._spec,
            self._cluster.replicas["ps"],
            self._platform.runs_ps_standby,
            training_done,
        )
        if not wanted:
            if self._standby is not None:
                self._retire("training is over")
            return
        if self._standby is None and standby_due(
            time.monotonic(), self._due, training_started, recovering
        ):
            self._start()

    def _start(self) -> None:
        node_id = self._nodes.reserve_standby_id()
        group = self._spec.ps
        node = Node(type="ps", rank=STANDBY_RANK, id=node_id, memory_mb=group.memory_mb)
        node.cpu = group.cpu
        inherited = os.environ if self._platform.inherits_master_env else None
        env = node_env(self._spec, self._runtime, node, {}, inherited)
        env.pop("TF_CONFIG", None)  # given with the promotion
        log_path = os.path.join(self._runtime.run_dir, "logs", f"ps-standby.{node_id}.log")
        spec = launch_spec(self._spec, node, env, log_path)
        spec = dataclasses.replace(spec, command=(sys.executable, "-m", STANDBY_MODULE))
        self._standby = Standby(node_id, log_path, group.memory_mb, group.cpu)
        self._store.put(JOB_TABLE, STANDBY_RECORD_KEY, str(node_id).encode())
        self._platform.launch(spec)
        self._emit("ps_standby", f"standby PS started (id {node_id})", reason="started", id=node_id)

    def on_kv(self, key: bytes, value: bytes) -> None:
        """KV listener: the standby says TensorFlow is loaded."""
        s = self._standby
        if s is not None and key == ps_standby_key(s.id, "ready") and not s.ready_at:
            s.ready_at = float(value)
            self._emit("ps_standby", f"standby PS ready (id {s.id})", reason="ready", id=s.id)

    def promote(self, start: NodeStart) -> Node | None:
        """The standby becomes the next incarnation of (type, rank), with that task's
        TF_CONFIG; None (and nothing done) when there is no standby that may."""
        node_type, rank = start.node_type, start.rank
        if node_type != "ps":
            return None
        s = self._standby
        current = self._nodes.current(node_type, rank)
        memory_mb = start.memory_mb or self._spec.ps.memory_mb
        cpu = start.cpu or self._spec.ps.cpu
        enforced = self._platform.enforces_resources
        if not may_replace(s, current, memory_mb, cpu, enforced) or not (
            self._platform.can_stand_in(s.id, node_type, rank)
        ):
            if s is not None and current is not None and current.id >= s.id:
                # Older than the PS it would replace (e.g. after a PS count change): a new
                # standby, with a newer id, takes its place.
                self._retire(f"older than {current.name} (id {current.id})")
            return None
        try:
            self._platform.take_over(s.id, node_type, rank)
            self._cluster.refresh(node_type, rank)  # it may have moved to the standby's host
        except PlatformError as e:
            log.warning("the standby PS cannot take over %s-%d: %s", node_type, rank, e)
            self._retire(str(e))
            return None
        self._standby = None
        self._due = time.monotonic() + RESPAWN_DELAY_SECONDS
        node = self._nodes.promote_standby(s.id, node_type, rank, start.relaunches, memory_mb)
        node.cpu = cpu
        address = self._cluster.address(node_type, rank)
        config = tf_config(self._cluster.tf_cluster(), node_type, rank)
        self._kv.set(ps_standby_key(s.id, "promote"), promotion_message(config, node.id))
        self._nodes.mark_running(node.id, address, s.log_path, self._platform.handle(node.id))
        self._recovery.mark(RecoveryPhase.PS_STARTED, standby=True)
        self._save()
        self._emit(
            "node_running",
            f"{node.name} (id {node.id}) promoted from the standby PS at {address}",
            node,
            relaunches=start.relaunches,
            memory_mb=node.memory_mb,
            standby=True,
            standby_ready=bool(s.ready_at),
        )
        return node

    def on_exit(self, event: NodeEvent) -> bool:
        """A platform event about the standby (it died before any promotion): forget it, a
        new one starts later. Whether the event was the standby's."""
        s = self._standby
        if s is None or event.id != s.id:
            return False
        self._standby = None
        self._due = time.monotonic() + RESPAWN_DELAY_SECONDS
        self._emit(
            "ps_standby",
            f"standby PS (id {s.id}) ended with exit code {event.exit_code}",
            reason="ended",
            id=s.id,
            exit_code=event.exit_code,
        )
        return True

    def _retire(self, why: str) -> None:
        s, self._standby = self._standby, None
        if s is None:
            return
        self._kv.set(ps_standby_key(s.id, "promote"), retire_message())
        self._platform.stop_node(s.id, 5.0)
        self._emit(
            "ps_standby", f"standby PS (id {s.id}) retired: {why}", reason="retired", id=s.id
        )

    def resume(self) -> None:
        """A restarted master: the previous one's standby is not adopted; it is told to end
        (it may still be waiting) and its id is never handed out again."""
        # The restarted master may be carrying on a recovery it has no timeline of.
        self._due = time.monotonic() + RESUME_DELAY_SECONDS
        raw = self._store.get(JOB_TABLE, STANDBY_RECORD_KEY)
        if raw is None:
            return
        old = int(raw)
        self._nodes.skip_ids_below(old + 1)
        if self._nodes.get(old) is None:  # never promoted
            self._nodes.allow_standby_id(old)
            self._kv.set(ps_standby_key(old, "promote"), retire_message())
