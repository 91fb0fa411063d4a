"""The auto-scaler: samples a running job and decides with master.job.autoscale_policy.

`Autoscaler` observes a job (what it reads of it is `ObservedJob`) from the job's control loop,
calls `decide` and hands each decision back; the job applies it through its own scaling and PS
migration (master.job.scaling), emitting it as an `autoscale` event. The autoscaler never acts
on the job. `brain_hint` turns the Brain's history into a first worker count to try.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from master.config import AutoscaleSpec
from master.job.autoscale_policy import (
    NONE,
    Decision,
    Observation,
    PSLoad,
    ScalerState,
    decide,
    initial_state,
)
from master.nodes.model import TRAINING_TYPES, NodeState

if TYPE_CHECKING:
    from master.config import JobSpec
    from master.job.migration import PSMigrator
    from master.job.model import JobState
    from master.nodes.manager import NodeManager
    from master.sharding.service import ShardingService

log = logging.getLogger(__name__)

EVENT_KIND = "autoscale"


def brain_hint(brain: Any, spec: Any) -> tuple[int, str]:
    """A starting worker count from the Brain's history of this job (0 if it has none).

    `brain` is a master.brain.client.Brain; its proposal names the worker count of the past
    runs with the best throughput, when that beat the others clearly."""
    try:
        proposal = brain.propose(spec)
    except Exception as e:  # the Brain is advisory: an unreachable one changes nothing
        log.warning("autoscale: no hint from the brain: %s", e)
        return 0, ""
    if not proposal.worker_replicas:
        return 0, ""
    return proposal.worker_replicas, (
        f"the brain's history: {proposal.worker_replicas} workers trained fastest "
        f"in {proposal.runs_considered} past runs"
    )


# ---------------------------------------------------------------------------------------------
# The sampler (runs inside the job's control loop)


class ObservedJob(Protocol):
    """What the autoscaler reads of a job to observe it (master.job.master.JobMaster is one)."""

    state: JobState
    spec: JobSpec
    nodes: NodeManager
    sharding: ShardingService
    migrator: PSMigrator

    @property
    def replicas(self) -> dict[str, int]: ...


class ProcessProbe:
    """CPU and resident memory of local node processes, read by the master itself (psutil),
    for nodes that send no heartbeat stats. Only a platform that hands out pids (local) has
    processes here to read; a node is its process-group leader and everything below it."""

    def __init__(self) -> None:
        self._procs: dict[int, dict[int, Any]] = {}  # node id -> pid -> psutil.Process

    def sample(self, node_id: int, pid: int) -> tuple[float, int] | None:
        """(CPU percent since the previous sample, RSS bytes), or None (first look, or gone)."""
        import psutil

        if pid <= 0:
            return None
        known = self._procs.get(node_id)
        try:
            leader = known[pid] if known and pid in known else psutil.Process(pid)
            tree = {pid: leader}
            for child in leader.children(recursive=True):
                tree[child.pid] = known.get(child.pid, child) if known else child
        except psutil.Error:
            self._procs.pop(node_id, None)
            return None
        cpu, rss = 0.0, 0
        for p_id, proc in tree.items():
            try:
                percent = proc.cpu_percent(interval=None)  # since its previous call; 0 at first
                if known and p_id in known:
                    cpu += percent
                rss += proc.memory_info().rss
            except psutil.Error:
                continue
        self._procs[node_id] = tree
        return (cpu, rss) if known else None


class Autoscaler:
    """Samples a job every `interval_seconds` and decides; the job applies each decision.

    Called from the job's control loop thread only. It remembers its measurements, the last
    decision (for the status and for a restarted master) and the PS migration it asked for,
    so it decides nothing new while that one is in flight."""

    def __init__(
        self, job: ObservedJob | None, cfg: AutoscaleSpec, hint: int = 0, reason: str = ""
    ) -> None:
        self.job = job
        self.cfg = cfg
        self.state = initial_state(hint, reason)
        self.last_decision: Decision | None = None
        self.last_decision_at = 0.0  # time.time()
        self.last_observation: Observation | None = None
        self.note = "starting"  # the latest reason, decision or not
        self.decisions = 0
        self._next = 0.0
        self._last_records: tuple[float, int] | None = None
        self._migration: Future | None = None
        self._probe = ProcessProbe()

    def record(self) -> dict[str, Any]:
        """What a restarted master needs to go on where this scaler was: its measurements
        per worker count and its ceiling (samples in progress are measured again)."""
        s = self.state
        return {
            "table": {str(k): v for k, v in s.table.items()},
            "came_from": s.came_from,
            "ceiling": s.ceiling,
            "decisions": self.decisions,
            "last_decision": self.last_decision.reason if self.last_decision else "",
            "last_action": self.last_decision.action if self.last_decision else NONE,
            "last_decision_at": self.last_decision_at,
        }

    def restore(self, record: dict[str, Any]) -> None:
        """Go on from a record() a previous master instance saved."""
        self.state = ScalerState(
            table={int(k): float(v) for k, v in record["table"].items()},
            came_from=int(record["came_from"]),
            ceiling=int(record["ceiling"]),
        )
        self.decisions = int(record["decisions"])
        if record["last_decision"]:
            self.last_decision = Decision(record["last_action"], record["last_decision"])
        self.last_decision_at = float(record["last_decision_at"])
        self.note = "resumed after a master restart: measuring again"

    def seed(self, hint: int, reason: str) -> None:
        """A first worker count to go to (from the Brain's history), before any measurement."""
        if hint > 0 and self.state.workers < 0:
            self.state = initial_state(hint, reason)

    def tick(self, now: float | None = None) -> Decision | None:
        """Sample and decide if the interval has passed: the decision for the job to apply
        (recorded as taken), or None when there is nothing to do."""
        now = time.monotonic() if now is None else now
        if now < self._next or self.job.state.ended:
            return None
        self._next = now + self.cfg.interval_seconds
        obs = self.observe(now)
        self.state, decision = decide(self.cfg, self.state, obs)
        self.note = decision.reason
        if decision.action == NONE:
            log.debug("autoscale: %s", decision.reason)
            return None
        self.decisions += 1
        self.last_decision = decision
        self.last_decision_at = time.time()
        self.last_observation = obs
        return decision

    def event_details(self, d: Decision) -> dict[str, Any]:
        """The `autoscale` event's reason and details for decision `d` of the last tick."""
        obs = self.last_observation
        table = {str(k): round(v, 2) for k, v in sorted(self.state.table.items())}
        return {
            "reason": d.action,
            "action": d.action,
            "workers": d.workers,
            "previous_workers": obs.workers if obs else 0,
            "ps_rank": d.ps_rank,
            "cpu": d.cpu,
            "memory_mb": d.memory_mb,
            "records_per_second": round(obs.records_per_second, 2) if obs else 0.0,
            "throughput_table": table,
        }

    def migration_requested(self, done: Future) -> None:
        """The job asked its PS migrator for the move decided: wait for it before deciding."""
        self._migration = done

    def not_applied(self, d: Decision, error: Exception) -> None:
        """The job could not apply `d` (e.g. the node ended meanwhile): the next sample decides
        again."""
        log.warning("autoscale: cannot apply %s: %s", d.action, error)
        self.note = f"could not apply the last decision: {error}"

    def observe(self, now: float) -> Observation:
        """The job as the scaler sees it now."""
        job = self.job
        stats = job.sharding.stats()
        done = sum(s.records_done for s in stats)
        rate = 0.0
        busy = ""
        if self._last_records is not None:
            then, before = self._last_records
            if done < before:
                busy = "the data went back to a checkpoint"
            elif now > then:
                rate = (done - before) / (now - then)
        self._last_records = (now, done)
        if self._migration is not None and not self._migration.done():
            busy = "a PS migration is in flight"
        elif job.migrator.active is not None:
            busy = "a PS migration is in flight"
        current = job.nodes.all_current()
        running = [n for n in current if n.state == NodeState.RUNNING]
        ps = []
        for n in running:
            if n.type != "ps":
                continue
            if n.registered:  # its heartbeats carry its stats
                cpu_percent, rss = n.cpu_percent, n.memory_rss_bytes
            else:  # e.g. the built-in PS server, which sends none: read its process if local
                measured = self._probe.sample(n.id, int(n.platform_handle.get("pid", 0)))
                if measured is None:
                    continue
                cpu_percent, rss = measured
            ps.append(
                PSLoad(
                    rank=n.rank,
                    cpu_percent=cpu_percent,
                    cpu_cores=n.cpu or job.spec.ps.cpu,
                    memory_rss_mb=rss / 2**20,
                    memory_limit_mb=float(n.memory_mb or n.memory_limit_bytes / 2**20),
                )
            )
        replicas = job.replicas
        return Observation(
            time=now,
            workers=replicas["worker"],
            worker_slots=job.spec.worker_limit,
            chief=replicas["chief"],
            ready=sum(1 for n in running if n.type in TRAINING_TYPES and n.steps > 0),
            records_per_second=rate,
            records_todo=sum(s.records_todo for s in stats) if stats else 1,
            ps=tuple(ps),
            busy=busy,
            cpu_requested=sum(n.cpu or job.spec.group(n.type).cpu for n in running),
            memory_requested_mb=sum(n.memory_mb for n in running),
            worker_cpu=job.spec.worker.cpu,
            worker_memory_mb=job.spec.worker.memory_mb,
        )

    def status(self) -> dict[str, Any]:
        """For the status document: the last decision, the current reasoning, the table."""
        d = self.last_decision
        return {
            "enabled": True,
            "decisions": self.decisions,
            "last_decision": d.reason if d else "",
            "last_action": d.action if d else "",
            "last_decision_at": self.last_decision_at,
            "note": self.note,
            "throughput_table": {str(k): round(v, 2) for k, v in sorted(self.state.table.items())},
            "ceiling": self.state.ceiling,
        }
