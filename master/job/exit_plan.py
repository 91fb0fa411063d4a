"""What a node's end means, decided without acting: `plan_exit` returns an `ExitPlan`.

It rests on `diagnose_node_exit` (why it ended), `ps_loss_cause` (a PS lost shortly before),
`ps_loss_recovery` (where the data goes back to when a PS lost its variables),
`relaunch_decision` (the relaunch policy of master.nodes.policy with the job's budgets) and
`failure_message`. master.job.exits carries a plan out, as torch's dynamic rendezvous runs the
action its join operation decides."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from master.config import JobSpec
from master.job.diagnosis import diagnose_exit
from master.job.model import NodeStart
from master.nodes.model import TRAINING_TYPES, Diagnosis, ExitReason, Finding, Node
from master.nodes.policy import Action, ExitDecision, decide_on_exit
from master.platform.api import NodeEvent, node_lost

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
    if Finding.HEARTBEAT_LOST in node.findings:
        return Diagnosis(ExitReason.HEARTBEAT_LOST, "no heartbeat")
    if Finding.HUNG in node.findings:
        return Diagnosis(ExitReason.HANG, "no step while holding shards")
    if Finding.STRAGGLER_REPLACED in node.findings:
        return Diagnosis(ExitReason.STRAGGLER, "replaced as a straggler")
    if node_lost(event):
        return Diagnosis(ExitReason.NODE_LOST, "its host was lost", event.message)
    reported = node.reported_exit
    tail = "\n".join(t for t in (event.message, reported.message if reported else "") if t)
    return diagnose_exit(
        event.exit_code,
        tail,
        oom_killed=event.oom_killed,
        stop_requested=node.stop_requested or job_ended,
        reported=reported.reason if reported else None,
        # Only training nodes report steps; others are never taken as failing at start-up.
        started=node.steps > 0
        or node.type not in TRAINING_TYPES
        or (not job_reports_steps and now - node.started_at >= STARTUP_WINDOW_SECONDS),
        memory_limit_mb=node.memory_mb or node.memory_limit_bytes // 2**20,
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
    reported = node.reported_exit
    return reported.message if reported and reported.message else event.message


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


@dataclass(frozen=True)
class Relaunch:
    """A new incarnation of the ended node's rank, and how its event tells it."""

    start: NodeStart
    uses_budget: bool  # False: a coordinator restarted after a PS loss, a PS after a move
    may_promote_standby: bool
    message: str  # the relaunch event's message, before ": <name> is now id <id>"
    reason: str  # the relaunch event's reason


@dataclass(frozen=True)
class ExitPlan:
    """What the job does about one node's end, in the order it is carried out: report it,
    hand it to a PS change that stopped it, move the data after a lost PS, restart the TF2
    coordinator, relaunch the rank or fail the job."""

    diagnosis: Diagnosis
    failed: bool  # not a clean end (succeeded, or stopped by the master)
    cause: str  # a PS lost shortly before (not its own code's fault), said with the failure
    to_ps_change: bool  # a PS change stopped it and takes its end: nothing else happens
    data_recovery: DataRecovery = DataRecovery.NONE
    restart_coordinator: int | None = None  # the id of the TF2 coordinator to restart
    relaunch: Relaunch | None = None
    fail_job: str = ""  # the job's failure reason ('' : the job goes on)


def plan_exit(
    node: Node,
    diagnosis: Diagnosis,
    spec: JobSpec,
    *,
    ps_losses: Mapping[str, float],
    now: float,
    to_ps_change: bool,
    training_done: bool,
    chief_reports_restores: bool,
    coordinator: int | None,
    job_relaunches_used: int,
    job_ended: bool,
) -> ExitPlan:
    """The plan for `node`'s end (its record already marked ended, `diagnosis` why), from the
    job's state: PS losses by name (monotonic `now`), whether a PS change claims the node, the
    running TF2 coordinator's id (None: none), the budgets used. Pure."""
    failed = not ended_cleanly(diagnosis.reason)
    # A node lost with its host has its cause: the host, not a PS lost meanwhile.
    lost_host = diagnosis.reason == ExitReason.NODE_LOST
    cause = ps_loss_cause(node, ps_losses, now) if failed and not lost_host else ""
    if cause:  # not its own code's fault: a relaunch can help
        diagnosis = dataclasses.replace(diagnosis, deterministic=False)
    if to_ps_change:
        return ExitPlan(diagnosis, failed, cause, to_ps_change=True)
    recovery = ps_loss_recovery(node, diagnosis.reason, training_done, chief_reports_restores)
    restart = coordinator if recovery != DataRecovery.NONE else None
    if node.coordinator_restart:
        # Restarted by the master for a PS loss (TF2 PS training): no budget is used.
        relaunch = Relaunch(
            NodeStart(node.type, node.rank, node.relaunches),
            uses_budget=False,
            may_promote_standby=False,
            message=f"{node.name} restarted to restore from the latest checkpoint after a PS "
            "loss (no budget used)",
            reason="ps_lost",
        )
        return ExitPlan(diagnosis, failed, cause, False, recovery, restart, relaunch)
    if node.restart_for_move and not (training_done or job_ended):
        # Killed by the master so it takes the moved trainers' new addresses: a PS failure
        # (the data follows the model back), its standby may take over, no budget is used.
        why = f"restarted with the new cluster spec after {node.restart_for_move} moved"
        relaunch = Relaunch(
            NodeStart(node.type, node.rank, node.relaunches),
            uses_budget=False,
            may_promote_standby=True,
            message=f"{node.name} {why} (no budget used)",
            reason="peer_moved",
        )
        return ExitPlan(diagnosis, failed, why, False, recovery, restart, relaunch)
    decision = relaunch_decision(
        node, diagnosis, spec, job_relaunches_used, training_done, job_ended
    )
    if decision.action == Action.RELAUNCH:
        relaunch = Relaunch(
            NodeStart(node.type, node.rank, node.relaunches + 1, decision.memory_mb),
            uses_budget=True,
            may_promote_standby=True,
            message=decision.reason,
            reason=diagnosis.reason.value,
        )
        return ExitPlan(diagnosis, failed, cause, False, recovery, restart, relaunch)
    fail = ""
    if decision.action == Action.FAIL_JOB:
        fail = failure_message(decision.reason, diagnosis, node.exit_message)
    return ExitPlan(diagnosis, failed, cause, False, recovery, restart, fail_job=fail)
