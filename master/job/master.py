"""The job master: launches nodes, reacts to their exits, and decides when the job ends.

`JobMaster` owns the job's state and its control loop; each concern's policies are pure
functions in their own module (launch, completion, exits, health, scaling, ps_change,
rollback, faults), and the part of the job that applies them is a mixin beside them."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from master.config import NODE_TYPES, JobSpec
from master.job.autoscaler import Autoscaler
from master.job.checkpoint_interval import CheckpointIntervalMixin
from master.job.checkpoints import Checkpoint, CheckpointRegistry
from master.job.completion import JOB_DONE, decide_completion, success_reason
from master.job.events import EVENTS_FILE, EventLog, JobEvent, read_events
from master.job.exits import NodeExitMixin
from master.job.faults import Fault, FaultInjectionMixin
from master.job.health import HealthMixin
from master.job.launch import LaunchMixin, tf_cluster_spec
from master.job.migration import MigrateResult, PSMigrator
from master.job.model import (
    STOP_GRACE_SECONDS,
    JobRuntime,
    JobState,
    MasterFencedError,
    ScaleResult,
)
from master.job.ps_change import PS_RESIZE_TIMEOUT_SECONDS, PSChangeMixin
from master.job.ps_standby import PSStandbyMixin
from master.job.recovery_timeline import (
    JOB_START,
    PS_MIGRATION,
    PS_RESIZE,
    RecoveryTimelineMixin,
)
from master.job.rollback import MODEL_RESTORED, RollbackMixin
from master.job.runtime_record import RUNTIME_KEY, RuntimeRecord
from master.job.scaling import AUTOSCALE_KEY, ScalingMixin, check_scale_request
from master.job.stuck import StuckMixin
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


class JobMaster(
    LaunchMixin,
    NodeExitMixin,
    HealthMixin,
    StuckMixin,
    ScalingMixin,
    PSChangeMixin,
    RollbackMixin,
    FaultInjectionMixin,
    RecoveryTimelineMixin,
    PSStandbyMixin,
    CheckpointIntervalMixin,
):
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
        # "unavailable, retry" rather than "unknown node" (see master.rpc.server._guard).
        self.resuming = resuming
        self.spec = spec
        self.platform = platform
        self.store = store
        self.runtime = runtime
        self.nodes = NodeManager(store)
        self.sharding = ShardingService(store)
        self.progress_streams = StreamRegistry()
        self.checkpoints = CheckpointRegistry(store)
        # Torch rendezvous rounds; each closed round is a job event.
        self.rendezvous = RendezvousService(
            store, on_round=self._on_rendezvous_round, describe_silent=self._silent_node_cause
        )
        self.kv = KVStore(store)  # behind the torch Store of the agents
        self._init_timelines()
        self.kv.add_listener(self._timeline_on_kv)
        self._init_standby()
        self.kv.add_listener(self._standby_ready)
        self.kv.add_listener(self._wake_for_ps_change)
        self._init_checkpoint_interval()
        self.state = JobState.PENDING
        self.reason = ""
        self.global_step = 0
        self.last_loss: float | None = None  # the latest training loss a node reported
        self.event_log = EventLog(
            os.path.join(runtime.run_dir, EVENTS_FILE) if runtime.run_dir else ""
        )
        self.events: list[JobEvent] = self.event_log.events
        if on_event:
            self.event_log.add_listener(on_event)
        self._stragglers_checked_at = 0.0
        self._hang_clock_from = 0.0
        # Stuck detection (master.job.stuck): CPU samples, the current quiet spell, its note.
        self._cpu_samples: dict[int, tuple[float, float]] = {}
        self._measured_cpu: dict[int, float] = {}
        self._cpu_sampled_at = 0.0
        self._quiet_since: float | None = None
        self._quiet_step = 0
        self.stuck_note = ""  # "possibly stuck: ..." while the job looks stuck
        # Automatic worker scaling and PS migration (master.job.autoscaler), when the YAML asks:
        # it decides, this job applies (master.job.scaling).
        self.autoscaler = Autoscaler(self, spec.autoscale) if spec.autoscale.enabled else None
        self._faults = list(faults)  # given at submit; _fired_faults says which already fired
        self._job_relaunches = 0
        self._ps_losses: dict[str, float] = {}  # PS name -> when it was last lost (monotonic)
        self._started = time.monotonic()
        self._training_done_at: float | None = None
        self._stop_request: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._scale_requests: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._replicas = {t: spec.group(t).replicas for t in NODE_TYPES}
        self.cluster_version = 1
        self._lock = threading.Lock()
        self.wall_seconds = 0.0
        self.epoch = 0  # this master instance's number; a restarted master takes the next
        self._started_wall = time.time()
        self._fired_faults: list[int] = []  # indices into the faults given at submit
        self._faults_waiting: dict[int, float] = {}
        self._kept_datasets: set[str] = set()
        self._addresses: dict[tuple[str, int], str] = {}
        self._next_fence_check = 0.0
        self._chief_reports_restores = False
        # A PS was lost and the chief's restore report will roll the data back: that rollback
        # is reported even when it moves nothing (the checkpoint was where the data was).
        self._restore_after_ps_loss = False
        self.migrator = PSMigrator(
            self.kv,
            self.nodes.current,
            self._running_workers,
            self._retire_node,
            self.emit,
            stop_cluster=self._stop_for_ps_change,
            start_cluster=self._start_after_ps_change,
            save=self._save_ps_change,
            on_phase=self._mark_phase,
        )

    # -- public -------------------------------------------------------------

    @property
    def replicas(self) -> dict[str, int]:
        """How many ranks of each type the job has now (scaling changes it)."""
        return dict(self._replicas)

    def request_scale(
        self, node_type: str, replicas: int, reason: str, timeout: float = 30.0
    ) -> ScaleResult:
        """Ask the control loop to run `replicas` nodes of `node_type`; waits until applied.
        A PS count change checkpoints and restarts the cluster (see master.job.migration)."""
        if node_type == "ps":
            if self.state.ended:
                raise ValueError(f"the job has already ended ({self.state.value})")
            self._refuse_ps_change_under_keras()
            done = self.migrator.request_resize(replicas, self._replicas["ps"], reason)
            self._open_timeline(PS_RESIZE, f"ps {self._replicas['ps']} -> {replicas}")
            self._wake_loop()
            result = done.result(max(timeout, PS_RESIZE_TIMEOUT_SECONDS))
            return ScaleResult(result.previous, result.ps_count, self.cluster_version)
        check_scale_request(self.spec, node_type, replicas, self._replicas["chief"])
        if self.state.ended:
            raise ValueError(f"the job has already ended ({self.state.value})")
        done: Future = Future()
        self._scale_requests.put((node_type, replicas, reason, done))
        return done.result(timeout)

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
        if self.state.ended:
            raise ValueError(f"the job has already ended ({self.state.value})")
        self._refuse_ps_change_under_keras()
        done = self.migrator.request(
            node_type, rank, memory_mb, cpu, reason, self._replicas.get(node_type, 0)
        )
        self._open_timeline(PS_MIGRATION, f"{node_type}-{rank}")
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
                self._open_timeline(JOB_START, "")
                for node_type in LAUNCH_ORDER:
                    for rank in range(self.replicas[node_type]):
                        self._launch(node_type, rank, relaunches=0)
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
        self._timeline_on_step(step)
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
        return tf_cluster_spec(self.spec, self.replicas, self._address)

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
        self._timeline_on_restore(step)
        first = not self._chief_reports_restores
        self._chief_reports_restores = True
        if first:
            self._save_runtime()
        after_ps_loss, self._restore_after_ps_loss = self._restore_after_ps_loss, False
        if step == 0 and all(s.records_done == 0 for s in self.sharding.stats()):
            return  # a fresh start: nothing to go back from
        self._rollback_data(step, reason=MODEL_RESTORED, report_unchanged=after_ps_loss)

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

    _emit = emit

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
            replicas=self._replicas,
            cluster_version=self.cluster_version,
            job_relaunches=self._job_relaunches,
            global_step=self.global_step,
            started_wall=self._started_wall,
            fired_faults=self._fired_faults,
            training_done=self._training_done_at is not None,
            chief_reports_restores=self._chief_reports_restores,
            addresses=self._addresses,
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
        self._replicas.update(record.replicas)
        self.cluster_version = record.cluster_version
        self._job_relaunches = record.job_relaunches
        self.global_step = record.global_step
        self._started_wall = record.started_wall
        self._started = time.monotonic() - max(0.0, time.time() - self._started_wall)
        self._fired_faults = record.fired_faults
        self._chief_reports_restores = record.chief_reports_restores
        if record.training_done:
            self._training_done_at = time.monotonic()
        self._addresses = record.addresses
        self.platform.restore_addresses(dict(self._addresses))
        if self.runtime.run_dir:
            self.event_log.preload(read_events(self.runtime.run_dir))
        self.state = JobState.RUNNING
        adopted = 0
        for node in self.nodes.restore():
            if node.state.ended:
                continue
            self.platform.adopt(self._launch_spec(node), node.platform_handle)
            adopted += 1
        # Torch rendezvous rounds go on with their members (fresh leases from now).
        self.rendezvous.resume()
        self._resume_standby()
        self._resume_ps_change()
        raw = self.store.get(JOB_TABLE, AUTOSCALE_KEY)
        if raw is not None and self.autoscaler is not None:
            self.autoscaler.restore(json.loads(raw))
        self.nodes.restart_liveness_clocks()
        self.resuming = False
        self._emit(
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
            self._on_node_exit(event)
        try:
            reason = self._stop_request.get_nowait()
            self._set_state(JobState.STOPPED, reason)
            return
        except queue.Empty:
            pass
        self._apply_scale_requests()
        self.migrator.advance()
        self._keep_standby()
        self._tune_checkpoint_interval()
        self._autoscale()
        self._check_health()
        self._check_stuck()
        self._inject_faults()
        self._check_completion()

    def _check_completion(self) -> None:
        now = time.monotonic()
        decision = decide_completion(
            self.nodes.all_current(),
            self.replicas,
            self._training_done_at,
            now,
            self.spec.evaluator_grace_seconds,
            self.spec.success_policy,
            data_done=self._training_done_at is not None and self._data_done(),
        )
        reason = success_reason(self.spec.success_policy, self.replicas)
        if decision.training_done:
            self._training_done_at = now
            self._save_runtime()
            self._emit("training_done", reason)
            self._report_unfired_faults()
        for node in decision.stop:
            self._stop_node(node, JOB_DONE)
        if decision.succeeded:
            self._set_state(JobState.SUCCEEDED, reason)

    def _data_done(self) -> bool:
        """The job has datasets and every one is finished."""
        stats = self.sharding.stats()
        return bool(stats) and all(s.finished for s in stats)

    def _stop_node(self, node: Node, cause: str = "") -> None:
        """Stop a node gracefully (SIGTERM, a grace period, SIGKILL); `cause` is said with
        its end ("stopped: job done")."""
        if cause:
            node.stop_cause = cause
        node.stop_requested = True
        self.nodes.save(node)
        self.platform.stop_node(node.id, STOP_GRACE_SECONDS)

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
                    self._on_node_exit(event)
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
            self._emit(
                "job_" + state.value, f"job {state.value}" + (f": {reason}" if reason else "")
            )
            self.migrator.abort(f"the job {state.value} before the change was made")

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
