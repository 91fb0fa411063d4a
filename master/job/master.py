"""The job master: the control loop of one job, handed the parts that own its concerns.

`JobMaster` keeps the job's own state (pending, running, ended; its global step; its master
epoch) and runs the loop; each concern is a part that owns its state behind a small interface,
wired here with the narrow ports it needs (docs/architecture.md lists them):
`Cluster` (replicas, version, addresses), `NodeLifecycle` (launch, adopt, stop, kill),
`ExitHandler` (a node's end, planned by master.job.exit_plan), `HealthMonitor`, `StuckWatch`,
`Completion`, `Scaler` (and the autoscaler), `PSChanges` (PS moves and count changes),
`StandbyKeeper` (the standby PS), `DataRollback`, `RecoveryTracker` (recovery timelines),
`CheckpointIntervalTuner` and `FaultInjector`."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from master.config import JobSpec
from master.job.agent_events import agent_event
from master.job.autoscaler import Autoscaler
from master.job.checkpoint_interval import CheckpointIntervalTuner
from master.job.checkpoints import Checkpoint, CheckpointRegistry
from master.job.cluster import Cluster
from master.job.completion import Completion
from master.job.events import EVENTS_FILE, EventLog, JobEvent, read_events
from master.job.exits import ExitHandler
from master.job.faults import Fault, FaultInjector, JobProgress, default_freeze_seconds
from master.job.health import HealthMonitor
from master.job.lifecycle import NodeLifecycle
from master.job.migration import MigrateResult, PSMigrator
from master.job.model import (
    STOP_GRACE_SECONDS,
    JobRuntime,
    JobState,
    MasterFencedError,
    NodeStart,
    ScaleResult,
)
from master.job.platform_news import PlatformNews
from master.job.ps_change import PS_RESIZE_TIMEOUT_SECONDS, PSChanges
from master.job.ps_standby import StandbyKeeper
from master.job.recovery_timeline import JOB_START, RecoveryPhase, RecoveryTracker
from master.job.rollback import DataRollback
from master.job.runtime_record import RUNTIME_KEY, RuntimeRecord
from master.job.scaling import Scaler
from master.job.stuck import StuckWatch
from master.kv.store import KVStore
from master.nodes.manager import NodeManager
from master.nodes.model import ExitReason, Node
from master.platform.api import Platform
from master.rendezvous.rounds import Round
from master.rendezvous.service import RendezvousService
from master.sharding.service import ShardingService
from master.sharding.streams import StreamRegistry
from master.state.api import StateStore
from master.state.job_record import JOB_TABLE

__all__ = [
    "LAUNCH_ORDER",
    "JobEvent",
    "JobMaster",
    "JobRuntime",
    "JobState",
    "MasterFencedError",
    "ScaleResult",
]

log = logging.getLogger(__name__)

TICK_SECONDS = 0.2
LAUNCH_ORDER = ("ps", "chief", "worker", "evaluator")
# How often the control loop checks that no newer master instance has taken over.
FENCE_CHECK_SECONDS = 1.0


class JobMaster:
    """Runs one job on a platform: the control loop applies policy decisions to node events."""

    def __init__(
        self,
        spec: JobSpec,
        platform: Platform,
        store: StateStore,
        runtime: JobRuntime,
        faults: tuple[Fault, ...] = (),
        on_event: Callable[[JobEvent], None] | None = None,
        resuming: bool = False,
    ) -> None:
        # Until the previous instance's nodes are restored, a node's request is answered
        # "unavailable, retry" rather than "unknown node" (see master.rpc.guard).
        self.resuming = resuming
        self.spec = spec
        self.platform = platform
        self.store = store
        self.runtime = runtime
        self.state = JobState.PENDING
        self.reason = ""
        self.global_step = 0
        self.last_loss: float | None = None  # the latest training loss a node reported
        self.wall_seconds = 0.0
        self.epoch = 0  # this master instance's number; a restarted master takes the next
        self.event_log = EventLog(
            os.path.join(runtime.run_dir, EVENTS_FILE) if runtime.run_dir else ""
        )
        self.events: list[JobEvent] = self.event_log.events
        if on_event:
            self.event_log.add_listener(on_event)
        self._started = time.monotonic()
        self._started_wall = time.time()
        self._stop_request: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._next_fence_check = 0.0

        # What the job's nodes talk to (the RPC surface serves these).
        self.nodes = NodeManager(store)
        self.sharding = ShardingService(store)
        self.progress_streams = StreamRegistry()
        self.checkpoints = CheckpointRegistry(store)
        self.kv = KVStore(store)  # behind the torch Store of the agents

        # The parts of the job core, each with the ports it needs.
        emit, save = self.emit, self._save_runtime
        self.cluster = Cluster(spec, platform)
        self.recovery = RecoveryTracker(emit)
        self.lifecycle = NodeLifecycle(
            spec,
            runtime,
            platform,
            self.nodes,
            self.cluster,
            emit,
            on_launched=self._on_launched,
            on_gone=lambda event: self.exits.handle(event),
        )
        self.rollback = DataRollback(self.nodes, self.sharding, self.checkpoints, platform, emit)
        self.standby = StandbyKeeper(
            spec, runtime, platform, self.nodes, self.kv, store, self.cluster, self.recovery,
            emit, save,
        )  # fmt: skip
        self.ps_changes = PSChanges(
            store, self.kv, self.nodes, self.cluster, self.lifecycle, self.standby,
            self.rollback, self.recovery, emit, save,
        )  # fmt: skip
        self.completion = Completion(
            spec,
            self.nodes,
            self.sharding,
            self.lifecycle,
            lambda: self.cluster.replicas,
            emit,
            save,
            on_training_done=self._on_training_done,
            succeed=lambda reason: self._set_state(JobState.SUCCEEDED, reason),
        )
        self.stuck = StuckWatch(
            spec, self.nodes, platform, self.cluster.tf_cluster, emit, fail=self._fail
        )
        self.health = HealthMonitor(
            spec,
            self.nodes,
            self.sharding,
            self.stuck.measured_cpu,
            self.recovery.recovering,
            self.lifecycle.kill,
            emit,
        )
        # Torch rendezvous rounds; each closed round is a job event.
        self.rendezvous = RendezvousService(
            store, on_round=self._on_rendezvous_round, describe_silent=self.health.silent_node_cause
        )
        self.exits = ExitHandler(
            spec,
            self.nodes,
            self.sharding,
            self.progress_streams,
            self.rendezvous,
            self.kv,
            self.checkpoints,
            self.lifecycle,
            self.standby,
            self.ps_changes,
            self.rollback,
            self.recovery,
            emit,
            job_ended=lambda: self.state.ended,
            training_done=lambda: self.completion.training_done,
            reports_steps=self._reports_steps,
            fail_job=self._fail,
        )
        self.faults = FaultInjector(
            faults,
            self.nodes,
            platform,
            self.sharding,
            self.exits.coordinator,
            self.rollback.catch_up_positions,
            emit,
            save,
            freeze_seconds=default_freeze_seconds(spec.heartbeat_timeout_seconds),
        )
        # Automatic worker scaling and PS migration, when the YAML asks: the autoscaler
        # decides (master.job.autoscaler), the scaler applies.
        self.autoscaler = Autoscaler(self, spec.autoscale) if spec.autoscale.enabled else None
        self.scaler = Scaler(
            spec, store, self.nodes, self.cluster, self.lifecycle, self.ps_changes.migrator,
            self.autoscaler, lambda: self.state.ended, emit, save,
        )  # fmt: skip
        self.interval = CheckpointIntervalTuner(spec.checkpoint_overhead, self.kv, emit)
        self.platform_news = PlatformNews(platform, self.nodes, emit)
        self.kv.add_listener(self.recovery.on_kv)
        self.kv.add_listener(self.standby.on_kv)
        self.kv.add_listener(self._wake_for_ps_change)
        self.kv.add_listener(self._on_agent_event)

    # -- public -------------------------------------------------------------

    @property
    def replicas(self) -> dict[str, int]:
        """How many ranks of each type the job has now (scaling changes it)."""
        return self.cluster.replicas

    @property
    def cluster_version(self) -> int:
        """The TF cluster spec's version: it goes up whenever the spec changes."""
        return self.cluster.version

    @property
    def migrator(self) -> PSMigrator:
        """The PS change in progress, if any (`migrator.active`)."""
        return self.ps_changes.migrator

    @property
    def stuck_note(self) -> str:
        """'possibly stuck: ...' while the job looks stuck, else ''."""
        return self.stuck.note

    def request_scale(
        self, node_type: str, replicas: int, reason: str, timeout: float = 30.0
    ) -> ScaleResult:
        """Ask the control loop to run `replicas` nodes of `node_type`; waits until applied.
        A PS count change checkpoints and restarts the cluster (see master.job.migration)."""
        if node_type == "ps":
            self._refuse_if_ended()
            done = self.ps_changes.request_resize(replicas, reason)
            self._wake_loop()
            result = done.result(max(timeout, PS_RESIZE_TIMEOUT_SECONDS))
            return ScaleResult(result.previous, result.ps_count, self.cluster.version)
        self.scaler.check(node_type, replicas)
        self._refuse_if_ended()
        return self.scaler.request(node_type, replicas, reason).result(timeout)

    def request_migrate(
        self,
        node_type: str,
        rank: int,
        memory_mb: int = 0,
        cpu: float = 0.0,
        reason: str = "",
        timeout: float = 300.0,
    ) -> MigrateResult:
        """Move a PS to new resources (see master.job.migration); waits until the new one runs."""
        self._refuse_if_ended()
        done = self.ps_changes.request_move(node_type, rank, memory_mb, cpu, reason)
        self._wake_loop()
        return done.result(timeout)

    def run(self, resume: bool = False) -> JobState:
        """Launch every node (or, with resume, adopt the nodes of the previous master instance
        recorded in the state store) and run the control loop until the job ends."""
        self._take_epoch()
        self._started = time.monotonic()
        fenced = False
        try:
            if resume:
                self._resume()
            else:
                self._set_state(JobState.RUNNING, "")
                self._save_runtime()
                self.recovery.open(JOB_START, "")
                for node_type in LAUNCH_ORDER:
                    for rank in range(self.replicas[node_type]):
                        self.lifecycle.launch(NodeStart(node_type, rank, relaunches=0))
            while not self.state.ended:
                self._step()
        except MasterFencedError:
            fenced = True
            raise
        except BaseException as e:
            if not self.state.ended:
                self._set_state(JobState.FAILED, f"master error: {e!r}")
            raise
        finally:
            if not fenced:
                self._shutdown()
        return self.state

    def request_stop(self, reason: str) -> None:
        """Ask the control loop to stop the job (Ctrl-C, SIGTERM); safe from any thread."""
        self._stop_request.put(reason)

    def note_global_step(self, step: int) -> None:
        """A node reported the job's global step (it only goes up)."""
        self.recovery.on_step(step)
        self._raise_global_step(step)

    def _raise_global_step(self, step: int) -> None:
        with self._lock:
            if step > self.global_step:
                self.global_step = step

    def note_loss(self, loss: float) -> None:
        """A node reported its step's training loss (charted by the dashboard)."""
        self.last_loss = loss

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def percent_done(self) -> float:
        stats = self.sharding.stats()
        total = sum(s.size * s.epochs for s in stats)
        return 100.0 * sum(s.records_done for s in stats) / total if total else 0.0

    def tf_cluster(self) -> dict[str, list[str]]:
        """The TF cluster of the nodes that run, or of every worker slot when the job reserves
        them (master.job.launch.tf_cluster_spec)."""
        return self.cluster.tf_cluster()

    def catch_up_positions(self) -> int:
        """Apply the positions coalesced reports have not carried yet (see DataRollback)."""
        return self.rollback.catch_up_positions()

    def on_checkpoint_reported(self, checkpoint: Checkpoint) -> None:
        """The chief finished writing a checkpoint (with its ledger snapshots)."""
        self.checkpoints.report(checkpoint)
        # The final checkpoint is the last word on the step: progress reports see each step
        # before it is taken.
        self._raise_global_step(checkpoint.global_step)

    def on_model_restored(self, step: int) -> None:
        """The chief reports each session it creates with the step its model was loaded at
        (dlrover_tf.elastic_model_fn): the data goes back to exactly that step. From then on
        a PS failure waits for this report instead of guessing the step."""
        self.recovery.on_restore(step)
        if self.rollback.note_restore_report():
            self._save_runtime()
        self.rollback.to_restored_step(step)

    def emit(
        self, kind: str, message: str, node: Node | None = None, reason: str = "", **details: Any
    ) -> JobEvent:
        """Record a structured event (kept here, in <run dir>/events.jsonl, and shown live)."""
        event = JobEvent(
            time.time(),
            kind,
            message,
            node_type=node.type if node else str(details.pop("node_type", "")),
            node_rank=node.rank if node else -1,
            node_id=node.id if node else 0,
            reason=reason,
            details=details,
        )
        log.info("%s", message)
        self.event_log.append(event)
        return event

    # -- durability: epochs and resuming ------------------------------------

    def _take_epoch(self) -> None:
        """Become the newest master instance of this job (fencing out any older one)."""
        with self.store.transaction():
            raw = self.store.get(JOB_TABLE, "epoch")
            self.epoch = (int(raw) if raw else 0) + 1
            self.store.put(JOB_TABLE, "epoch", str(self.epoch).encode())

    def _check_fence(self) -> None:
        now = time.monotonic()
        if now < self._next_fence_check:
            return
        self._next_fence_check = now + FENCE_CHECK_SECONDS
        raw = self.store.get(JOB_TABLE, "epoch")
        if raw and int(raw) > self.epoch:
            log.error("master epoch %s took over from this one (%d); stopping", raw, self.epoch)
            raise MasterFencedError(f"master epoch {int(raw)} runs this job now")

    def _save_runtime(self) -> None:
        """Record what a restarted master needs beyond the nodes, ledgers and checkpoints."""
        record = RuntimeRecord(
            replicas=self.cluster.replicas,
            cluster_version=self.cluster.version,
            job_relaunches=self.exits.job_relaunches,
            global_step=self.global_step,
            started_wall=self._started_wall,
            fired_faults=self.faults.fired,
            training_done=self.completion.training_done,
            chief_reports_restores=self.rollback.chief_reports_restores,
            addresses=self.cluster.addresses,
        )
        self.store.put(JOB_TABLE, RUNTIME_KEY, record.to_json())

    def _resume(self) -> None:
        """Continue the job a previous master instance ran: same nodes, ledgers, addresses."""
        raw = self.store.get(JOB_TABLE, RUNTIME_KEY)
        if raw is None:
            raise ValueError(
                "nothing to resume: the state store holds no running job "
                "(start the job without --resume)"
            )
        record = RuntimeRecord.from_json(raw)
        self.cluster.restore(record.replicas, record.cluster_version, record.addresses)
        self.exits.job_relaunches = record.job_relaunches
        self.global_step = record.global_step
        self._started_wall = record.started_wall
        self._started = time.monotonic() - max(0.0, time.time() - self._started_wall)
        self.faults.fired = record.fired_faults
        self.rollback.chief_reports_restores = record.chief_reports_restores
        self.completion.restore(record.training_done)
        if self.runtime.run_dir:
            self.event_log.preload(read_events(self.runtime.run_dir))
        self.state = JobState.RUNNING
        adopted = 0
        for node in self.nodes.restore():
            if node.state.ended:
                continue
            self.lifecycle.adopt(node)
            adopted += 1
        # Torch rendezvous rounds go on with their members (fresh leases from now).
        self.rendezvous.resume()
        self.standby.resume()
        self.ps_changes.resume()
        self.scaler.resume()
        self.nodes.restart_liveness_clocks()
        self.resuming = False
        self.emit(
            "master_restarted",
            f"master restarted (epoch {self.epoch}): adopted {adopted} running nodes, "
            "relaunched none",
        )

    # -- control loop -------------------------------------------------------

    def _wake_loop(self) -> None:
        """Run the control loop's next tick now (it waits on node events between ticks)."""
        self.platform.events.put(None)

    def _wake_for_ps_change(self, key: bytes, value: bytes) -> None:
        """KV listener: an answer the PS change in progress waits for moves it on at once."""
        if self.migrator.awaits(key):
            self._wake_loop()

    def _step(self) -> None:
        self._check_fence()
        try:
            event = self.platform.events.get(timeout=TICK_SECONDS)
        except queue.Empty:
            event = None
        if event is not None:
            self.exits.handle(event)
        try:
            reason = self._stop_request.get_nowait()
            self._set_state(JobState.STOPPED, reason)
            return
        except queue.Empty:
            pass
        training_done = self.completion.training_done
        self.scaler.apply_requests()
        self.migrator.advance()
        # A PS change in progress is a recovery too (it restarts PS processes).
        recovering = self.recovery.recovering() or self.migrator.active is not None
        self.standby.keep(self.global_step > 0, training_done, recovering)
        self.interval.tick(self.global_step)
        self.scaler.autoscale()
        self.health.check()
        self.stuck.check(self.global_step, training_done)
        self.faults.tick(self._progress)
        self.platform_news.tick()
        self.completion.check()

    def _progress(self) -> JobProgress:
        return JobProgress(self.percent_done(), self.elapsed(), self.global_step)

    def _reports_steps(self) -> bool:
        """Some trainer of the job reports its steps (a program with our hooks)."""
        return self.global_step > 0 or any(n.steps > 0 for n in self.nodes.all_current())

    def _on_launched(self, node: Node) -> None:
        if node.type == "ps":
            self.recovery.mark(RecoveryPhase.PS_STARTED)
        self._save_runtime()

    def _on_training_done(self) -> None:
        self.faults.report_unfired(reports_progress=bool(self.global_step or self.sharding.stats()))

    def _refuse_if_ended(self) -> None:
        if self.state.ended:
            raise ValueError(f"the job has already ended ({self.state.value})")

    def _fail(self, reason: str) -> None:
        self._set_state(JobState.FAILED, reason)

    def _shutdown(self) -> None:
        self.wall_seconds = self.elapsed()
        try:
            self.platform.shutdown(STOP_GRACE_SECONDS)
        finally:
            # Record the end of everything the platform stopped.
            while True:
                try:
                    event = self.platform.events.get_nowait()
                except queue.Empty:
                    break
                if event is not None:  # None: a wake-up (_wake_loop)
                    self.exits.handle(event)
            for node in self.nodes.all_current():
                if not node.state.ended:
                    self.nodes.mark_exited(node.id, -signal.SIGTERM, ExitReason.STOPPED)
            self.sharding.close()
            self.kv.close()  # a node's KV wait still open must not hold the master's exit

    def _set_state(self, state: JobState, reason: str) -> None:
        self.state = state
        self.reason = reason
        self.store.put(
            JOB_TABLE, "status", json.dumps({"state": state.value, "reason": reason}).encode()
        )
        if state.ended:
            self.emit(
                "job_" + state.value, f"job {state.value}" + (f": {reason}" if reason else "")
            )
            self.migrator.abort(f"the job {state.value} before the change was made")

    def _on_agent_event(self, key: bytes, value: bytes) -> None:
        """KV listener: a torch node agent reported an event (from an RPC thread)."""
        event = agent_event(key, value)
        if event is not None:
            node = self.nodes.current("worker", event.node_rank)
            name = node.name if node else f"node rank {event.node_rank}"
            self.emit(
                "agent", f"{name}: [{event.kind}] {event.reason}", node, event.kind,
                **event.details,
            )  # fmt: skip

    def _on_rendezvous_round(self, run_id: str, closed: Round) -> None:
        """A torch rendezvous round closed (from an RPC thread): an event naming its members."""
        members = [f"{m.type}-{m.rank}" for m in closed.members]
        self.emit(
            "rendezvous_round",
            f"rendezvous {run_id!r}: round {closed.number} closed with {len(members)} nodes "
            f"({', '.join(members)})",
            reason="round_closed",
            run_id=run_id,
            round=closed.number,
            members=members,
            processes=sum(m.local_world_size for m in closed.members),
        )
