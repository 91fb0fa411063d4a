"""Node health: lost heartbeats, hung trainers and stragglers, each judged once per node.

`heartbeat_verdicts`, `hang_verdicts` and `straggler_verdicts` are pure: current nodes and
times in, `HealthVerdict`s out. `HealthMixin` is the part of `JobMaster` that gathers what they
need and applies each verdict: mark the node, record the event, kill it where the verdict says
(its exit is then handled as any other, see master.job.exits)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from master.job.diagnosis import find_stragglers
from master.nodes.manager import step_time_samples
from master.nodes.model import Node, NodeState
from master.nodes.policy import heartbeat_lost, is_hung

if TYPE_CHECKING:
    from master.config import JobSpec
    from master.nodes.manager import NodeManager
    from master.sharding.service import ShardingService

STRAGGLER_CHECK_SECONDS = 5.0
# A node is judged a straggler only on a step time measured over this many step reports (a
# freshly relaunched worker's first coalesced report alone may cover a slow start).
STRAGGLER_MIN_REPORTS = 3
# A silent node whose process uses at least this share of one core is busy, not dead.
BUSY_CPU_PERCENT = 50.0
# node.extra flags: what the master found (each node is judged once per finding), read again
# when the node's exit is diagnosed (master.job.exits.diagnose_node_exit).
HEARTBEAT_LOST = "heartbeat_lost"
HUNG = "hung"
STRAGGLER = "straggler"
STRAGGLER_REPLACED = "straggler_replaced"


@dataclass(frozen=True)
class HealthVerdict:
    """One finding about one node: the event to record, the flags to set, whether to kill it."""

    node: Node
    kind: str  # the event kind, also its reason: heartbeat_lost | hang | straggler
    message: str
    marks: tuple[str, ...]  # node.extra flags to set
    kill: bool
    details: dict[str, Any] = field(default_factory=dict)


def silence_cause(cpu_percent: float | None) -> str:
    """What a node that stopped reporting (heartbeats, rendezvous leases) is doing, from the
    CPU use of its process the platform measured (None: not measured, nothing to say)."""
    if cpu_percent is None:
        return ""
    if cpu_percent >= BUSY_CPU_PERCENT:
        return (
            f"its process still runs at {cpu_percent:.0f}% CPU: busy, not dead "
            "(its reports are starved)"
        )
    return f"its process still runs but is idle ({cpu_percent:.1f}% CPU): blocked or waiting"


def heartbeat_verdicts(
    nodes: Iterable[Node],
    now: float,
    timeout: float,
    measured_cpu: Mapping[int, float] | None = None,
) -> list[HealthVerdict]:
    """Kill each registered running node whose last heartbeat is older than `timeout`; the
    message says what its process does where the platform measured it (`measured_cpu`, by
    node id)."""
    verdicts = []
    for node in nodes:
        if not heartbeat_lost(node, now, timeout) or node.extra.get(HEARTBEAT_LOST):
            continue
        cause = silence_cause((measured_cpu or {}).get(node.id))
        verdicts.append(
            HealthVerdict(
                node,
                "heartbeat_lost",
                f"{node.name} (id {node.id}) sent no heartbeat for {timeout:g}s"
                + (f" ({cause})" if cause else "")
                + "; killing it",
                (HEARTBEAT_LOST,),
                kill=True,
                details={"timeout_seconds": timeout, **({"cause": cause} if cause else {})},
            )
        )
    return verdicts


def hang_verdicts(
    nodes: Iterable[Node],
    now: float,
    timeout: float,
    holding_shards: Collection[int],
    since: float = 0.0,
) -> list[HealthVerdict]:
    """Restart each trainer that holds shards (its id in `holding_shards`) but made no step
    for `timeout` seconds (0: detection off), counted from `since` at the earliest."""
    return [
        HealthVerdict(
            node,
            "hang",
            f"{node.name} (id {node.id}) holds shards but made no step for {timeout:g}s; "
            "restarting it",
            (HUNG,),
            kill=True,
            details={"timeout_seconds": timeout, "steps": node.steps},
        )
        for node in nodes
        if not node.extra.get(HUNG)
        and is_hung(node, now, timeout, node.id in holding_shards, since)
    ]


def straggler_verdicts(nodes: Iterable[Node], action: str, min_steps: int) -> list[HealthVerdict]:
    """Report (`action` "report") or replace ("replace") each running worker with at least
    `min_steps` steps that is far slower than its peers (master.job.diagnosis.find_stragglers);
    "off": none. Not the chief: it checkpoints and writes summaries, which its peers do not."""
    if action == "off":
        return []
    measured = {
        n.id: n
        for n in nodes
        if n.type == "worker"
        and n.state == NodeState.RUNNING
        and n.steps >= min_steps
        and step_time_samples(n) >= STRAGGLER_MIN_REPORTS
    }
    replace = action == "replace"
    slow = find_stragglers({i: n.step_seconds for i, n in measured.items()})
    verdicts = []
    for node_id, factor in slow.items():
        node = measured[node_id]
        if node.extra.get(STRAGGLER):
            continue
        verdicts.append(
            HealthVerdict(
                node,
                "straggler",
                f"{node.name} (id {node.id}) is a straggler: {node.step_seconds * 1000:.0f} ms "
                f"per step, {factor:.1f}x its peers' median"
                + ("; replacing it" if replace else ""),
                (STRAGGLER, STRAGGLER_REPLACED) if replace else (STRAGGLER,),
                kill=replace,
                details={
                    "step_seconds": round(node.step_seconds, 4),
                    "slowdown": round(factor, 2),
                    "action": "replace" if replace else "report",
                },
            )
        )
    return verdicts


class HealthMixin:
    """The part of `JobMaster` that runs the health checks from its control loop."""

    spec: JobSpec
    nodes: NodeManager
    sharding: ShardingService
    _stragglers_checked_at: float
    _hang_clock_from: float  # hang clocks run from here at the earliest (a job pause's end)
    _recovering: Callable[[], bool]  # the job's start or a PS recovery before its first step
    _measured_cpu: dict[int, float]  # node id -> CPU % the platform measured (master.job.stuck)
    _emit: Callable[..., Any]
    _kill_node: Callable[[Node], None]

    def _check_health(self) -> None:
        now = time.monotonic()
        self._apply_verdicts(
            heartbeat_verdicts(
                self.nodes.all_current(),
                now,
                self.spec.heartbeat_timeout_seconds,
                self._measured_cpu,
            )
        )
        timeout = self.spec.hang_timeout_seconds
        nodes = self.nodes.all_current()
        now = time.monotonic()
        recovering = self._recovering()
        if recovering:
            self.nodes.restart_step_clocks(now)  # the pause is no trainer's step time
        if timeout > 0:
            if recovering or not any(n.steps for n in nodes):
                # The job's start or a PS recovery: trainers holding shards wait for sessions
                # and a restore (tens of seconds on a loaded machine), they are not hung. Each
                # gets a full timeout from the pause's end.
                self._hang_clock_from = now
            else:
                holding = self.sharding.holders()
                verdicts = hang_verdicts(nodes, now, timeout, holding, self._hang_clock_from)
                self._apply_verdicts(verdicts)
        now = time.monotonic()
        if (
            self.spec.stragglers != "off"
            and now - self._stragglers_checked_at >= STRAGGLER_CHECK_SECONDS
        ):
            self._stragglers_checked_at = now
            self._apply_verdicts(
                straggler_verdicts(
                    self.nodes.all_current(), self.spec.stragglers, self.spec.straggler_min_steps
                )
            )

    def _silent_node_cause(self, key: tuple[str, int]) -> str:
        """What a node whose rendezvous lease lapsed is doing (see silence_cause)."""
        node = self.nodes.current(*key)
        return silence_cause(self._measured_cpu.get(node.id)) if node is not None else ""

    def _apply_verdicts(self, verdicts: Iterable[HealthVerdict]) -> None:
        for v in verdicts:
            for mark in v.marks:
                v.node.extra[mark] = True
            self._emit(v.kind, v.message, v.node, v.kind, **v.details)
            if v.kill:
                self._kill_node(v.node)
