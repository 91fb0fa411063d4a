"""When a job has succeeded, as Kubeflow's TFJob decides it, then the nodes still running stopped.

`success_policy` "chief": the job's training is done once the chief (worker 0 where there is no
chief) exited 0; "all_workers": once every chief and worker rank did (master.nodes.policy).
Then the nodes that never exit by themselves are stopped: trainers that never talk to the
master (plain TF servers in `server.join()`) after SERVER_SETTLE_SECONDS, trainers using our
hooks after they finish (at most `evaluator_grace_seconds`, or SERVER_SETTLE_SECONDS once every
dataset is done: nothing is left for them to train), the PS once no trainer of ours still
trains, evaluators after their grace for a final evaluation. The job has succeeded once none
of its nodes runs. `decide_completion` decides (pure); `Completion` applies it."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from master.config import JobSpec
from master.job.events import Emit
from master.job.lifecycle import NodeLifecycle
from master.nodes.manager import NodeManager
from master.nodes.model import TRAINING_TYPES, Node, NodeState
from master.nodes.policy import JobOutcome, training_finished
from master.sharding.service import ShardingService

ALL_WORKERS_REASON = "chief and workers finished"
# Why the master stops the nodes still running once the job has succeeded.
JOB_DONE = "job done"
# How long trainers that never talked to the master may take to exit by themselves once the job
# has succeeded, before they are stopped.
SERVER_SETTLE_SECONDS = 3.0


@dataclass(frozen=True)
class CompletionDecision:
    """What the job does about its end at one look: nothing, a step towards it, or succeed."""

    training_done: bool = False  # training has just finished: record it
    stop: tuple[Node, ...] = ()  # nodes to stop gracefully now, in this order
    succeeded: bool = False


def lead_trainer(replicas: Mapping[str, int]) -> str:
    """The node whose success ends the job under `success_policy: chief`."""
    return "chief-0" if replicas.get("chief", 0) else "worker-0"


def success_reason(success_policy: str, replicas: Mapping[str, int]) -> str:
    """The job's reason for its success, as its events and summary say it."""
    if success_policy == "chief":
        return f"{lead_trainer(replicas)} finished (success_policy: chief)"
    return ALL_WORKERS_REASON


def success_reached(
    nodes: Sequence[Node], replicas: Mapping[str, int], success_policy: str
) -> bool:
    """Whether the job's training is done under `success_policy`. Pure."""
    if success_policy == "all_workers":
        return training_finished(nodes, replicas) == JobOutcome.SUCCEEDED
    lead = lead_trainer(replicas)
    return any(n.name == lead and n.state == NodeState.SUCCEEDED for n in nodes)


def _counts(node: Node, replicas: Mapping[str, int]) -> bool:
    """A trainer of a rank scaled away is being stopped by the scaling: it does not count."""
    return node.type not in TRAINING_TYPES or node.rank < replicas.get(node.type, 0)


def decide_completion(
    nodes: Sequence[Node],
    replicas: Mapping[str, int],
    training_done_at: float | None,
    now: float,
    evaluator_grace_seconds: float,
    success_policy: str = "all_workers",
    data_done: bool = False,
) -> CompletionDecision:
    """The next step towards the job's end, from its current nodes and when training ended
    (`training_done_at`, monotonic seconds; None while it trains). `data_done`: the job has
    datasets and every one is finished, so no trainer holds or can get a shard. Pure."""
    training_done = False
    if training_done_at is None:
        if not success_reached(nodes, replicas, success_policy):
            return CompletionDecision()
        training_done, training_done_at = True, now
    grace_over = now - training_done_at >= evaluator_grace_seconds
    live = [n for n in nodes if not n.state.ended and _counts(n, replicas)]
    trainers = [n for n in live if n.type in TRAINING_TYPES and not n.stop_requested]
    # A trainer that never talked to the master serves others (server.join()): stop it after
    # a few seconds (a program that ends its servers itself has them exit by then); one using
    # our hooks finishes its shards first, within the grace, unless no data is left (it may be
    # asleep in TF's own recovery wait after a PS loss, which would hold the job's end).
    settled = now - training_done_at >= SERVER_SETTLE_SECONDS
    idle = settled and data_done
    stop = [n for n in trainers if (settled and not n.registered) or idle or grace_over]
    finishing = [n for n in trainers if n not in stop]
    # Under all_workers no trainer runs any more: the PS are stopped once, at once.
    ps_due = training_done or success_policy != "all_workers"
    if ps_due and not finishing:
        stop += [n for n in live if n.type == "ps" and not n.stop_requested]
    if grace_over:
        stop += [n for n in live if n.type == "evaluator" and not n.stop_requested]
    if live:
        return CompletionDecision(training_done, tuple(stop))
    return CompletionDecision(training_done, succeeded=True)


class Completion:
    """Watches for the job's success and stops the nodes left; owns when training ended."""

    def __init__(
        self,
        spec: JobSpec,
        nodes: NodeManager,
        sharding: ShardingService,
        lifecycle: NodeLifecycle,
        replicas: Callable[[], Mapping[str, int]],
        emit: Emit,
        save: Callable[[], None],
        on_training_done: Callable[[], None],
        succeed: Callable[[str], None],
    ) -> None:
        self._spec = spec
        self._nodes = nodes
        self._sharding = sharding
        self._lifecycle = lifecycle
        self._replicas = replicas
        self._emit = emit
        self._save = save  # writes the runtime record (which holds `training_done`)
        self._on_training_done = on_training_done
        self._succeed = succeed  # the job has succeeded, with this reason
        self.training_done_at: float | None = None  # monotonic time training finished

    @property
    def training_done(self) -> bool:
        return self.training_done_at is not None

    def restore(self, training_done: bool) -> None:
        """A restarted master: training had finished under the previous instance."""
        if training_done:
            self.training_done_at = time.monotonic()

    def check(self) -> None:
        """Control loop: the next step towards the job's end (see decide_completion)."""
        now = time.monotonic()
        replicas = self._replicas()
        policy = self._spec.success_policy
        decision = decide_completion(
            self._nodes.all_current(),
            replicas,
            self.training_done_at,
            now,
            self._spec.evaluator_grace_seconds,
            policy,
            data_done=self.training_done and self._data_done(),
        )
        reason = success_reason(policy, replicas)
        if decision.training_done:
            self.training_done_at = now
            self._save()
            self._emit("training_done", reason)
            self._on_training_done()
        for node in decision.stop:
            self._lifecycle.stop(node, JOB_DONE)
        if decision.succeeded:
            self._succeed(reason)

    def _data_done(self) -> bool:
        """The job has datasets and every one is finished."""
        stats = self._sharding.stats()
        return bool(stats) and all(s.finished for s in stats)
