"""What happens when a node ends: why it ended, how the data follows a lost PS, relaunch or fail.

The pure part: `diagnose_node_exit` (why), `ps_loss_recovery` (where the data goes back to when
a PS lost its variables), `relaunch_decision` (the relaunch policy of master.nodes.policy with
the job's budgets) and `failure_message`. `NodeExitMixin` is the part of `JobMaster` that
applies them when the platform reports a node's end."""

from __future__ import annotations

import dataclasses
import enum
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from master.client import COORDINATOR_KEY
from master.client.position import decode_positions
from master.job.diagnosis import Diagnosis, diagnose_exit
from master.job.health import HEARTBEAT_LOST, HUNG, STRAGGLER_REPLACED
from master.job.model import JobState
from master.job.recovery_timeline import PS_FAILURE
from master.job.rollback import rollback_step
from master.nodes.model import TRAINING_TYPES, ExitReason, Node
from master.nodes.policy import Action, ExitDecision, decide_on_exit
from master.platform.api import POSITIONS_DETAIL, NodeEvent

if TYPE_CHECKING:
    from master.config import JobSpec
    from master.job.checkpoints import CheckpointRegistry
    from master.job.migration import PSMigrator
    from master.kv.store import KVStore
    from master.nodes.manager import NodeManager
    from master.platform.api import Platform
    from master.rendezvous.service import RendezvousService
    from master.sharding.service import ShardingService
    from master.sharding.streams import StreamRegistry

log = logging.getLogger(__name__)

# How long a node's end waits for the reports it already sent before its shards go back.
STREAM_DRAIN_SECONDS = 2.0
# node.extra flag: the master restarts this chief after a PS loss (no relaunch budget used).
COORDINATOR_RESTART = "coordinator_restart"
# A trainer failing this soon after a PS was lost failed because of it.
PS_LOSS_WINDOW_SECONDS = 120.0
# Where no node reports steps, an error after this much run time is not taken as a start-up bug
# (which fails the job at once): the program got going, so a relaunch may help.
STARTUP_WINDOW_SECONDS = 60.0


class DataRecovery(str, enum.Enum):
    """How the data position follows a PS that lost its variables."""

    NONE = "none"  # no PS lost (or the job is ending): nothing to do
    ROLLBACK = "rollback"  # back to the latest checkpoint the master knows of now
    FREE_HELD_SHARDS = "free_held_shards"  # held shards go back; the chief's restore report
    # then rolls the data back to exactly its step


def diagnose_node_exit(
    node: Node,
    event: NodeEvent,
    job_ended: bool,
    *,
    job_reports_steps: bool = True,
    now: float = 0.0,
) -> Diagnosis:
    """Why a node ended: the master's own verdicts first (heartbeat lost, hung, replaced as a
    straggler), else the rules of master.job.diagnosis on its exit code and last output.
    In a job that reports no steps (a program without our hooks), a node that ran for
    `STARTUP_WINDOW_SECONDS` (wall clock `now` against its start) is past start-up."""
    if node.extra.get(HEARTBEAT_LOST):
        return Diagnosis(ExitReason.HEARTBEAT_LOST, "no heartbeat")
    if node.extra.get(HUNG):
        return Diagnosis(ExitReason.HANG, "no step while holding shards")
    if node.extra.get(STRAGGLER_REPLACED):
        return Diagnosis(ExitReason.STRAGGLER, "replaced as a straggler")
    reported = node.extra.get("reported_exit")
    tail = "\n".join(t for t in (event.message, reported[1] if reported else "") if t)
    return diagnose_exit(
        event.exit_code,
        tail,
        oom_killed=event.oom_killed,
        stop_requested=node.stop_requested or job_ended,
        reported=reported[0] if reported else None,
        # Only training nodes report steps; others are never taken as failing at start-up.
        started=node.steps > 0
        or node.type not in TRAINING_TYPES
        or (not job_reports_steps and now - node.started_at >= STARTUP_WINDOW_SECONDS),
        memory_limit_mb=node.memory_mb or node.extra.get("memory_limit_bytes", 0) // 2**20,
        last_rss_bytes=node.memory_rss_bytes,
    )


def ended_at(event: NodeEvent, seen: float) -> float:
    """When the node's process ended: the platform's time if it gave one, else `seen`."""
    try:
        return min(float(event.details["ended_at"]), seen)
    except (KeyError, ValueError):
        return seen


def exit_message(node: Node, event: NodeEvent) -> str:
    """The message kept with a node's end: what it reported of its failure, else the platform's."""
    reported = node.extra.get("reported_exit")
    return reported[1] if reported and reported[1] else event.message


def ps_loss_cause(node: Node, ps_losses: Mapping[str, float], now: float) -> str:
    """Why a trainer failed when a PS was lost shortly before (`ps_losses`: PS name -> when it
    was lost, monotonic seconds): a TF2 coordinator cannot rebuild a lost PS's variables. ''
    when no PS was lost within PS_LOSS_WINDOW_SECONDS."""
    recent = sorted(n for n, t in ps_losses.items() if 0 <= now - t <= PS_LOSS_WINDOW_SECONDS)
    if node.type not in TRAINING_TYPES or not recent:
        return ""
    cause = f"after {', '.join(recent)} was lost"
    if node.type == "chief":
        cause += (
            " (a TF2 coordinator cannot rebuild the variables a PS held, so it fails; "
            "relaunched, it goes on from the program's own checkpoints, from scratch if it "
            "writes none)"
        )
    return cause


def ended_cleanly(reason: ExitReason) -> bool:
    """A node that succeeded or was stopped by the master: not a failure."""
    return reason in (ExitReason.SUCCEEDED, ExitReason.STOPPED)


def ps_loss_recovery(
    node: Node, reason: ExitReason, training_done: bool, chief_reports_restores: bool
) -> DataRecovery:
    """How the data follows `node`'s end: a PS that ended on its own while training runs lost
    the variables it held, so the model goes back to a checkpoint and the data with it."""
    if node.type != "ps" or reason == ExitReason.STOPPED or training_done:
        return DataRecovery.NONE
    return DataRecovery.FREE_HELD_SHARDS if chief_reports_restores else DataRecovery.ROLLBACK


def relaunch_decision(
    node: Node,
    diagnosis: Diagnosis,
    spec: JobSpec,
    job_relaunches_used: int,
    training_done: bool,
    job_ended: bool = False,
) -> ExitDecision:
    """Relaunch, fail the job, or nothing: the relaunch policy with the job's budgets. Once
    training is done, PS and evaluators are being stopped and are never relaunched; once the
    job has ended (its nodes' last exits are recorded as the platform shuts down), nothing is."""
    if job_ended:
        return ExitDecision(Action.NONE, "the job has ended")
    return decide_on_exit(
        node,
        diagnosis.reason,
        max_relaunches_per_rank=spec.group(node.type).max_relaunches,
        job_relaunches_used=job_relaunches_used,
        job_relaunch_budget=spec.max_relaunches,
        job_ending=training_done and node.type in ("ps", "evaluator"),
        deterministic=diagnosis.deterministic,
    )


def failure_message(decision_reason: str, diagnosis: Diagnosis, node_exit_message: str) -> str:
    """The job's failure reason: the decision's, with the error excerpt of a deterministic
    failure, else the last line the node wrote."""
    if diagnosis.deterministic and diagnosis.excerpt:
        return f"{decision_reason}\n{diagnosis.excerpt}"
    tail = last_line(node_exit_message)
    return decision_reason + (f" (last log line: {tail})" if tail else "")


def last_line(text: str) -> str:
    """The last non-blank line of `text`, at most 300 characters."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


class NodeExitMixin:
    """The part of `JobMaster` that applies the decisions above when a node ends."""

    spec: JobSpec
    state: JobState
    platform: Platform
    kv: KVStore
    nodes: NodeManager
    sharding: ShardingService
    progress_streams: StreamRegistry
    rendezvous: RendezvousService
    migrator: PSMigrator
    global_step: int
    checkpoints: CheckpointRegistry
    _job_relaunches: int
    _ps_losses: dict[str, float]  # PS name -> when it was last lost (monotonic)
    _training_done_at: float | None
    _chief_reports_restores: bool
    _restore_after_ps_loss: bool
    _emit: Callable[..., Any]
    _launch: Callable[..., Node]
    _set_state: Callable[..., None]
    _complete_move: Callable[[Node, Any], None]
    _rollback_data: Callable[..., None]
    _free_held_shards: Callable[..., None]
    _open_timeline: Callable[..., None]
    _mark_phase: Callable[..., None]
    _on_standby_exit: Callable[[NodeEvent], bool]
    _promote_standby: Callable[..., Node | None]

    def _on_node_exit(self, event: NodeEvent) -> None:
        seen = time.time()
        if self._on_standby_exit(event):
            return
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
        diagnosis = diagnose_node_exit(
            node,
            event,
            self.state.ended,
            job_reports_steps=self.global_step > 0
            or any(n.steps > 0 for n in self.nodes.all_current()),
            now=time.time(),
        )
        reason = diagnosis.reason
        node = self.nodes.mark_exited(event.id, event.exit_code, reason, exit_message(node, event))
        if node is None:
            return
        node.extra["diagnosis"] = diagnosis
        requeued = self.sharding.retire(node.id)
        if ended_cleanly(reason):
            log.info("%s id=%d ended: %s", node.name, node.id, reason.value)
            cause = node.stop_cause if reason == ExitReason.STOPPED else ""
            self._emit(
                "node_exited",
                f"{node.name} (id {node.id}) {reason.value}" + (f": {cause}" if cause else ""),
                node,
                reason.value,
                exit_code=event.exit_code,
                **({"stop_cause": cause} if cause else {}),
            )
        else:
            # Torch agents in a rendezvous round with it re-form without waiting for its lease.
            self.rendezvous.node_died((node.type, node.rank), node.id)
            more = f"; {sum(requeued.values())} unconsumed records re-queued" if requeued else ""
            if node.type == "ps":
                self._ps_losses[node.name] = time.monotonic()
            cause = ps_loss_cause(node, self._ps_losses, time.monotonic())
            if cause:  # not its own code's fault: a relaunch can help
                more += f", {cause}"
                diagnosis = dataclasses.replace(diagnosis, deterministic=False)
                node.extra["diagnosis"] = diagnosis
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
                **({"cause": cause} if cause else {}),
            )
        migration = self.migrator.on_exit(node)
        if migration is not None:
            if not migration.ps_count:
                self._complete_move(node, migration)
            # else: stopped for a PS count change, which starts the new cluster itself
            return
        training_done = self._training_done_at is not None
        recovery = ps_loss_recovery(node, reason, training_done, self._chief_reports_restores)
        if recovery != DataRecovery.NONE:
            self._open_timeline(PS_FAILURE, node.name, ended_at(event, seen))
            self._mark_phase("detected", seen)
            if recovery == DataRecovery.FREE_HELD_SHARDS:
                # The chief's restore report rolls the data back. A coordinator about to be
                # restarted keeps its shards until its end has drained its stream: a report
                # still on the wire then counts instead of being refused as stale.
                coordinator = self._coordinator_to_restart()
                self._free_held_shards(keep=coordinator.id if coordinator else None)
                self._restore_after_ps_loss = True
            else:
                # No restore report will come: the timeline ends at the first step past the
                # checkpoint the data went back to.
                self._mark_phase("detected", restored_step=rollback_step(self.checkpoints.latest()))
                self._rollback_data()
            self._restart_coordinator(node)
        if node.extra.get(COORDINATOR_RESTART):
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
        decision = relaunch_decision(
            node, diagnosis, self.spec, self._job_relaunches, training_done, self.state.ended
        )
        if decision.action == Action.RELAUNCH:
            self._job_relaunches += 1
            new = self._promote_standby(
                node.type, node.rank, node.relaunches + 1, decision.memory_mb, 0.0
            ) or self._launch(node.type, node.rank, node.relaunches + 1, decision.memory_mb)
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
            self._set_state(
                JobState.FAILED, failure_message(decision.reason, diagnosis, node.exit_message)
            )

    def _restart_coordinator(self, ps: Node) -> None:
        """TF2 PS training (dlrover_tf.keras_ps): the coordinator (the chief) cannot rebuild
        the variables a lost PS held, so it is restarted and restores the latest checkpoint."""
        chief = self._coordinator_to_restart()
        if chief is None:
            return
        chief.extra[COORDINATOR_RESTART] = True
        log.info("%s lost: restarting the coordinator %s (id %d)", ps.name, chief.name, chief.id)
        self._kill_node(chief)

    def _coordinator_to_restart(self) -> Node | None:
        """The running chief when it is a TF2 PS coordinator (restarted on a PS loss)."""
        chief = self.nodes.current("chief", 0)
        if chief is None or chief.state.ended or not self.kv.check([COORDINATOR_KEY]):
            return None
        return chief

    def _kill_node(self, node: Node) -> None:
        """SIGKILL a node; if the platform no longer has it, its end is handled here and now."""
        if not self.platform.signal_node(node.id, signal.SIGKILL):
            self._on_node_exit(NodeEvent(node.type, node.rank, node.id, exit_code=-9))
