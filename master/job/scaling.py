"""Changing how many workers or evaluators run: by request (`dlrover scale`) or the autoscaler.

The pure part: `check_scale_request` (which requests are refused, and why) and `plan_scale`
(which ranks start and which stop). `ScalingMixin` is the part of `JobMaster` that applies
them in its control loop, together with the autoscaler's decisions (master.job.autoscaler
decides; the job acts). A PS count change is a PS change instead (master.job.ps_change)."""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from master.job.autoscale_policy import MIGRATE_PS, SCALE_WORKERS
from master.job.autoscaler import EVENT_KIND, Autoscaler
from master.job.model import JobState, NodeStart, ScaleResult
from master.nodes.model import Node
from master.state.job_record import JOB_TABLE

if TYPE_CHECKING:
    from master.config import JobSpec
    from master.job.migration import PSMigrator
    from master.nodes.manager import NodeManager
    from master.state.api import StateStore

SCALABLE_TYPES = ("worker", "evaluator")
MAX_REPLICAS = 1024
AUTOSCALE_KEY = "autoscale"  # the auto-scaler's measurements, in the job table


def check_scale_request(spec: JobSpec, node_type: str, replicas: int, chief_replicas: int) -> None:
    """Raise ValueError, naming what to change, if `replicas` nodes of `node_type` cannot run."""
    if node_type not in SCALABLE_TYPES:
        raise ValueError(
            f"cannot scale {node_type!r} at run time; scalable types: "
            f"{', '.join(('ps', *SCALABLE_TYPES))}"
        )
    if not 0 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"replicas must be in [0, {MAX_REPLICAS}], got {replicas}")
    slots = spec.group(node_type).slots
    if node_type == "worker" and slots > replicas > spec.worker_limit:
        raise ValueError(
            f"the job's TF_CONFIG lists its {spec.worker_limit} workers only: TF processes "
            "cannot reach a worker added later. Set 'worker: {reserve_slots: true}' (or a "
            "worker.max_replicas) in the job YAML to list every slot (it takes effect on the "
            "next run)"
        )
    if node_type == "worker" and replicas > slots:
        raise ValueError(
            f"worker.max_replicas is {slots}: the TF cluster spec has {slots} worker slots. "
            "Raise worker.max_replicas in the job YAML (it takes effect on the next run)"
        )
    if node_type == "worker" and replicas == 0 and chief_replicas == 0:
        raise ValueError("the job has no chief: scaling workers to 0 would stop training")


@dataclass(frozen=True)
class ScalePlan:
    """What going from `previous` to `replicas` nodes of one type starts and stops."""

    new_cluster: bool  # the TF cluster changes: its version goes up
    launch: tuple[NodeStart, ...]
    stop: tuple[Node, ...]  # running nodes of the ranks that go


def plan_scale(node_type: str, previous: int, replicas: int, nodes: Iterable[Node]) -> ScalePlan:
    """Start the ranks from `previous` up to `replicas` (a rank that ran before counts as a
    relaunch), stop the running ones from `replicas` up to `previous`. Pure."""
    current = {n.rank: n for n in nodes if n.type == node_type}
    launch = []
    for rank in range(previous, replicas):
        node = current.get(rank)
        launch.append(NodeStart(node_type, rank, node.relaunches + 1 if node is not None else 0))
    stop = [
        current[rank]
        for rank in range(replicas, previous)
        if rank in current and not current[rank].state.ended
    ]
    return ScalePlan(node_type != "evaluator", tuple(launch), tuple(stop))


class ScalingMixin:
    """The part of `JobMaster` that applies scale requests and the autoscaler's decisions."""

    state: JobState
    store: StateStore
    nodes: NodeManager
    migrator: PSMigrator
    autoscaler: Autoscaler | None
    cluster_version: int
    _replicas: dict[str, int]
    _scale_requests: queue.SimpleQueue[tuple]
    _emit: Callable[..., Any]
    _launch: Callable[..., Node]
    _stop_node: Callable[[Node], None]
    _save_runtime: Callable[[], None]

    def _apply_scale_requests(self) -> None:
        while True:
            try:
                node_type, replicas, reason, done = self._scale_requests.get_nowait()
            except queue.Empty:
                return
            try:
                done.set_result(self._scale(node_type, replicas, reason))
            except Exception as e:  # handed back to the caller of request_scale
                done.set_exception(e)

    def _scale(self, node_type: str, replicas: int, reason: str) -> ScaleResult:
        previous = self._replicas[node_type]
        if replicas == previous or self.state.ended:
            return ScaleResult(previous, previous, self.cluster_version)
        plan = plan_scale(node_type, previous, replicas, self.nodes.all_current())
        self._replicas[node_type] = replicas
        if plan.new_cluster:
            self.cluster_version += 1
        self._save_runtime()
        self._emit(
            "scale",
            f"{node_type} {previous} -> {replicas}" + (f" ({reason})" if reason else ""),
            reason=reason,
            node_type=node_type,
            previous=previous,
            replicas=replicas,
            cluster_version=self.cluster_version,
        )
        for start in plan.launch:
            self._launch(start.node_type, start.rank, start.relaunches)
        for node in plan.stop:
            # Its unconsumed records go back to todo when it has ended (_on_node_exit).
            self._stop_node(node)
        return ScaleResult(previous, replicas, self.cluster_version)

    def _autoscale(self) -> None:
        """Let the autoscaler sample the job, and apply what it decides (it never acts itself)."""
        scaler = self.autoscaler
        d = scaler.tick() if scaler is not None else None
        if scaler is None or d is None:
            return
        self.save_autoscale(scaler.record())
        self._emit(EVENT_KIND, f"autoscale: {d.reason}", **scaler.event_details(d))
        try:
            if d.action == SCALE_WORKERS:
                # Directly: a request would wait for this very control loop.
                self._scale("worker", d.workers, "autoscale")
            elif d.action == MIGRATE_PS:
                scaler.migration_requested(
                    self.migrator.request(
                        "ps", d.ps_rank, d.memory_mb, d.cpu, "autoscale", self._replicas["ps"]
                    )
                )
        except ValueError as e:  # e.g. the node ended meanwhile: the next sample decides again
            scaler.not_applied(d, e)

    def save_autoscale(self, record: dict) -> None:
        """The auto-scaler's measurements, so a restarted master does not redo them."""
        self.store.put(JOB_TABLE, AUTOSCALE_KEY, json.dumps(record).encode())
