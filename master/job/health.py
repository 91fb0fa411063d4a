"""Node health: lost heartbeats, hung trainers and stragglers, each judged once per node.

`heartbeat_verdicts`, `hang_verdicts` and `straggler_verdicts` are pure: current nodes and
times in, `HealthVerdict`s out. `HealthMonitor` is the part of the job that gathers what they
need and applies each verdict: record the finding on the node, the event, kill it where the
verdict says (its exit is then handled as any other, see master.job.exits)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from master.job.diagnosis import find_stragglers
from master.job.events import Emit
from master.nodes.manager import step_time_samples
from master.nodes.model import Finding, Node, NodeState
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


@dataclass(frozen=True)
class HealthVerdict:
    """One finding about one node: the event to record, the flags to set, whether to kill it."""

    node: Node
    kind: str  # the event kind, also its reason: heartbeat_lost | hang | straggler
    message: str
    marks: tuple[Finding, ...]  # what to record on the node (each is found once per node)
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
    return (
        f"its process still exists but is idle ({cpu_percent:.1f}% CPU): blocked, waiting or "
        "stopped (SIGSTOP)"
    )


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
        if not heartbeat_lost(node, now, timeout) or Finding.HEARTBEAT_LOST in node.findings:
            continue
        cause = silence_cause((measured_cpu or {}).get(node.id))
        verdicts.append(
            HealthVerdict(
                node,
                "heartbeat_lost",
                f"{node.name} (id {node.id}) sent no heartbeat for {timeout:g}s"
                + (f" ({cause})" if cause else "")
                + "; killing it",
                (Finding.HEARTBEAT_LOST,),
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
            (Finding.HUNG,),
            kill=True,
            details={"timeout_seconds": timeout, "steps": node.steps},
        )
        for node in nodes
        if Finding.HUNG not in node.findings
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
        if Finding.STRAGGLER in node.findings:
            continue
        verdicts.append(
            HealthVerdict(
                node,
                "straggler",
                f"{node.name} (id {node.id}) is a straggler: {node.step_seconds * 1000:.0f} ms "
                f"per step, {factor:.1f}x its peers' median"
                + ("; replacing it" if replace else ""),
                (Finding.STRAGGLER, Finding.STRAGGLER_REPLACED)
                if replace
                else (Finding.STRAGGLER,),
                kill=replace,
                details={
                    "step_seconds": round(node.step_seconds, 4),
                    "slowdown": round(factor, 2),
                    "action": "replace" if replace else "report",
                },
            )
        )
    return verdicts


class HealthMonitor:
    """Runs the health checks from the control loop and applies their verdicts."""

    def __init__(
        self,
        spec: JobSpec,
        nodes: NodeManager,
        sharding: ShardingService,
        measured_cpu: Mapping[int, float],
        recovering: Callable[[], bool],
        kill: Callable[[Node], None],
        emit: Emit,
    ) -> None:
        self._spec = spec
        self._nodes = nodes
        self._sharding = sharding
        self._measured_cpu = measured_cpu  # node id -> CPU % the platform measured (live view)
        self._recovering = recovering  # the job's start or a PS recovery before its first step
        self._kill = kill
        self._emit = emit
        self._stragglers_checked_at = 0.0
        self._hang_clock_from = 0.0  # hang clocks run from here at the earliest (a pause's end)

    def check(self) -> None:
        """Control loop: lost heartbeats, hung trainers, then (every few seconds) stragglers."""
        spec = self._spec
        now = time.monotonic()
        self._apply(
            heartbeat_verdicts(
                self._nodes.all_current(), now, spec.heartbeat_timeout_seconds, self._measured_cpu
            )
        )
        timeout = spec.hang_timeout_seconds
        nodes = self._nodes.all_current()
        now = time.monotonic()
        recovering = self._recovering()
        if recovering:
            self._nodes.restart_step_clocks(now)  # the pause is no trainer's step time
        if timeout > 0:
            if recovering or not any(n.steps for n in nodes):
                # The job's start or a PS recovery: trainers holding shards wait for sessions
                # and a restore (tens of seconds on a loaded machine), they are not hung. Each
                # gets a full timeout from the pause's end.
                self._hang_clock_from = now
            else:
                holding = self._sharding.holders()
                self._apply(hang_verdicts(nodes, now, timeout, holding, self._hang_clock_from))
        now = time.monotonic()
        if spec.stragglers != "off" and now - self._stragglers_checked_at >= (
            STRAGGLER_CHECK_SECONDS
        ):
            self._stragglers_checked_at = now
            self._apply(
                straggler_verdicts(
                    self._nodes.all_current(), spec.stragglers, spec.straggler_min_steps
                )
            )

    def silent_node_cause(self, key: tuple[str, int]) -> str:
        """What a node whose rendezvous lease lapsed is doing (see silence_cause)."""
        node = self._nodes.current(*key)
        return silence_cause(self._measured_cpu.get(node.id)) if node is not None else ""

    def _apply(self, verdicts: Iterable[HealthVerdict]) -> None:
        for v in verdicts:
            v.node.findings.update(v.marks)
            self._emit(v.kind, v.message, v.node, v.kind, **v.details)
            if v.kill:
                self._kill(v.node)
