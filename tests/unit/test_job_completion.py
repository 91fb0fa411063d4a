"""When a job has succeeded: training done, PS stopped, evaluators given their grace, then done."""

from __future__ import annotations

from master.job.completion import CompletionDecision, decide_completion
from master.nodes.model import Node, NodeState

R, S, F = NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.FAILED
REPLICAS = {"ps": 1, "chief": 1, "worker": 2, "evaluator": 1}
GRACE = 60.0


def _nodes(chief=S, w0=S, w1=S, ps=R, evaluator=R, evaluator_stopping=False):
    return [
        Node("ps", 0, id=1, state=ps),
        Node("chief", 0, id=2, state=chief),
        Node("worker", 0, id=3, state=w0),
        Node("worker", 1, id=4, state=w1),
        Node("evaluator", 0, id=5, state=evaluator, stop_requested=evaluator_stopping),
    ]


def _ids(decision: CompletionDecision) -> list[int]:
    return [n.id for n in decision.stop]


def test_nothing_happens_while_a_trainer_has_not_succeeded():
    for nodes in (_nodes(w1=R), _nodes(chief=R), _nodes(w0=F)):
        assert decide_completion(nodes, REPLICAS, None, 100.0, GRACE) == CompletionDecision()


def test_training_done_stops_the_ps_and_leaves_the_evaluator_its_grace():
    d = decide_completion(_nodes(), REPLICAS, None, 100.0, GRACE)
    assert d.training_done and not d.succeeded
    assert _ids(d) == [1]  # the PS only: the evaluator may still evaluate the final model


def test_with_no_grace_the_evaluator_is_stopped_with_the_ps():
    d = decide_completion(_nodes(), REPLICAS, None, 100.0, 0.0)
    assert d.training_done and _ids(d) == [1, 5]


def test_the_evaluator_is_stopped_once_its_grace_has_passed_and_only_once():
    assert decide_completion(_nodes(ps=S), REPLICAS, 100.0, 159.0, GRACE) == CompletionDecision()
    d = decide_completion(_nodes(ps=S), REPLICAS, 100.0, 160.0, GRACE)
    assert not d.training_done and _ids(d) == [5] and not d.succeeded
    again = decide_completion(_nodes(ps=S, evaluator_stopping=True), REPLICAS, 100.0, 161.0, GRACE)
    assert again == CompletionDecision()  # asked to stop already: wait for its end


def test_the_job_succeeds_once_no_ps_or_evaluator_runs():
    running_ps = decide_completion(_nodes(ps=R, evaluator=S), REPLICAS, 100.0, 101.0, GRACE)
    assert running_ps == CompletionDecision()
    done = decide_completion(_nodes(ps=S, evaluator=S), REPLICAS, 100.0, 101.0, GRACE)
    assert done == CompletionDecision(succeeded=True)


def test_a_job_of_trainers_only_succeeds_at_once():
    nodes = [Node("worker", 0, id=1, state=S)]
    d = decide_completion(nodes, {"worker": 1}, None, 5.0, GRACE)
    assert d == CompletionDecision(training_done=True, succeeded=True)


def test_a_scaled_down_rank_no_longer_counts():
    nodes = _nodes(w1=R, ps=S, evaluator=S)
    assert decide_completion(nodes, {**REPLICAS, "worker": 1}, None, 5.0, GRACE).succeeded
