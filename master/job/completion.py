"""When a job has succeeded: training done, then the nodes that never exit by themselves stopped.

Training is done once every chief and worker rank succeeded (master.nodes.policy). Then every
PS is stopped at once, evaluators get `evaluator_grace_seconds` for a final evaluation before
they are stopped too, and the job has succeeded once no PS or evaluator runs any more."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from master.nodes.model import Node
from master.nodes.policy import JobOutcome, training_finished

SUCCESS_REASON = "chief and workers finished"


@dataclass(frozen=True)
class CompletionDecision:
    """What the job does about its end at one look: nothing, a step towards it, or succeed."""

    training_done: bool = False  # training has just finished: record it, the PS are stopped
    stop: tuple[Node, ...] = ()  # nodes to stop gracefully now, in this order
    succeeded: bool = False


def decide_completion(
    nodes: Sequence[Node],
    replicas: Mapping[str, int],
    training_done_at: float | None,
    now: float,
    evaluator_grace_seconds: float,
) -> CompletionDecision:
    """The next step towards the job's end, from its current nodes and when training ended
    (`training_done_at`, monotonic seconds; None while it trains). Pure."""
    stop: list[Node] = []
    training_done = False
    if training_done_at is None:
        if training_finished(nodes, replicas) != JobOutcome.SUCCEEDED:
            return CompletionDecision()
        training_done, training_done_at = True, now
        stop = [n for n in nodes if n.type == "ps" and not n.state.ended]
    evaluators = [n for n in nodes if n.type == "evaluator" and not n.state.ended]
    if evaluators:
        if now - training_done_at >= evaluator_grace_seconds:
            stop += [n for n in evaluators if not n.stop_requested]
        return CompletionDecision(training_done, tuple(stop))
    if any(n.type == "ps" and not n.state.ended for n in nodes):
        return CompletionDecision(training_done, tuple(stop))
    return CompletionDecision(training_done, succeeded=True)
