"""The job's side of a PS change (master.job.migration runs its phases): stop, start, record.

A move restarts one PS with new resources; a count change stops every PS, the chief and the
workers at a step boundary and starts them again with a new `TF_CONFIG`. The pure part says
which nodes stop and which start; `PSChanges` is the part of the job that owns the PSMigrator,
starts and stops what it asks for, and carries a change on after a master restart."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

from master.client import COORDINATOR_KEY
from master.job.cluster import Cluster
from master.job.events import Emit
from master.job.lifecycle import NodeLifecycle
from master.job.migration import CLUSTER_TYPES, PSMigrator
from master.job.model import NodeStart
from master.job.ps_standby import StandbyKeeper
from master.job.recovery_timeline import PS_MIGRATION, PS_RESIZE, RecoveryTracker
from master.job.rollback import DataRollback
from master.kv.store import KVStore
from master.nodes.manager import NodeManager
from master.nodes.model import Node, NodeState
from master.state.api import StateStore
from master.state.job_record import JOB_TABLE

PS_CHANGE_KEY = "ps_change"  # the PS move or count change in progress, in the job table
PS_RESIZE_TIMEOUT_SECONDS = 300.0  # pause, checkpoint, and every TF process stopped
KERAS_PS_REFUSAL = (
    "this job trains with TF2 ParameterServerStrategy (dlrover_tf.keras_ps), whose "
    "coordinator cannot move to a new PS set while it trains: moving a PS or "
    "changing the PS count is for tf.estimator jobs. Change the ps group in the job "
    "YAML and resubmit (training resumes from the latest checkpoint)"
)


def cluster_to_stop(nodes: Iterable[Node]) -> list[Node]:
    """A PS count change, after its checkpoint: every running PS, chief and worker stops."""
    return [n for n in nodes if n.type in CLUSTER_TYPES and n.state == NodeState.RUNNING]


def cluster_to_start(replicas: Mapping[str, int], nodes: Iterable[Node]) -> list[NodeStart]:
    """The cluster's ranks to start after a PS count change: those not running or done, each
    with its previous incarnation's relaunches and resources. Starting what this returns is
    idempotent: a restarted master asks again and starts only what is still missing."""
    current = {(n.type, n.rank): n for n in nodes}
    starts = []
    for node_type in CLUSTER_TYPES:
        for rank in range(replicas[node_type]):
            old = current.get((node_type, rank))
            if old is None:
                starts.append(NodeStart(node_type, rank, 0))
            elif old.state not in (NodeState.RUNNING, NodeState.SUCCEEDED):
                starts.append(NodeStart(node_type, rank, old.relaunches, old.memory_mb, old.cpu))
    return starts


class PSChanges:
    """Moves a PS or changes the PS count: owns the PSMigrator that runs the phases, and
    starts and stops the nodes it asks for."""

    def __init__(
        self,
        store: StateStore,
        kv: KVStore,
        nodes: NodeManager,
        cluster: Cluster,
        lifecycle: NodeLifecycle,
        standby: StandbyKeeper,
        rollback: DataRollback,
        recovery: RecoveryTracker,
        emit: Emit,
        save: Callable[[], None],
    ) -> None:
        self._store = store
        self._kv = kv
        self._nodes = nodes
        self._cluster = cluster
        self._lifecycle = lifecycle
        self._standby = standby
        self._rollback = rollback
        self._recovery = recovery
        self._save = save  # writes the runtime record (replicas and cluster version)
        self.migrator = PSMigrator(
            kv,
            nodes.current,
            self._running_workers,
            lifecycle.stop_now,
            emit,
            stop_cluster=self._stop_cluster,
            start_cluster=self._start_cluster,
            save=self._save_change,
            on_phase=recovery.mark,
        )

    def request_move(
        self, node_type: str, rank: int, memory_mb: int, cpu: float, reason: str
    ) -> Future:
        """Queue a PS move to new resources; the future ends with a MigrateResult."""
        self._refuse_under_keras()
        done = self.migrator.request(
            node_type, rank, memory_mb, cpu, reason, self._cluster.replicas.get(node_type, 0)
        )
        self._recovery.open(PS_MIGRATION, f"{node_type}-{rank}")
        return done

    def request_resize(self, ps_count: int, reason: str) -> Future:
        """Queue a PS count change; the future ends with a ResizeResult."""
        self._refuse_under_keras()
        previous = self._cluster.replicas["ps"]
        done = self.migrator.request_resize(ps_count, previous, reason)
        self._recovery.open(PS_RESIZE, f"ps {previous} -> {ps_count}")
        return done

    def claims(self, node: Node) -> bool:
        """Whether `node`'s end belongs to the change in progress (see `on_exit`)."""
        return self.migrator.claims(node)

    def on_exit(self, node: Node) -> None:
        """A node the change stopped has ended: a move starts the PS's new incarnation; a
        count change starts the new cluster once every node it stopped has ended."""
        migration = self.migrator.on_exit(node)
        if migration is not None and not migration.ps_count:
            self._complete_move(node, migration)

    def _running_workers(self) -> list[Node]:
        current = self._nodes.all_current()
        return [n for n in current if n.type == "worker" and n.state == NodeState.RUNNING]

    def _complete_move(self, old: Node, migration: Any) -> None:
        """The PS being moved has ended: start its new incarnation with the new resources."""
        start = NodeStart(old.type, old.rank, old.relaunches, migration.memory_mb, migration.cpu)
        new = self._standby.promote(start) or self._lifecycle.launch(start)
        if self._rollback.chief_reports_restores:
            self._rollback.free_held_shards()
        else:
            self._rollback.rollback()  # to the checkpoint made for the migration
        self.migrator.finished(migration, new)

    def _save_change(self, record: dict | None) -> None:
        """The PS change in progress, so a restarted master carries it on."""
        if record is None:
            self._store.delete(JOB_TABLE, PS_CHANGE_KEY)
        else:
            self._store.put(JOB_TABLE, PS_CHANGE_KEY, json.dumps(record).encode())

    def resume(self) -> None:
        """A restarted master carries on the change its predecessor saved."""
        raw = self._store.get(JOB_TABLE, PS_CHANGE_KEY)
        if raw is None:
            return
        self.migrator.restore(json.loads(raw))
        move = self.migrator.settle()
        if move is not None:
            self._complete_move(self._nodes.current(move.node_type, move.rank), move)

    def _stop_cluster(self, ps_count: int) -> list[Node]:
        """A PS count change, after its checkpoint: stop every PS, the chief and the workers at
        once (they wait at a step boundary); none is relaunched until all have ended."""
        stopping = cluster_to_stop(self._nodes.all_current())
        for node in stopping:
            self._lifecycle.stop_now(node)
        return stopping

    def _start_cluster(self, ps_count: int) -> int:
        """Start the cluster again with `ps_count` PS and a new TF_CONFIG: the chief restores
        the checkpoint made for the change (re-partitioned by TF's saver), workers follow.
        Idempotent: a restarted master calls it again and starts only what is not running."""
        if self._cluster.replicas["ps"] != ps_count:
            self._cluster.resize("ps", ps_count, new_cluster=True)
            self._save()
        for start in cluster_to_start(self._cluster.replicas, self._nodes.all_current()):
            self._lifecycle.launch(start)
        if not self._rollback.chief_reports_restores:
            self._rollback.rollback()  # to the checkpoint made for the change
        return self._cluster.version

    def _refuse_under_keras(self) -> None:
        if self._kv.check([COORDINATOR_KEY]):
            raise ValueError(KERAS_PS_REFUSAL)
