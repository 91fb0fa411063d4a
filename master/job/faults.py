"""Fault injection for rehearsing failures: `--kill TYPE:RANK@WHEN[:ACTION]` on `dlrover submit`.

`parse_fault` reads a `--kill` value, `faults_due` says which faults fire now (pure), and
`FaultInjector` is the part of the job that fires them: a signal, a freeze (SIGSTOP, then
SIGCONT if the node is still there when the freeze ends), or the loss of the node's host (a Ray
node removed: `host_faults`)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from master.config import NODE_TYPES
from master.job.events import Emit
from master.job.host_faults import HostRemovals
from master.job.model import STOP_GRACE_SECONDS
from master.nodes.model import TRAINING_TYPES, Node, NodeState

if TYPE_CHECKING:
    from master.nodes.manager import NodeManager
    from master.platform.api import Platform
    from master.sharding.service import ShardingService

_PATTERN = re.compile(
    r"^(?P<type>[a-z]+):(?P<rank>\d+)@(?:(?P<pct>\d+(?:\.\d+)?)%|(?P<secs>\d+(?:\.\d+)?)s"
    r"|step=(?P<step>\d+))(?::(?P<sig>[A-Za-z0-9]+)(?:=(?P<arg>\d+(?:\.\d+)?)s?)?)?$"
)


class FaultAction(Enum):
    """What a fault does to its target. KILL sends a signal (SIGKILL unless told); FREEZE sends
    SIGSTOP and SIGCONT when the freeze ends, unless the master ended the node first (a frozen
    process is alive and silent: the heartbeat timeout must find it); REMOVE_NODE takes away the
    platform's host of the target (its Ray node) with every process on it, as a lost machine:
    fired once the platform sees the host gone (`--kill` suffix `:node`, Ray only)."""

    KILL = "kill"
    FREEZE = "freeze"
    REMOVE_NODE = "node"


# `--kill master:0@...`: the master kills itself; its supervisor restarts it.
MASTER = "master"
# How long the other trainers wait for a late target a due fault waits on (then go on).
KEEP_WORK_SECONDS = 120.0
# A freeze with no length given lasts this many heartbeat timeouts, and at least the timeout
# plus FREEZE_MARGIN_SECONDS: long enough that the master must find it, bounded if it does not.
FREEZE_TIMEOUTS = 2.0
FREEZE_MARGIN_SECONDS = 5.0


def default_freeze_seconds(heartbeat_timeout_seconds: float) -> float:
    """How long a freeze given no length lasts, for a job with this heartbeat timeout."""
    return max(
        FREEZE_TIMEOUTS * heartbeat_timeout_seconds,
        heartbeat_timeout_seconds + FREEZE_MARGIN_SECONDS,
    )


class FaultSpecError(ValueError):
    """A --kill value that cannot be understood."""


@dataclass(frozen=True)
class Fault:
    """Kill node TYPE:RANK once, when the trigger is reached."""

    node_type: str
    rank: int
    at_percent: float | None = None  # of all records of all datasets, epochs included
    at_seconds: float | None = None  # since the job started
    at_step: int | None = None  # global step
    signal: int = signal.SIGKILL  # for KILL
    action: FaultAction = FaultAction.KILL
    freeze_seconds: float | None = None  # for FREEZE; None: the injector's default

    def describe(self) -> str:
        if self.at_percent is not None:
            when = f"{self.at_percent:g}% of the records done"
        elif self.at_seconds is not None:
            when = f"{self.at_seconds:g}s after start"
        else:
            when = f"global step {self.at_step}"
        if self.action == FaultAction.REMOVE_NODE:
            return f"the host (Ray node) of {self.node_type}-{self.rank} removed at {when}"
        if self.action == FaultAction.FREEZE:
            span = f" for {self.freeze_seconds:g}s" if self.freeze_seconds is not None else ""
            what = f"SIGSTOP (a freeze{span})"
        else:
            what = signal.Signals(self.signal).name
        return f"{what} to {self.node_type}-{self.rank} at {when}"


def parse_fault(text: str) -> Fault:
    """Parse 'worker:1@50%', 'ps:0@30s', 'chief:0@step=1000', 'master:0@40%' (optionally
    followed by ':SIGTERM', ':freeze' / ':freeze=20s' for a SIGSTOP undone after that, or
    ':node' for the loss of the node's host, its Ray node)."""
    m = _PATTERN.match(text.strip())
    if not m:
        raise FaultSpecError(
            f"--kill {text!r}: expected TYPE:RANK@WHEN with WHEN one of 50% (of the records), "
            "30s (after start) or step=1000, optionally followed by :SIGTERM, :freeze[=20s] or "
            ":node (its Ray node removed); for example --kill worker:1@50%"
        )
    node_type = m["type"]
    if node_type not in (*NODE_TYPES, MASTER):
        raise FaultSpecError(
            f"--kill {text!r}: unknown node type {node_type!r}; use one of "
            f"{(*NODE_TYPES, MASTER)} (master: the job's own master, which is restarted)"
        )
    if node_type == MASTER and int(m["rank"]) != 0:
        raise FaultSpecError(f"--kill {text!r}: a job has one master, master:0")
    sig = signal.SIGKILL
    action = FaultAction.KILL
    if m["sig"] == FaultAction.FREEZE.value:
        action = FaultAction.FREEZE
        if node_type == MASTER:
            raise FaultSpecError(f"--kill {text!r}: the master cannot be frozen, only killed")
    elif m["arg"]:
        raise FaultSpecError(f"--kill {text!r}: only :freeze takes a length (:freeze=20s)")
    elif m["sig"] == FaultAction.REMOVE_NODE.value:
        action = FaultAction.REMOVE_NODE
        if node_type == MASTER:
            raise FaultSpecError(
                f"--kill {text!r}: the master's Ray node is never removed (the job could not "
                "go on); kill the master (master:0@WHEN) or remove a node's Ray node"
            )
    elif m["sig"]:
        name = m["sig"].upper()
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise FaultSpecError(f"--kill {text!r}: unknown signal {m['sig']!r}") from None
    pct = float(m["pct"]) if m["pct"] else None
    if pct is not None and not 0 <= pct <= 100:
        raise FaultSpecError(f"--kill {text!r}: the percentage must be between 0 and 100")
    return Fault(
        node_type=node_type,
        rank=int(m["rank"]),
        at_percent=pct,
        at_seconds=float(m["secs"]) if m["secs"] else None,
        at_step=int(m["step"]) if m["step"] else None,
        signal=int(signal.SIGSTOP if action == FaultAction.FREEZE else sig),
        action=action,
        freeze_seconds=float(m["arg"]) if m["arg"] else None,
    )


def due(fault: Fault, percent_done: float, seconds: float, global_step: int) -> bool:
    """Whether the fault's trigger has been reached."""
    if fault.at_percent is not None:
        return percent_done >= fault.at_percent
    if fault.at_seconds is not None:
        return seconds >= fault.at_seconds
    return fault.at_step is not None and global_step >= fault.at_step


def faults_due(
    faults: Sequence[Fault],
    fired: Collection[int],
    percent_done: float,
    seconds: float,
    global_step: int,
) -> list[int]:
    """The indices of the faults not `fired` yet whose trigger has been reached, in order."""
    return [
        i
        for i, fault in enumerate(faults)
        if i not in fired and due(fault, percent_done, seconds, global_step)
    ]


def waits_for_first_step(
    fault: Fault,
    target: Node,
    holds_shards: bool,
    trainers: Iterable[Node],
    coordinator: int | None,
) -> bool:
    """Whether a fault due on `target` waits for the target's first reported step: a kill at
    a share of the records or at a step rehearses a trainer dying mid-training, and a trainer
    started late (a loaded machine) may not have trained when the others reach the trigger.
    It waits only where trainers report steps: the target `holds_shards`, or another trainer
    (not a TF2 coordinator, `coordinator`, which reports for workers that never do) stepped."""
    if fault.at_seconds is not None or target.type not in TRAINING_TYPES or has_trained(target):
        return False
    if holds_shards:  # it reads the master's shards, so it reports its steps
        return True
    return any(has_trained(n) for n in trainers if n.id not in (target.id, coordinator))


def has_trained(node: Node) -> bool:
    """Whether the incarnation reported a step: its own (a shard reader), or a global step in
    its heartbeats (a torch agent, whose workers report none of their own)."""
    return node.steps > 0 or node.global_step > 0


def unfired_message(fault: Fault, reports_progress: bool) -> str:
    """What to say of a fault whose trigger was never reached by the job's end; a percentage
    or a step never comes for a program that reports no records or steps."""
    message = f"fault injection: {fault.describe()} never fired before the job's end"
    if not reports_progress and fault.at_seconds is None:
        message += (
            ": the program reports no records or steps to the master, so use a time, "
            f"e.g. --kill {fault.node_type}:{fault.rank}@30s"
        )
    return message


@dataclass(frozen=True)
class JobProgress:
    """Where the job is, as the faults' triggers read it."""

    percent_done: float  # of all records of all datasets, epochs included
    seconds: float  # since the job started
    global_step: int


class FaultInjector:
    """Fires the faults given at submit from the control loop; remembers which fired."""

    def __init__(
        self,
        faults: Sequence[Fault],
        nodes: NodeManager,
        platform: Platform,
        sharding: ShardingService,
        coordinator: Callable[[], Node | None],
        catch_up_positions: Callable[[], int],
        emit: Emit,
        save: Callable[[], None],
        freeze_seconds: float = FREEZE_MARGIN_SECONDS,
    ) -> None:
        self._faults = list(faults)
        self._freeze_seconds = freeze_seconds  # a freeze given no length
        self._frozen: dict[int, tuple[Node, float]] = {}  # node id -> (node, thaw at, monotonic)
        self._hit: set[int] = set()  # incarnations a fault hit (a second one waits for the next)
        self._nodes = nodes
        self._platform = platform
        self._sharding = sharding
        self._coordinator = coordinator  # the running TF2 coordinator, if any
        self._catch_up_positions = catch_up_positions
        self._emit = emit
        self._save = save  # writes the runtime record (which holds `fired`)
        self.fired: list[int] = []  # indices into the faults given at submit
        self._waiting: dict[int, float] = {}  # target a due fault waits on -> since when
        self._said_not_running: set[int] = set()  # incarnations a fault was said to wait on
        self._kept_datasets: set[str] = set()  # datasets whose shards are kept for it
        self._hosts = HostRemovals(platform, emit)  # hosts being removed (REMOVE_NODE)

    @property
    def pending(self) -> bool:
        """Some fault has not fired yet."""
        return len(self.fired) < len(self._faults)

    def tick(self, progress: Callable[[], JobProgress]) -> None:
        """Control loop: fire each fault whose trigger is reached (`progress` is asked once,
        after coalesced positions were caught up where a percentage is due)."""
        self._thaw_due()
        self._hosts.poll()
        if not self.pending:
            return
        if any(f.at_percent is not None for i, f in enumerate(self._faults) if i not in self.fired):
            # Coalesced reports lag by up to their interval: count the steps taken so far, so
            # a fault fires at its percentage, not at the next report (or checkpoint flush).
            self._catch_up_positions()
        now = progress()
        waiting_on = None
        for i in faults_due(
            self._faults, self.fired, now.percent_done, now.seconds, now.global_step
        ):
            fault = self._faults[i]
            node = self._nodes.current(fault.node_type, fault.rank)
            if node is not None and node.id in self._hit:
                continue  # one fault per incarnation: this one waits for the next
            if fault.node_type != MASTER and node and self._before_first_step(fault, node):
                waiting_on = waiting_on or node
                continue
            if fault.node_type != MASTER and node and self._before_running(fault, node):
                continue
            # Recorded before it acts, so a restarted master never fires it again.
            self.fired.append(i)
            self._save()
            if fault.node_type == MASTER:
                self._kill_self(fault, now.global_step)
                continue
            if node is None or node.state != NodeState.RUNNING:
                self._skipped(fault)
                continue
            if fault.action == FaultAction.FREEZE:
                self._freeze(fault, node, now.global_step)
                continue
            if fault.action == FaultAction.REMOVE_NODE:
                if self._hosts.start(fault, node, now.global_step):
                    self._hit.add(node.id)
                continue
            if not self._platform.signal_node(node.id, fault.signal):
                self._skipped(fault)  # it ended meanwhile: the signal reached nothing
                continue
            self._hit.add(node.id)
            self._emit(
                "fault",
                f"fault injection: {fault.describe()} (id {node.id}, at global step "
                f"{now.global_step})",
                node,
                "fault_injection",
                signal=int(fault.signal),
                global_step=now.global_step,
                action=fault.action.value,
            )
        self._keep_work_for(waiting_on)

    def _skipped(self, fault: Fault) -> None:
        self._emit(
            "fault",
            f"fault injection: {fault.describe()}: node not running, skipped",
            reason="skipped",
        )

    def _freeze(self, fault: Fault, node: Node, global_step: int) -> None:
        """SIGSTOP the node (all its processes); SIGCONT when the freeze ends (_thaw_due)."""
        seconds = (
            fault.freeze_seconds if fault.freeze_seconds is not None else (self._freeze_seconds)
        )
        if not self._platform.signal_node(node.id, signal.SIGSTOP):
            self._skipped(fault)
            return
        self._frozen[node.id] = (node, time.monotonic() + seconds)
        self._hit.add(node.id)
        self._emit(
            "fault",
            f"fault injection: {fault.describe()} (id {node.id}, at global step {global_step}; "
            f"SIGCONT in {seconds:g}s unless the master ends it first)",
            node,
            "fault_injection",
            signal=int(signal.SIGSTOP),
            global_step=global_step,
            action=fault.action.value,
            freeze_seconds=seconds,
        )

    def _thaw_due(self) -> None:
        """SIGCONT each frozen node whose freeze is over and that the master has not ended:
        said as an event, since the master did not find it within the freeze."""
        now = time.monotonic()
        for node_id, (node, until) in list(self._frozen.items()):
            if node.state.ended:
                del self._frozen[node_id]  # found and ended: nothing to undo
            elif now >= until:
                del self._frozen[node_id]
                self._hit.discard(node_id)  # it lives on: a later fault may hit it
                if self._platform.signal_node(node_id, signal.SIGCONT):
                    self._emit(
                        "fault",
                        f"fault injection: {node.name} (id {node_id}) thawed (SIGCONT) at the "
                        "end of its freeze: the master had not ended it",
                        node,
                        "fault_thawed",
                    )

    def _keep_work_for(self, target: Node | None) -> None:
        """While a due fault waits for `target`'s first step, keep what its peers read for it
        (their asks wait): the kill lands near its trigger, and a trainer started late does not
        find the data done and never die. For at most KEEP_WORK_SECONDS; `None` ends it."""
        if target is not None and time.monotonic() - self._waiting[target.id] > (KEEP_WORK_SECONDS):
            if self._kept_datasets:
                self._emit(
                    "fault_waiting",
                    f"fault injection: {target.name} has not trained after "
                    f"{KEEP_WORK_SECONDS:g} s; the others train on without waiting for it",
                    target,
                )
            target = None
        if target is None:
            self._kept_datasets.clear()
            self._sharding.keep_work_for(None)
            return
        others = [n for n in self._nodes.all_current() if n.id != target.id]
        peers = [n.id for n in others if n.type == target.type]
        held = self._sharding.datasets_held_by(peers) or self._sharding.datasets_held_by(
            [n.id for n in others if n.type in TRAINING_TYPES]
        )
        # Sticky: a peer whose ask waits holds nothing of that dataset any more.
        self._kept_datasets |= held
        self._sharding.keep_work_for(target.id, self._kept_datasets)

    def _before_first_step(self, fault: Fault, target: Node) -> bool:
        """Whether the due `fault` waits for its target's first step (said once); a target
        still starting (pending) waits too, where a running one would."""
        if target.state.ended:
            return False
        coordinator = self._coordinator()
        trainers = self._nodes.all_current()
        holds = self._sharding.holds_shards(target.id)
        if not waits_for_first_step(fault, target, holds, trainers, coordinator and coordinator.id):
            return False
        if target.id not in self._waiting:
            self._waiting[target.id] = time.monotonic()
            self._emit(
                "fault_waiting",
                f"fault injection: {fault.describe()} is due; waiting for {target.name}'s "
                "first step (it has not trained yet; the others wait for it)",
                target,
            )
        return True

    def _before_running(self, fault: Fault, target: Node) -> bool:
        """Whether the due `fault` waits for its target to run: an incarnation starting, or one
        that failed or was stopped and is being relaunched (said once). One that succeeded
        will not come back: the fault is skipped."""
        if target.state in (NodeState.RUNNING, NodeState.SUCCEEDED):
            return False
        if target.id not in self._said_not_running:
            self._said_not_running.add(target.id)
            self._emit(
                "fault_waiting",
                f"fault injection: {fault.describe()} is due; waiting for {target.name} to "
                f"run ({target.state.value} now)",
                target,
            )
        return True

    def report_unfired(self, reports_progress: bool) -> None:
        """At the job's end: say which faults never fired, and why where it is known."""
        self._hosts.report_unfinished()
        for i, fault in enumerate(self._faults):
            if i not in self.fired:
                self._emit("fault", unfired_message(fault, reports_progress), reason="not_fired")

    def _kill_self(self, fault: Fault, global_step: int) -> None:
        """Fault injection on the master: record it as fired, then die by the signal."""
        self._emit(
            "fault",
            f"fault injection: {fault.describe()} (at global step {global_step})",
            reason="fault_injection",
            signal=int(fault.signal),
            global_step=global_step,
            action=fault.action.value,
        )
        self._sharding.flush()
        os.kill(os.getpid(), fault.signal)
        time.sleep(STOP_GRACE_SECONDS)  # a catchable signal: its handler asks the loop to stop
