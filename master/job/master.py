"""The job master: launches nodes, reacts to their exits, and decides when the job ends."""

from __future__ import annotations

import enum
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from master.client import (
    COORDINATOR_KEY,
    ENV_JOB_TOKEN_FILE,
    ENV_MASTER_ADDR,
    ENV_NODE_ID,
    ENV_NODE_RANK,
    ENV_NODE_TYPE,
)
from master.client.position import decode_positions
from master.config import NODE_TYPES, JobSpec
from master.job.autoscaler import AutoscaleExecutor
from master.job.checkpoints import Checkpoint, CheckpointRegistry
from master.job.diagnosis import Diagnosis, diagnose_exit, find_stragglers
from master.job.events import EVENTS_FILE, EventLog, JobEvent, read_events
from master.job.faults import MASTER, Fault, due
from master.job.migration import CLUSTER_TYPES, MigrateResult, PSMigrator
from master.kv.store import KVStore
from master.nodes.manager import NodeManager
from master.nodes.model import TRAINING_TYPES, ExitReason, Node, NodeState
from master.nodes.policy import (
    Action,
    JobOutcome,
    decide_on_exit,
    is_hung,
    training_finished,
)
from master.platform.api import POSITIONS_DETAIL, NodeEvent, NodeLaunchSpec, Platform
from master.rendezvous.rounds import Round
from master.rendezvous.service import RendezvousService
from master.sharding.service import ShardingService
from master.sharding.streams import StreamRegistry
from master.state.api import StateStore
from master.state.job_record import JOB_TABLE

log = logging.getLogger(__name__)

TICK_SECONDS = 0.2
# How long a node's end waits for the reports it already sent before its shards go back.
STREAM_DRAIN_SECONDS = 2.0
STOP_GRACE_SECONDS = 5.0
LAUNCH_ORDER = ("ps", "chief", "worker", "evaluator")
SCALABLE_TYPES = ("worker", "evaluator")
PS_CHANGE_KEY = "ps_change"  # the PS move or count change in progress
AUTOSCALE_KEY = "autoscale"  # the auto-scaler's measurements
PS_RESIZE_TIMEOUT_SECONDS = 300.0  # pause, checkpoint, and every TF process stopped
MAX_REPLICAS = 1024
# How often the control loop checks that no newer master instance has taken over.
FENCE_CHECK_SECONDS = 1.0
STRAGGLER_CHECK_SECONDS = 5.0


class MasterFencedError(RuntimeError):
    """A newer master instance runs this job: this one must not act any more."""


class JobState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def ended(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


@dataclass(frozen=True)
class ScaleResult:
    """What a scale request changed."""

    previous: int
    replicas: int
    cluster_version: int


@dataclass
class JobRuntime:
    """Where a job run keeps its files, and how nodes reach the master."""

    run_dir: str
    master_addr: str
    token_file: str
    dashboard_url: str = ""  # the master's HTTP dashboard (/metrics beneath it), once serving
    node_env: dict[str, str] = field(default_factory=dict)  # e.g. the TLS files nodes use


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
        self.rendezvous = RendezvousService(store, on_round=self._on_rendezvous_round)
        self.kv = KVStore(store)  # behind the torch Store of the agents
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
        # Automatic worker scaling and PS migration (master.job.autoscaler), when the YAML asks.
        self.autoscaler = (
            AutoscaleExecutor(self, spec.autoscale) if spec.autoscale.enabled else None
        )
        self._faults = list(faults)  # given at submit; _fired_faults says which already fired
        self._job_relaunches = 0
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
        self._addresses: dict[tuple[str, int], str] = {}
        self._next_fence_check = 0.0
        self._chief_reports_restores = False
        self.migrator = PSMigrator(
            self.kv,
            self.nodes.current,
            self._running_workers,
            self._retire_node,
            self.emit,
            stop_cluster=self._stop_for_ps_change,
            start_cluster=self._start_after_ps_change,
            save=self._save_ps_change,
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
            result = done.result(max(timeout, PS_RESIZE_TIMEOUT_SECONDS))
            return ScaleResult(result.previous, result.ps_count, self.cluster_version)
        if node_type not in SCALABLE_TYPES:
            raise ValueError(
                f"cannot scale {node_type!r} at run time; scalable types: "
                f"{', '.join(('ps', *SCALABLE_TYPES))}"
            )
        if not 0 <= replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be in [0, {MAX_REPLICAS}], got {replicas}")
        slots = self.spec.group(node_type).slots
        if node_type == "worker" and replicas > slots:
            raise ValueError(
                f"worker.max_replicas is {slots}: the TF cluster spec has {slots} worker slots. "
                "Raise worker.max_replicas in the job YAML (it takes effect on the next run)"
            )
        if node_type == "worker" and replicas == 0 and self._replicas["chief"] == 0:
            raise ValueError("the job has no chief: scaling workers to 0 would stop training")
        if self.state.ended:
            raise ValueError(f"the job has already ended ({self.state.value})")
        done: Future = Future()
        self._scale_requests.put((node_type, replicas, reason, done))
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
        with self._lock:
            if step > self.global_step:
                self.global_step = step

    def note_loss(self, loss: float) -> None:
        """A node reported its step's training loss (charted by the dashboard)."""
        self.last_loss = loss

    def elapsed(self) -> float:
        return time.monotonic() - self._started

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
        record = {
            "replicas": self._replicas,
            "cluster_version": self.cluster_version,
            "job_relaunches": self._job_relaunches,
            "global_step": self.global_step,
            "started_wall": self._started_wall,
            "fired_faults": self._fired_faults,
            "training_done": self._training_done_at is not None,
            "chief_reports_restores": self._chief_reports_restores,
            "addresses": [[t, r, a] for (t, r), a in sorted(self._addresses.items())],
        }
        self.store.put(JOB_TABLE, "runtime", json.dumps(record).encode())

    def _resume(self) -> None:
        """Continue the job a previous master instance ran: same nodes, ledgers, addresses."""
        raw = self.store.get(JOB_TABLE, "runtime")
        if raw is None:
            raise ValueError(
                "nothing to resume: the state store holds no running job "
                "(start the job without --resume)"
            )
        record = json.loads(raw)
        self._replicas.update(record["replicas"])
        self.cluster_version = record["cluster_version"]
        self._job_relaunches = record["job_relaunches"]
        self.global_step = record["global_step"]
        self._started_wall = record["started_wall"]
        self._started = time.monotonic() - max(0.0, time.time() - self._started_wall)
        self._fired_faults = list(record["fired_faults"])
        self._chief_reports_restores = record.get("chief_reports_restores", False)
        if record["training_done"]:
            self._training_done_at = time.monotonic()
        self._addresses = {(t, int(r)): a for t, r, a in record["addresses"]}
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
        self._resume_ps_change()
        raw = self.store.get(JOB_TABLE, AUTOSCALE_KEY)
        if raw is not None and self.autoscaler is not None:
            self.autoscaler.restore(json.loads(raw))
        self.resuming = False
        self._emit(
            "master_restarted",
            f"master restarted (epoch {self.epoch}): adopted {adopted} running nodes, "
            "relaunched none",
        )

    # -- control loop -------------------------------------------------------

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
        if self.autoscaler is not None:
            self.autoscaler.tick()
        self._check_heartbeats()
        self._check_hangs()
        self._check_stragglers()
        self._inject_faults()
        self._check_completion()

    def _launch(
        self, node_type: str, rank: int, relaunches: int, memory_mb: int = 0, cpu: float = 0.0
    ) -> Node:
        group = self.spec.group(node_type)
        node = self.nodes.new_incarnation(node_type, rank, relaunches, memory_mb or group.memory_mb)
        node.cpu = cpu or group.cpu
        address = self._address(node_type, rank)
        log_path = os.path.join(self.runtime.run_dir, "logs", f"{node.name}.{node.id}.log")
        launch = NodeLaunchSpec(
            type=node_type,
            rank=rank,
            id=node.id,
            command=self._command(node_type),
            env=self._env(node),
            workdir=self.spec.workdir,
            log_path=log_path,
            cpu=node.cpu,
            memory_mb=node.memory_mb,
        )
        self.platform.launch(launch)
        self.nodes.mark_running(node.id, address, log_path, self.platform.handle(node.id))
        self._save_runtime()
        self._emit(
            "node_running",
            f"{node.name} (id {node.id}) launched at {address}",
            node,
            relaunches=relaunches,
            memory_mb=node.memory_mb,
        )
        return node

    def _launch_spec(self, node: Node) -> NodeLaunchSpec:
        """What a platform needs to adopt a node a previous master started."""
        group = self.spec.group(node.type)
        return NodeLaunchSpec(
            type=node.type,
            rank=node.rank,
            id=node.id,
            command=self._command(node.type),
            env={},
            workdir=self.spec.workdir,
            log_path=node.log_path,
            cpu=node.cpu or group.cpu,
            memory_mb=node.memory_mb,
        )

    def _address(self, node_type: str, rank: int) -> str:
        """The node address for (type, rank), remembered so a restarted master keeps it."""
        key = (node_type, rank)
        if key not in self._addresses:
            self._addresses[key] = self.platform.address_for(node_type, rank)
        return self._addresses[key]

    def _command(self, node_type: str) -> tuple[str, ...]:
        group = self.spec.group(node_type)
        if group.command:
            command = group.command
        elif node_type == "ps":
            command = ("python", "-m", "dlrover_tf.ps")
        else:
            command = self.spec.command
        if command and command[0] in ("python", "python3"):
            command = (sys.executable, *command[1:])
        return tuple(command)

    def tf_cluster(self) -> dict[str, list[str]]:
        """The TF cluster: every worker slot is listed, so PS can reach workers added later."""
        cluster = {}
        for node_type in ("ps", "chief", "worker"):
            n = self.spec.worker.slots if node_type == "worker" else self.replicas[node_type]
            if n:
                cluster[node_type] = [self._address(node_type, r) for r in range(n)]
        return cluster

    def _env(self, node: Node) -> dict[str, str]:
        env = dict(os.environ) if self.platform.inherits_master_env else {}
        env.update(self.spec.env)
        env.update(self.spec.group(node.type).env)
        env.update(
            {
                ENV_MASTER_ADDR: self.runtime.master_addr,
                **self.runtime.node_env,
                ENV_JOB_TOKEN_FILE: self.runtime.token_file,
                ENV_NODE_TYPE: node.type,
                ENV_NODE_RANK: str(node.rank),
                ENV_NODE_ID: str(node.id),
                "DLROVER_JOB_NAME": self.spec.name,
                "DLROVER_RUN_DIR": self.runtime.run_dir,
                "DLROVER_MODEL_DIR": os.path.join(self.runtime.run_dir, "model"),
                "PYTHONUNBUFFERED": "1",
                "TF_CONFIG": json.dumps(
                    {
                        "cluster": self.tf_cluster(),
                        "task": {"type": node.type, "index": node.rank},
                        "environment": "cloud",
                    }
                ),
            }
        )
        env.pop("DLROVER_JOB_TOKEN", None)  # the token travels as a file only
        return env

    def _on_node_exit(self, event: NodeEvent) -> None:
        node = self.nodes.get(event.id)
        if node is None or node.state.ended:
            return
        # Reports the node wrote before it died are still arriving on its stream: apply them
        # first, so only what it really did not consume is re-queued.
        if not self.progress_streams.wait_closed(node.id, STREAM_DRAIN_SECONDS):
            log.warning("%s id=%d: progress stream still open after its end", node.name, node.id)
        # Steps its coalesced reports had not carried yet: the platform read them back.
        self.sharding.apply_positions(
            node.id, decode_positions(event.details.get(POSITIONS_DETAIL, ""))
        )
        reported = node.extra.get("reported_exit")
        diagnosis = self._diagnose(node, event)
        reason = diagnosis.reason
        message = reported[1] if reported and reported[1] else event.message
        node = self.nodes.mark_exited(event.id, event.exit_code, reason, message)
        if node is None:
            return
        node.extra["diagnosis"] = diagnosis
        requeued = self.sharding.release_everywhere(node.id)
        if reason not in (ExitReason.SUCCEEDED, ExitReason.STOPPED):
            # Torch agents in a rendezvous round with it re-form without waiting for its lease.
            self.rendezvous.node_died((node.type, node.rank), node.id)
        if reason in (ExitReason.SUCCEEDED, ExitReason.STOPPED):
            log.info("%s id=%d ended: %s", node.name, node.id, reason.value)
            self._emit(
                "node_exited",
                f"{node.name} (id {node.id}) {reason.value}",
                node,
                reason.value,
                exit_code=event.exit_code,
            )
        else:
            more = f"; {sum(requeued.values())} unconsumed records re-queued" if requeued else ""
            self._emit(
                "node_failed",
                f"{node.name} (id {node.id}) {reason.value}, exit code {event.exit_code}{more}",
                node,
                reason.value,
                exit_code=event.exit_code,
                diagnosis=diagnosis.summary,
                excerpt=diagnosis.excerpt,
                deterministic=diagnosis.deterministic,
                records_requeued=sum(requeued.values()),
            )
        migration = self.migrator.on_exit(node)
        if migration is not None and migration.ps_count:
            return  # stopped for a PS count change, which starts the new cluster itself
        if migration is not None:
            self._complete_move(node, migration)
            return
        if node.type == "ps" and reason != ExitReason.STOPPED and self._training_done_at is None:
            if self._chief_reports_restores:
                self._free_held_shards()  # the chief's restore report rolls the data back
            else:
                self._rollback_data()
            self._restart_coordinator(node)
        if node.extra.get("coordinator_restart"):
            # Restarted by the master for a PS loss (TF2 PS training): no budget is used.
            new = self._launch(node.type, node.rank, node.relaunches)
            self._emit(
                "relaunch",
                f"{node.name} restarted to restore from the latest checkpoint after a PS loss "
                f"(no budget used): {new.name} is now id {new.id}",
                new,
                "ps_lost",
                previous_id=node.id,
            )
            return
        decision = decide_on_exit(
            node,
            reason,
            max_relaunches_per_rank=self.spec.group(node.type).max_relaunches,
            job_relaunches_used=self._job_relaunches,
            job_relaunch_budget=self.spec.max_relaunches,
            job_ending=self._training_done_at is not None and node.type in ("ps", "evaluator"),
            deterministic=diagnosis.deterministic,
        )
        if decision.action == Action.RELAUNCH:
            self._job_relaunches += 1
            new = self._launch(node.type, node.rank, node.relaunches + 1, decision.memory_mb)
            self._emit(
                "relaunch",
                f"{decision.reason}: {new.name} is now id {new.id}",
                new,
                reason.value,
                previous_id=node.id,
                memory_mb=new.memory_mb,
                job_relaunches=self._job_relaunches,
            )
        elif decision.action == Action.FAIL_JOB:
            if diagnosis.deterministic and diagnosis.excerpt:
                detail = f"\n{diagnosis.excerpt}"
            else:
                tail = _last_line(node.exit_message)
                detail = f" (last log line: {tail})" if tail else ""
            self._set_state(JobState.FAILED, decision.reason + detail)

    def _diagnose(self, node: Node, event: NodeEvent) -> Diagnosis:
        """Why a node ended: master-side verdicts first, else the rules in master.job.diagnosis."""
        if node.extra.get("heartbeat_lost"):
            return Diagnosis(ExitReason.HEARTBEAT_LOST, "no heartbeat")
        if node.extra.get("hung"):
            return Diagnosis(ExitReason.HANG, "no step while holding shards")
        if node.extra.get("straggler_replaced"):
            return Diagnosis(ExitReason.STRAGGLER, "replaced as a straggler")
        reported = node.extra.get("reported_exit")
        tail = "\n".join(t for t in (event.message, reported[1] if reported else "") if t)
        return diagnose_exit(
            event.exit_code,
            tail,
            oom_killed=event.oom_killed,
            stop_requested=node.stop_requested or self.state.ended,
            reported=reported[0] if reported else None,
            # Only training nodes report steps; others are never taken as failing at start-up.
            started=node.steps > 0 or node.type not in TRAINING_TYPES,
            memory_limit_mb=node.memory_mb or node.extra.get("memory_limit_bytes", 0) // 2**20,
            last_rss_bytes=node.memory_rss_bytes,
        )

    def _check_stragglers(self) -> None:
        """Report (and with `stragglers: replace`, replace) workers far slower than peers."""
        now = time.monotonic()
        if (
            self.spec.stragglers == "off"
            or now - self._stragglers_checked_at < STRAGGLER_CHECK_SECONDS
        ):
            return
        self._stragglers_checked_at = now
        measured = {
            n.id: n
            for n in self.nodes.all_current()
            if n.type in TRAINING_TYPES
            and n.state == NodeState.RUNNING
            and n.steps >= self.spec.straggler_min_steps
        }
        slow = find_stragglers({i: n.step_seconds for i, n in measured.items()})
        for node_id, factor in slow.items():
            node = measured[node_id]
            if node.extra.get("straggler"):
                continue
            node.extra["straggler"] = True
            replace = self.spec.stragglers == "replace"
            self._emit(
                "straggler",
                f"{node.name} (id {node.id}) is a straggler: {node.step_seconds * 1000:.0f} ms "
                f"per step, {factor:.1f}x its peers' median"
                + ("; replacing it" if replace else ""),
                node,
                "straggler",
                step_seconds=round(node.step_seconds, 4),
                slowdown=round(factor, 2),
                action="replace" if replace else "report",
            )
            if replace:
                node.extra["straggler_replaced"] = True
                if not self.platform.signal_node(node.id, signal.SIGKILL):
                    self._on_node_exit(NodeEvent(node.type, node.rank, node.id, exit_code=-9))

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
        return done.result(timeout)

    def _refuse_ps_change_under_keras(self) -> None:
        if self.kv.check([COORDINATOR_KEY]):
            raise ValueError(
                "this job trains with TF2 ParameterServerStrategy (dlrover_tf.keras_ps), whose "
                "coordinator cannot move to a new PS set while it trains: moving a PS or "
                "changing the PS count is for tf.estimator jobs. Change the ps group in the job "
                "YAML and resubmit (training resumes from the latest checkpoint)"
            )

    def on_checkpoint_reported(self, checkpoint: Checkpoint) -> None:
        """The chief finished writing a checkpoint (with its ledger snapshots)."""
        self.checkpoints.report(checkpoint)

    def on_model_restored(self, step: int) -> None:
        """The chief reports each session it creates with the step its model was loaded at
        (dlrover_tf.elastic_model_fn): the data goes back to exactly that step. From then on
        a PS failure waits for this report instead of guessing the step."""
        first = not self._chief_reports_restores
        self._chief_reports_restores = True
        if first:
            self._save_runtime()
        if step == 0 and all(s.records_done == 0 for s in self.sharding.stats()):
            return  # a fresh start: nothing to go back from
        self._rollback_data(step, reason="model_restored")

    def _restart_coordinator(self, ps: Node) -> None:
        """TF2 PS training (dlrover_tf.keras_ps): the coordinator (the chief) cannot rebuild
        the variables a lost PS held, so it is restarted and restores the latest checkpoint."""
        chief = self.nodes.current("chief", 0)
        if chief is None or chief.state.ended or not self.kv.check([COORDINATOR_KEY]):
            return
        chief.extra["coordinator_restart"] = True
        log.info("%s lost: restarting the coordinator %s (id %d)", ps.name, chief.name, chief.id)
        if not self.platform.signal_node(chief.id, signal.SIGKILL):
            self._on_node_exit(NodeEvent(chief.type, chief.rank, chief.id, exit_code=-9))

    def _free_held_shards(self) -> None:
        """The model is lost until the chief restores it: every trainer's held shards go back
        to the queue now. Their input pipelines, blocked waiting for a shard while the others
        hold the rest, then yield, so the failed sessions can close and be rebuilt (TF waits
        for running input ops when it closes a session)."""
        for node in self.nodes.all_current():
            if node.type in TRAINING_TYPES:
                self.sharding.release_everywhere(node.id)

    def _rollback_data(self, step: int | None = None, reason: str = "ps_failed") -> None:
        """The model goes back to a checkpoint (a PS lost its variables, or the chief restored
        one), so every dataset goes back to the position saved with it. Without a step: the
        latest checkpoint the master knows of (or the start if none exists)."""
        if step is None:
            latest = self.checkpoints.latest()
            step = latest.global_step if latest else 0
        done = {s.name: s.records_done for s in self.sharding.stats()}
        for name in self.sharding.names():
            self.sharding.restore_snapshot(name, step)
        for s in self.sharding.stats():
            if done[s.name] == s.records_done and reason == "model_restored":
                continue
            self._emit(
                "rollback",
                f"dataset {s.name}: back to the position of checkpoint step {step} "
                f"({done[s.name] - s.records_done:,} records to train again)",
                reason=reason,
                dataset=s.name,
                checkpoint_step=step,
                records_to_redo=done[s.name] - s.records_done,
            )

    def _check_heartbeats(self) -> None:
        for node in self.nodes.lost_heartbeats(self.spec.heartbeat_timeout_seconds):
            if node.extra.get("heartbeat_lost"):
                continue
            node.extra["heartbeat_lost"] = True
            self._emit(
                "heartbeat_lost",
                f"{node.name} (id {node.id}) sent no heartbeat for "
                f"{self.spec.heartbeat_timeout_seconds:g}s; killing it",
                node,
                "heartbeat_lost",
                timeout_seconds=self.spec.heartbeat_timeout_seconds,
            )
            if not self.platform.signal_node(node.id, signal.SIGKILL):
                self._on_node_exit(NodeEvent(node.type, node.rank, node.id, exit_code=-9))

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
        self._replicas[node_type] = replicas
        if node_type != "evaluator":
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
        for rank in range(previous, replicas):
            node = self.nodes.current(node_type, rank)
            relaunches = node.relaunches + 1 if node is not None else 0
            self._launch(node_type, rank, relaunches)
        for rank in range(replicas, previous):
            node = self.nodes.current(node_type, rank)
            if node is not None and not node.state.ended:
                # Its unconsumed records go back to todo when it has ended (_on_node_exit).
                self._stop_node(node)
        return ScaleResult(previous, replicas, self.cluster_version)

    def _check_hangs(self) -> None:
        timeout = self.spec.hang_timeout_seconds
        if timeout <= 0:
            return
        now = time.monotonic()
        for node in self.nodes.all_current():
            if node.extra.get("hung") or not is_hung(
                node, now, timeout, self.sharding.holds_shards(node.id)
            ):
                continue
            node.extra["hung"] = True
            self._emit(
                "hang",
                f"{node.name} (id {node.id}) holds shards but made no step for {timeout:g}s; "
                "restarting it",
                node,
                "hang",
                timeout_seconds=timeout,
                steps=node.steps,
            )
            if not self.platform.signal_node(node.id, signal.SIGKILL):
                self._on_node_exit(NodeEvent(node.type, node.rank, node.id, exit_code=-9))

    def percent_done(self) -> float:
        stats = self.sharding.stats()
        total = sum(s.size * s.epochs for s in stats)
        return 100.0 * sum(s.records_done for s in stats) / total if total else 0.0

    def _inject_faults(self) -> None:
        if len(self._fired_faults) == len(self._faults):
            return
        pct, secs = self.percent_done(), self.elapsed()
        for i, fault in enumerate(self._faults):
            if i in self._fired_faults or not due(fault, pct, secs, self.global_step):
                continue
            # Recorded before it acts, so a restarted master never fires it again.
            self._fired_faults.append(i)
            self._save_runtime()
            if fault.node_type == MASTER:
                self._kill_self(fault)
                continue
            node = self.nodes.current(fault.node_type, fault.rank)
            if node is None or node.state != NodeState.RUNNING:
                self._emit(
                    "fault", f"fault injection: {fault.describe()}: node not running, skipped"
                )
                continue
            self._emit(
                "fault",
                f"fault injection: {fault.describe()} (id {node.id}, at global step "
                f"{self.global_step})",
                node,
                "fault_injection",
                signal=int(fault.signal),
                global_step=self.global_step,
            )
            self.platform.signal_node(node.id, fault.signal)

    def _kill_self(self, fault: Fault) -> None:
        """Fault injection on the master: record it as fired, then die by the signal."""
        self._emit(
            "fault", f"fault injection: {fault.describe()} (at global step {self.global_step})"
        )
        self.sharding.flush()
        os.kill(os.getpid(), fault.signal)
        time.sleep(STOP_GRACE_SECONDS)  # a catchable signal: its handler asks the loop to stop

    def _check_completion(self) -> None:
        if self._training_done_at is None:
            if training_finished(self.nodes.all_current(), self.replicas) != JobOutcome.SUCCEEDED:
                return
            self._training_done_at = time.monotonic()
            self._save_runtime()
            self._emit("training_done", "chief and workers finished")
            for node in self.nodes.all_current():
                if node.type == "ps" and not node.state.ended:
                    self._stop_node(node)
        evaluators = [
            n for n in self.nodes.all_current() if n.type == "evaluator" and not n.state.ended
        ]
        if evaluators:
            if time.monotonic() - self._training_done_at < self.spec.evaluator_grace_seconds:
                return
            for node in evaluators:
                if not node.stop_requested:
                    self._stop_node(node)
            return
        if any(n.type == "ps" and not n.state.ended for n in self.nodes.all_current()):
            return
        self._set_state(JobState.SUCCEEDED, "chief and workers finished")

    def _running_workers(self) -> list[Node]:
        current = self.nodes.all_current()
        return [n for n in current if n.type == "worker" and n.state == NodeState.RUNNING]

    def _retire_node(self, node: Node) -> None:
        """Stop a node at once (its state is saved elsewhere, e.g. a PS after a checkpoint):
        every step the others take meanwhile would be trained again after the restore."""
        node.stop_requested = True
        self.nodes.save(node)
        if not self.platform.signal_node(node.id, signal.SIGKILL):
            self._on_node_exit(NodeEvent(node.type, node.rank, node.id, exit_code=-9))

    def _complete_move(self, old: Node, migration: Any) -> None:
        """The PS being moved has ended: start its new incarnation with the new resources."""
        new = self._launch(old.type, old.rank, old.relaunches, migration.memory_mb, migration.cpu)
        if self._chief_reports_restores:
            self._free_held_shards()
        else:
            self._rollback_data()  # to the checkpoint made for the migration
        self.migrator.finished(migration, new)

    def save_autoscale(self, record: dict) -> None:
        """The auto-scaler's measurements, so a restarted master does not redo them."""
        self.store.put(JOB_TABLE, AUTOSCALE_KEY, json.dumps(record).encode())

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
        stopping = [
            n
            for n in self.nodes.all_current()
            if n.type in CLUSTER_TYPES and n.state == NodeState.RUNNING
        ]
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
        for node_type in CLUSTER_TYPES:
            for rank in range(self._replicas[node_type]):
                old = self.nodes.current(node_type, rank)
                if old is not None and old.state in (NodeState.RUNNING, NodeState.SUCCEEDED):
                    continue
                relaunches = old.relaunches if old else 0
                memory_mb, cpu = (old.memory_mb, old.cpu) if old else (0, 0.0)
                self._launch(node_type, rank, relaunches, memory_mb, cpu)
        if not self._chief_reports_restores:
            self._rollback_data()  # to the checkpoint made for the change
        return self.cluster_version

    def _stop_node(self, node: Node) -> None:
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
                    self._on_node_exit(self.platform.events.get_nowait())
                except queue.Empty:
                    break
            for node in self.nodes.all_current():
                if not node.state.ended:
                    self.nodes.mark_exited(node.id, -signal.SIGTERM, ExitReason.STOPPED)
            self.sharding.close()

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


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""
