"""A node's end, carried out: gather what the platform and the node said, plan it with
master.job.exit_plan, then apply the plan (report, data, coordinator, relaunch or fail)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from master.client import COORDINATOR_KEY
from master.client.position import decode_positions
from master.config import JobSpec
from master.job.checkpoints import CheckpointRegistry
from master.job.events import Emit
from master.job.exit_plan import (
    DataRecovery,
    ExitPlan,
    diagnose_node_exit,
    ended_at,
    exit_message,
    plan_exit,
)
from master.job.lifecycle import NodeLifecycle
from master.job.moves import plan_move_restarts
from master.job.ps_change import PSChanges
from master.job.ps_standby import StandbyKeeper
from master.job.recovery_timeline import PS_FAILURE, RecoveryPhase, RecoveryTracker
from master.job.rollback import DataRollback, rollback_step
from master.kv.store import KVStore
from master.nodes.manager import NodeManager
from master.nodes.model import ExitReason, Node
from master.platform.api import POSITIONS_DETAIL, NodeEvent, node_lost
from master.rendezvous.service import RendezvousService
from master.sharding.service import ShardingService
from master.sharding.streams import StreamRegistry

log = logging.getLogger(__name__)

# How long a node's end waits for the reports it already sent before its shards go back.
STREAM_DRAIN_SECONDS = 2.0


def running_coordinator(nodes: NodeManager, kv: KVStore) -> Node | None:
    """The running chief when it is a TF2 PS coordinator (restarted on a PS loss)."""
    chief = nodes.current("chief", 0)
    if chief is None or chief.state.ended or not kv.check([COORDINATOR_KEY]):
        return None
    return chief


class ExitHandler:
    """Handles every node end the platform reports; owns the job's relaunch count and when
    each PS was last lost."""

    def __init__(
        self,
        spec: JobSpec,
        nodes: NodeManager,
        sharding: ShardingService,
        progress_streams: StreamRegistry,
        rendezvous: RendezvousService,
        kv: KVStore,
        checkpoints: CheckpointRegistry,
        lifecycle: NodeLifecycle,
        standby: StandbyKeeper,
        ps_changes: PSChanges,
        rollback: DataRollback,
        recovery: RecoveryTracker,
        emit: Emit,
        job_ended: Callable[[], bool],
        training_done: Callable[[], bool],
        reports_steps: Callable[[], bool],
        fail_job: Callable[[str], None],
    ) -> None:
        self._spec = spec
        self._nodes = nodes
        self._sharding = sharding
        self._streams = progress_streams
        self._rendezvous = rendezvous
        self._kv = kv
        self._checkpoints = checkpoints
        self._lifecycle = lifecycle
        self._standby = standby
        self._ps_changes = ps_changes
        self._rollback = rollback
        self._recovery = recovery
        self._emit = emit
        self._job_ended = job_ended
        self._training_done = training_done
        self._reports_steps = reports_steps  # some trainer of the job reports its steps
        self._fail_job = fail_job
        self.job_relaunches = 0  # relaunches used of the job's budget (in the runtime record)
        self._ps_losses: dict[str, float] = {}  # PS name -> when it was last lost (monotonic)

    def coordinator(self) -> Node | None:
        """The running TF2 PS coordinator, if the job has one."""
        return running_coordinator(self._nodes, self._kv)

    def handle(self, event: NodeEvent) -> None:
        """The platform saw a node's process end: record it, then plan and apply."""
        seen = time.time()
        if self._standby.on_exit(event):
            return
        node = self._nodes.get(event.id)
        if node is None or node.state.ended:
            return
        # Reports the node wrote before it died are still arriving on its stream: apply them
        # first, so only what it really did not consume is re-queued.
        # (A host lost with it sends no more: its stream would only hold the end up.)
        if not node_lost(event) and not self._streams.wait_closed(node.id, STREAM_DRAIN_SECONDS):
            log.warning("%s id=%d: progress stream still open after its end", node.name, node.id)
        # Steps its coalesced reports had not carried yet: the platform read them back.
        self._sharding.apply_positions(
            node.id, decode_positions(event.details.get(POSITIONS_DETAIL, ""))
        )
        diagnosis = diagnose_node_exit(
            node,
            event,
            self._job_ended(),
            job_reports_steps=self._reports_steps(),
            now=time.time(),
        )
        node = self._nodes.mark_exited(
            event.id, event.exit_code, diagnosis.reason, exit_message(node, event)
        )
        if node is None:
            return
        requeued = sum(self._sharding.retire(node.id).values())
        # Lost with its host: its rank, and every other the host held, go where the platform
        # still has room (new addresses on a cluster of hosts), in the TF cluster from now on;
        # a standby promoted on another host moves the rank there too (below).
        addresses = self._lifecycle.addresses()
        if diagnosis.reason == ExitReason.NODE_LOST:
            self._lifecycle.relocate()
        if diagnosis.reason not in (ExitReason.SUCCEEDED, ExitReason.STOPPED):
            # Torch agents in a rendezvous round with it re-form without waiting for its lease.
            self._rendezvous.node_died((node.type, node.rank), node.id)
            if node.type == "ps":
                self._ps_losses[node.name] = time.monotonic()
        coordinator = self.coordinator()
        plan = plan_exit(
            node,
            diagnosis,
            self._spec,
            ps_losses=self._ps_losses,
            now=time.monotonic(),
            to_ps_change=self._ps_changes.claims(node),
            training_done=self._training_done(),
            chief_reports_restores=self._rollback.chief_reports_restores,
            coordinator=coordinator.id if coordinator else None,
            job_relaunches_used=self.job_relaunches,
            job_ended=self._job_ended(),
        )
        self._apply(plan, node, event, seen, requeued)
        moved = self._lifecycle.moved_since(addresses)
        if moved and plan.relaunch is not None:
            self._restart_for_moves(moved)

    def _apply(
        self, plan: ExitPlan, node: Node, event: NodeEvent, seen: float, requeued: int
    ) -> None:
        node.diagnosis = plan.diagnosis
        self._report(plan, node, event, requeued)
        if plan.to_ps_change:
            self._ps_changes.on_exit(node)
            return
        if plan.data_recovery != DataRecovery.NONE:
            self._recovery.open(PS_FAILURE, node.name, ended_at(event, seen))
            self._recovery.mark(RecoveryPhase.DETECTED, seen)
            if plan.data_recovery == DataRecovery.FREE_HELD_SHARDS:
                # The chief's restore report rolls the data back. A coordinator about to be
                # restarted keeps its shards until its end has drained its stream: a report
                # still on the wire then counts instead of being refused as stale.
                self._rollback.await_restore(keep=plan.restart_coordinator)
            else:
                # No restore report will come: the timeline ends at the first step past the
                # checkpoint the data went back to.
                step = rollback_step(self._checkpoints.latest())
                self._recovery.mark(RecoveryPhase.DETECTED, restored_step=step)
                self._rollback.rollback()
        if plan.restart_coordinator is not None:
            self._restart_coordinator(node, plan.restart_coordinator)
        if plan.relaunch is not None:
            r = plan.relaunch
            if r.uses_budget:
                self.job_relaunches += 1
            new = (r.may_promote_standby and self._standby.promote(r.start)) or (
                self._lifecycle.launch(r.start)
            )
            budget = {"memory_mb": new.memory_mb, "job_relaunches": self.job_relaunches}
            self._emit(
                "relaunch",
                f"{r.message}: {new.name} is now id {new.id}",
                new,
                r.reason,
                previous_id=node.id,
                **(budget if r.uses_budget else {}),
            )
        elif plan.fail_job:
            self._fail_job(plan.fail_job)

    def _report(self, plan: ExitPlan, node: Node, event: NodeEvent, requeued: int) -> None:
        """The node's end as an event: node_exited for a clean end, node_failed otherwise."""
        reason = plan.diagnosis.reason
        if not plan.failed:
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
            return
        more = f"; {requeued} unconsumed records re-queued" if requeued else ""
        if plan.cause:
            more += f", {plan.cause}"
        diagnosis = plan.diagnosis
        self._emit(
            "node_failed",
            f"{node.name} (id {node.id}) {reason.value}, exit code {event.exit_code}{more}",
            node,
            reason.value,
            exit_code=event.exit_code,
            diagnosis=diagnosis.summary,
            excerpt=diagnosis.excerpt,
            deterministic=diagnosis.deterministic,
            records_requeued=requeued,
            **({"cause": plan.cause} if plan.cause else {}),
        )

    def _restart_for_moves(self, moved: list[tuple[str, int]]) -> None:
        """Ranks moved to new addresses: a TF server cannot join a new cluster in process, so
        the peers that dial them restart with the new TF_CONFIG (master.job.moves), without
        using a relaunch. For a moved PS the chief and workers restore the latest checkpoint;
        for a moved chief or worker every PS restarts, as in a PS failure."""
        following = self._lifecycle.readdress(moved)
        plan = plan_move_restarts(
            moved, self._nodes.all_current(), self._training_done(), following
        )
        what = ", ".join(f"{t}-{r}" for t, r in moved)
        if following:
            log.info("%s moved: %d node(s) reach it there in place", what, len(following))
        for node in plan.trainers:
            node.coordinator_restart = True
        for node in plan.ps:
            node.restart_for_move = plan.moved_trainers
        restarted = [*plan.trainers, *plan.ps]
        log.info(
            "%s moved to a new address: restarting %s with the new cluster spec",
            what,
            ", ".join(n.name for n in restarted) or "nothing",
        )
        for node in restarted:
            self._lifecycle.signal_kill(node)

    def _restart_coordinator(self, ps: Node, chief_id: int) -> None:
        """TF2 PS training (dlrover_tf.keras_ps): the coordinator (the chief) cannot rebuild
        the variables a lost PS held, so it is restarted and restores the latest checkpoint."""
        chief = self._nodes.get(chief_id)
        if chief is None or chief.state.ended:
            return
        chief.coordinator_restart = True
        log.info("%s lost: restarting the coordinator %s (id %d)", ps.name, chief.name, chief.id)
        self._lifecycle.kill(chief)
