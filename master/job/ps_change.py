"""The job's side of a PS change (master.job.migration runs its phases): stop, start, record.

A move restarts one PS with new resources; a count change stops every PS, the chief and the
workers at a step boundary and starts them again with a new `TF_CONFIG`. The pure part says
which nodes stop and which start; `PSChangeMixin` is the part of `JobMaster` that the
PSMigrator calls back into, and that carries a change on after a master restart."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from master.client import COORDINATOR_KEY
from master.job.migration import CLUSTER_TYPES
from master.job.model import NodeStart
from master.nodes.model import Node, NodeState
from master.state.job_record import JOB_TABLE

if TYPE_CHECKING:
    from master.job.migration import PSMigrator
    from master.kv.store import KVStore
    from master.nodes.manager import NodeManager
    from master.state.api import StateStore

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


class PSChangeMixin:
    """The part of `JobMaster` that the PS migrator calls back into (see __init__)."""

    store: StateStore
    kv: KVStore
    nodes: NodeManager
    migrator: PSMigrator
    cluster_version: int
    _replicas: dict[str, int]
    _chief_reports_restores: bool
    _launch: Callable[..., Node]
    _kill_node: Callable[[Node], None]
    _save_runtime: Callable[[], None]
    _rollback_data: Callable[..., None]
    _free_held_shards: Callable[[], None]

    def _running_workers(self) -> list[Node]:
        current = self.nodes.all_current()
        return [n for n in current if n.type == "worker" and n.state == NodeState.RUNNING]

    def _retire_node(self, node: Node) -> None:
        """Stop a node at once (its state is saved elsewhere, e.g. a PS after a checkpoint):
        every step the others take meanwhile would be trained again after the restore."""
        node.stop_requested = True
        self.nodes.save(node)
        self._kill_node(node)

    def _complete_move(self, old: Node, migration: Any) -> None:
        """The PS being moved has ended: start its new incarnation with the new resources."""
        new = self._launch(old.type, old.rank, old.relaunches, migration.memory_mb, migration.cpu)
        if self._chief_reports_restores:
            self._free_held_shards()
        else:
            self._rollback_data()  # to the checkpoint made for the migration
        self.migrator.finished(migration, new)

    def _save_ps_change(self, record: dict | None) -> None:
        """The PS change in progress, so a restarted master carries it on."""
        if record is None:
            self.store.delete(JOB_TABLE, PS_CHANGE_KEY)
        else:
            self.store.put(JOB_TABLE, PS_CHANGE_KEY, json.dumps(record).encode())

    def _resume_ps_change(self) -> None:
        raw = self.store.get(JOB_TABLE, PS_CHANGE_KEY)
        if raw is None:
            return
        self.migrator.restore(json.loads(raw))
        move = self.migrator.settle()
        if move is not None:
            self._complete_move(self.nodes.current(move.node_type, move.rank), move)

    def _stop_for_ps_change(self, ps_count: int) -> list[Node]:
        """A PS count change, after its checkpoint: stop every PS, the chief and the workers at
        once (they wait at a step boundary); none is relaunched until all have ended."""
        stopping = cluster_to_stop(self.nodes.all_current())
        for node in stopping:
            self._retire_node(node)
        return stopping

    def _start_after_ps_change(self, ps_count: int) -> int:
        """Start the cluster again with `ps_count` PS and a new TF_CONFIG: the chief restores
        the checkpoint made for the change (re-partitioned by TF's saver), workers follow.
        Idempotent: a restarted master calls it again and starts only what is not running."""
        if self._replicas["ps"] != ps_count:
            self._replicas["ps"] = ps_count
            self.cluster_version += 1
            self._save_runtime()
        for start in cluster_to_start(self._replicas, self.nodes.all_current()):
            self._launch(start.node_type, start.rank, start.relaunches, start.memory_mb, start.cpu)
        if not self._chief_reports_restores:
            self._rollback_data()  # to the checkpoint made for the change
        return self.cluster_version

    def _refuse_ps_change_under_keras(self) -> None:
        if self.kv.check([COORDINATOR_KEY]):
            raise ValueError(KERAS_PS_REFUSAL)
