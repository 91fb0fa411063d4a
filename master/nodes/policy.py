"""Pure decisions about node exits and job completion: observed state in, decision out."""

from __future__ import annotations

import enum
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from master.nodes.model import TRAINING_TYPES, ExitReason, Node, NodeState

OOM_MEMORY_GROWTH = 1.5
EXIT_CODE_SIGKILL_SHELL = 128 + signal.SIGKILL
BEATS_PER_TIMEOUT = 3


def classify_exit(
    exit_code: int,
    oom_killed: bool = False,
    stop_requested: bool = False,
    reported: ExitReason | None = None,
) -> ExitReason:
    """Map a process exit status (negative = killed by that signal) to an exit reason.

    `reported` is what the node said of its own failure before it ended (ReportExit); it
    wins over the exit code, which cannot tell a CUDA OOM or a hardware fault from a bug.
    """
    if stop_requested:
        return ExitReason.STOPPED
    if oom_killed:
        return ExitReason.OOM
    if exit_code == 0:
        return ExitReason.SUCCEEDED
    if reported is not None and reported not in (ExitReason.NONE, ExitReason.SUCCEEDED):
        return reported
    if exit_code < 0 or exit_code == EXIT_CODE_SIGKILL_SHELL or exit_code == 128 + signal.SIGTERM:
        return ExitReason.KILLED
    if exit_code in (1, 2):
        return ExitReason.USER_ERROR
    return ExitReason.UNKNOWN


class Action(str, enum.Enum):
    NONE = "none"
    RELAUNCH = "relaunch"
    FAIL_JOB = "fail_job"


@dataclass(frozen=True)
class ExitDecision:
    """What to do after a node ended, and why."""

    action: Action
    reason: str
    memory_mb: int = 0  # memory for the relaunch; 0 keeps the spec's


def decide_on_exit(
    node: Node,
    reason: ExitReason,
    max_relaunches_per_rank: int,
    job_relaunches_used: int,
    job_relaunch_budget: int,
    job_ending: bool,
    deterministic: bool = False,
) -> ExitDecision:
    """Relaunch, fail the job, or do nothing after `node` ended with `reason`.

    `deterministic`: the failure would repeat on a relaunch (a user-code error at start-up),
    so the job fails at once instead of burning the relaunch budget.
    """
    if job_ending or reason == ExitReason.STOPPED:
        return ExitDecision(Action.NONE, f"{node.name} stopped by the master")
    if reason == ExitReason.SUCCEEDED and node.type != "ps":
        return ExitDecision(Action.NONE, f"{node.name} finished")
    what = "exited" if reason == ExitReason.SUCCEEDED else f"failed ({reason.value})"
    code = "" if node.exit_code is None else f", exit code {node.exit_code}"
    if deterministic and reason != ExitReason.SUCCEEDED:
        if node.type == "evaluator":
            return ExitDecision(
                Action.NONE, f"{node.name} {what}{code} at start-up; evaluator not relaunched"
            )
        return ExitDecision(
            Action.FAIL_JOB,
            f"{node.name} {what}{code} at start-up, before its first step; not relaunched "
            "because it would fail the same way: fix the error shown and submit again",
        )
    if node.relaunches >= max_relaunches_per_rank:
        if node.type == "evaluator":
            return ExitDecision(Action.NONE, f"{node.name} {what}; evaluator relaunches used up")
        return ExitDecision(
            Action.FAIL_JOB,
            f"{node.name} {what}{code} after {node.relaunches} relaunches; "
            f"{node.type}.max_relaunches is {max_relaunches_per_rank}",
        )
    if job_relaunches_used >= job_relaunch_budget:
        return ExitDecision(
            Action.FAIL_JOB,
            f"{node.name} {what}{code}; the job's relaunch budget "
            f"(max_relaunches: {job_relaunch_budget}) is used up",
        )
    memory = 0
    if reason == ExitReason.OOM and node.type == "ps" and node.memory_mb > 0:
        memory = int(node.memory_mb * OOM_MEMORY_GROWTH)
        return ExitDecision(
            Action.RELAUNCH, f"{node.name} ran out of memory; relaunch with {memory} MB", memory
        )
    return ExitDecision(Action.RELAUNCH, f"{node.name} {what}{code}; relaunch")


class JobOutcome(str, enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"


def training_finished(nodes: Iterable[Node], replicas: dict[str, int]) -> JobOutcome:
    """Succeeded once every chief and worker rank's current incarnation succeeded."""
    current = {(n.type, n.rank): n for n in nodes}
    for node_type in TRAINING_TYPES:
        for rank in range(replicas.get(node_type, 0)):
            node = current.get((node_type, rank))
            if node is None or node.state != NodeState.SUCCEEDED:
                return JobOutcome.RUNNING
    return JobOutcome.SUCCEEDED


def heartbeat_interval(configured: float, timeout: float) -> float:
    """The interval nodes beat at: the configured one, or less, so that BEATS_PER_TIMEOUT
    beats fit in the job's heartbeat timeout (one late or skipped beat is no loss)."""
    return min(configured, timeout / BEATS_PER_TIMEOUT)


def heartbeat_lost(node: Node, now: float, timeout: float) -> bool:
    """A registered, running node whose last heartbeat is older than the timeout."""
    return (
        node.state == NodeState.RUNNING
        and node.registered
        and timeout > 0
        and now - node.last_heartbeat > timeout
    )


def is_hung(node: Node, now: float, timeout: float, holds_shards: bool, since: float = 0.0) -> bool:
    """A running chief/worker that holds shards but took or reported nothing within `timeout`
    (counted from `since` at the earliest: the end of a pause of the whole job).

    A node holding no shard may legitimately wait (for the last shards of others).
    """
    return (
        node.type in TRAINING_TYPES
        and node.state == NodeState.RUNNING
        and holds_shards
        and timeout > 0
        and now - max(node.last_progress, since) > timeout
    )
