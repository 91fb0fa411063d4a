"""A job that may be stuck: no step report and every process near idle for `stuck_timeout`.

Programs without our hooks report nothing, so the master watches what it can see: each node's
CPU use (master.platform's `cpu_seconds`, or its heartbeats) and last log line. The pure part:
`cpu_percent`, `is_quiet`, `likely_cause` and `stuck_verdict`; `StuckWatch` is the part of the
job that samples, judges once per quiet spell, and reports or fails the job."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from master.job.events import Emit
from master.job.exit_plan import last_line
from master.nodes.model import Node, NodeState

if TYPE_CHECKING:
    from master.config import JobSpec
    from master.nodes.manager import NodeManager
    from master.platform.api import Platform

# A node using less than this share of one core is near idle.
IDLE_CPU_PERCENT = 5.0
CPU_SAMPLE_SECONDS = 2.0
LOG_TAIL_BYTES = 4096
STUCK = "possibly stuck"


@dataclass(frozen=True)
class NodeActivity:
    """What the master sees of one running node: its CPU use (None: unknown), last log line."""

    name: str
    state: str
    cpu_percent: float | None
    last_line: str = ""

    def describe(self) -> str:
        cpu = "cpu unknown" if self.cpu_percent is None else f"cpu {self.cpu_percent:.1f}%"
        tail = f", last log line: {self.last_line!r}" if self.last_line else ", no output"
        return f"{self.name} {self.state}, {cpu}{tail}"


@dataclass(frozen=True)
class StuckVerdict:
    """The job looks stuck: the event's message, the likely cause, and whether to fail it."""

    message: str
    cause: str
    fail: bool
    details: dict[str, Any] = field(default_factory=dict)


def cpu_percent(
    previous: tuple[float, float] | None, now: float, cpu_seconds: float | None
) -> float | None:
    """Percent of one core used between a previous (time, cpu seconds) sample and now."""
    if previous is None or cpu_seconds is None or now <= previous[0]:
        return None
    return max(0.0, 100.0 * (cpu_seconds - previous[1]) / (now - previous[0]))


def is_quiet(activities: Iterable[NodeActivity]) -> bool:
    """Every running node's CPU use is known and near idle (and at least one runs)."""
    running = [a for a in activities if a.state == NodeState.RUNNING.value]
    return bool(running) and all(
        a.cpu_percent is not None and a.cpu_percent < IDLE_CPU_PERCENT for a in running
    )


def likely_cause(nodes: Iterable[Node], listed: Mapping[str, int], reserved_slots: bool) -> str:
    """Why a TF job waits, where it is known: a task TF_CONFIG lists (`listed` per type) that no
    running node serves; a TF2 coordinator waits for every listed worker."""
    running = {(n.type, n.rank) for n in nodes if n.state == NodeState.RUNNING}
    missing = [
        f"{t}-{r}" for t, count in listed.items() for r in range(count) if (t, r) not in running
    ]
    if not missing:
        return ""
    verb = "is" if len(missing) == 1 else "are"
    cause = (
        f"{', '.join(missing)} {verb} listed in TF_CONFIG but not running; "
        "a TF2 coordinator waits for every worker TF_CONFIG lists"
    )
    if reserved_slots and all(m.startswith("worker-") for m in missing):
        cause += (
            " (the job reserves worker slots: remove worker.reserve_slots and "
            "worker.max_replicas, or scale the workers up to fill them)"
        )
    return cause


def stuck_verdict(
    activities: Sequence[NodeActivity],
    quiet_for: float,
    timeout: float,
    cause: str,
    action: str,
) -> StuckVerdict | None:
    """A verdict once the job has been quiet (no step, every node near idle) for `timeout`
    seconds (0: off); `action` "fail" fails the job, "report" says so only."""
    if timeout <= 0 or quiet_for < timeout:
        return None
    head = (
        f"{STUCK}: no step report and every node near idle for {quiet_for:.0f}s "
        f"(stuck_timeout_seconds: {timeout:g})"
    )
    head += f"; likely cause: {cause}" if cause else ""
    lines = [head, *(f"  {a.describe()}" for a in activities)]
    if action == "fail":
        lines.append("  failing the job (stuck_action: fail)")
    return StuckVerdict(
        "\n".join(lines),
        cause,
        fail=action == "fail",
        details={
            "quiet_seconds": round(quiet_for, 1),
            "cause": cause,
            "nodes": [
                {"name": a.name, "cpu_percent": a.cpu_percent, "last_line": a.last_line}
                for a in activities
            ],
        },
    )


def read_last_line(path: str) -> str:
    """The last non-blank line of a node's log file ('' when unreadable)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return last_line(f.read().decode("utf-8", "replace"))
    except OSError:
        return ""


class StuckWatch:
    """Samples node CPU and judges, once per quiet spell, whether the job is stuck."""

    def __init__(
        self,
        spec: JobSpec,
        nodes: NodeManager,
        platform: Platform,
        tf_cluster: Callable[[], dict[str, list[str]]],
        emit: Emit,
        fail: Callable[[str], None],
    ) -> None:
        self._spec = spec
        self._nodes = nodes
        self._platform = platform
        self._tf_cluster = tf_cluster
        self._emit = emit
        self._fail = fail  # fails the job with a reason
        self._cpu_samples: dict[int, tuple[float, float]] = {}  # id -> (time, cpu seconds)
        # node id -> CPU % the platform measured; read live by the health checks.
        self.measured_cpu: dict[int, float] = {}
        self._sampled_at = 0.0
        self._quiet_since: float | None = None
        self._quiet_step = 0
        self.note = ""  # "possibly stuck: ..." while the job looks stuck

    def _sample_cpu(self, now: float) -> None:
        """Each running node's CPU use since the last sample, where the platform measures it
        (a node that sends heartbeats keeps the figure they bring)."""
        nodes = self._nodes.all_current()
        measured = self._platform.cpu_seconds([n.id for n in nodes if n.state == NodeState.RUNNING])
        for node in nodes:
            if node.state != NodeState.RUNNING:
                self._cpu_samples.pop(node.id, None)
                self.measured_cpu.pop(node.id, None)
                continue
            used = measured.get(node.id)
            percent = cpu_percent(self._cpu_samples.get(node.id), now, used)
            if used is not None:
                self._cpu_samples[node.id] = (now, used)
            if percent is None:
                continue
            self.measured_cpu[node.id] = percent
            if not node.registered:
                node.cpu_percent = percent

    def _activities(self, log_lines: bool = False) -> list[NodeActivity]:
        """Each running node's activity; its last log line only with `log_lines` (a file read
        per node: done for a verdict, not at every sample)."""
        measured = set(self._cpu_samples)
        return [
            NodeActivity(
                n.name,
                n.state.value,
                n.cpu_percent if n.id in measured or n.registered else None,
                read_last_line(n.log_path) if log_lines else "",
            )
            for n in self._nodes.all_current()
            if n.state == NodeState.RUNNING
        ]

    def check(self, global_step: int, training_done: bool) -> None:
        """Control loop: sample every CPU_SAMPLE_SECONDS; report (or fail) a quiet job."""
        now = time.monotonic()
        if now - self._sampled_at < CPU_SAMPLE_SECONDS:
            return
        first = not self._sampled_at
        self._sampled_at = now
        self._sample_cpu(now)
        timeout = self._spec.stuck_timeout_seconds
        if first or timeout <= 0 or training_done:
            return
        activities = self._activities()
        if not is_quiet(activities) or global_step != self._quiet_step:
            self._quiet_since, self._quiet_step = None, global_step
            if self.note:
                self.note = ""
                self._emit("stuck_over", "the job is active again (no longer possibly stuck)")
            return
        if self._quiet_since is None:
            self._quiet_since = now - CPU_SAMPLE_SECONDS
        if self.note or now - self._quiet_since < timeout:
            return  # said once per quiet spell, and not before the timeout
        activities = self._activities(log_lines=True)
        listed = {t: len(addrs) for t, addrs in self._tf_cluster().items()}
        cause = likely_cause(self._nodes.all_current(), listed, self._spec.worker.reserves_slots)
        verdict = stuck_verdict(
            activities, now - self._quiet_since, timeout, cause, self._spec.stuck_action
        )
        if verdict is None:
            return
        self.note = verdict.message.splitlines()[0]
        self._emit("stuck", verdict.message, None, "stuck", **verdict.details)
        if verdict.fail:
            self._fail(verdict.message.splitlines()[0])
