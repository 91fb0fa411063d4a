"""Changing how many workers or evaluators run: by request (`dlrover scale`) or the autoscaler.

The pure part: `check_scale_request` (which requests are refused, and why) and `plan_scale`
(which ranks start and which stop). `Scaler` is the part of the job that applies them in its
control loop, together with the autoscaler's decisions (master.job.autoscaler decides; the job
acts). A PS count change is a PS change instead (master.job.ps_change)."""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from master.config import JobSpec
from master.job.autoscale_policy import MIGRATE_PS, SCALE_WORKERS
from master.job.autoscaler import EVENT_KIND, Autoscaler
from master.job.cluster import Cluster
from master.job.events import Emit
from master.job.lifecycle import NodeLifecycle
from master.job.migration import PSMigrator
from master.job.model import NodeStart, ScaleResult
from master.nodes.manager import NodeManager
from master.nodes.model import Node
from master.state.api import StateStore
from master.state.job_record import JOB_TABLE

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


class Scaler:
    """Applies scale requests (queued from RPC threads) and the autoscaler's decisions in the
    control loop; a request's caller waits on its future."""

    def __init__(
        self,
        spec: JobSpec,
        store: StateStore,
        nodes: NodeManager,
        cluster: Cluster,
        lifecycle: NodeLifecycle,
        migrator: PSMigrator,
        autoscaler: Autoscaler | None,
        job_ended: Callable[[], bool],
        emit: Emit,
        save: Callable[[], None],
    ) -> None:
        self._spec = spec
        self._store = store
        self._nodes = nodes
        self._cluster = cluster
        self._lifecycle = lifecycle
        self._migrator = migrator
        self._autoscaler = autoscaler
        self._job_ended = job_ended
        self._emit = emit
        self._save = save  # writes the runtime record (which holds the replicas)
        self._requests: queue.SimpleQueue[tuple[str, int, str, Future]] = queue.SimpleQueue()

    def check(self, node_type: str, replicas: int) -> None:
        """Raise ValueError, naming what to change, if the request cannot be applied."""
        check_scale_request(self._spec, node_type, replicas, self._cluster.replicas["chief"])

    def request(self, node_type: str, replicas: int, reason: str) -> Future:
        """Queue a checked scale request (any thread); its future ends with a ScaleResult or
        an error."""
        done: Future = Future()
        self._requests.put((node_type, replicas, reason, done))
        return done

    def apply_requests(self) -> None:
        """Control loop: apply every queued request."""
        while True:
            try:
                node_type, replicas, reason, done = self._requests.get_nowait()
            except queue.Empty:
                return
            try:
                done.set_result(self.scale(node_type, replicas, reason))
            except Exception as e:  # handed back to the caller of request()
                done.set_exception(e)

    def scale(self, node_type: str, replicas: int, reason: str) -> ScaleResult:
        """Run `replicas` ranks of `node_type` now (from the control loop)."""
        previous = self._cluster.replicas[node_type]
        if replicas == previous or self._job_ended():
            return ScaleResult(previous, previous, self._cluster.version)
        plan = plan_scale(node_type, previous, replicas, self._nodes.all_current())
        self._cluster.resize(node_type, replicas, plan.new_cluster)
        self._save()
        self._emit(
            "scale",
            f"{node_type} {previous} -> {replicas}" + (f" ({reason})" if reason else ""),
            reason=reason,
            node_type=node_type,
            previous=previous,
            replicas=replicas,
            cluster_version=self._cluster.version,
        )
        for start in plan.launch:
            self._lifecycle.launch(start)
        for node in plan.stop:
            # Its unconsumed records go back to todo when it has ended (master.job.exits).
            self._lifecycle.stop(node)
        return ScaleResult(previous, replicas, self._cluster.version)

    def autoscale(self) -> None:
        """Let the autoscaler sample the job, and apply what it decides (it never acts itself)."""
        scaler = self._autoscaler
        d = scaler.tick() if scaler is not None else None
        if scaler is None or d is None:
            return
        self._store.put(JOB_TABLE, AUTOSCALE_KEY, json.dumps(scaler.record()).encode())
        self._emit(EVENT_KIND, f"autoscale: {d.reason}", **scaler.event_details(d))
        try:
            if d.action == SCALE_WORKERS:
                # Directly: a request would wait for this very control loop.
                self.scale("worker", d.workers, "autoscale")
            elif d.action == MIGRATE_PS:
                ps = self._cluster.replicas["ps"]
                scaler.migration_requested(
                    self._migrator.request("ps", d.ps_rank, d.memory_mb, d.cpu, "autoscale", ps)
                )
        except ValueError as e:  # e.g. the node ended meanwhile: the next sample decides again
            scaler.not_applied(d, e)

    def resume(self) -> None:
        """A restarted master: the autoscaler keeps its predecessor's measurements."""
        raw = self._store.get(JOB_TABLE, AUTOSCALE_KEY)
        if raw is not None and self._autoscaler is not None:
            self._autoscaler.restore(json.loads(raw))
