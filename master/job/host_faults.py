"""Host losses by fault injection (`--kill TYPE:RANK@WHEN:node`): the platform takes away the
target's host with every process on it (`Platform.remove_host`: a Ray node's raylet killed);
the fault counts as fired only once the platform sees the host gone, which takes seconds, so
each removal is followed across control loop ticks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from master.job.events import Emit
from master.platform.api import HostRemoval, PlatformError

if TYPE_CHECKING:
    from master.nodes.model import Node
    from master.platform.api import Platform


class Fault(Protocol):
    """What a removal needs of its fault (a `master.job.faults.Fault`, which imports this)."""

    signal: int
    action: Enum

    def describe(self) -> str: ...


# The `fault` event reason of a fault that was due and tried but did not take (the host did not
# go). Not counted as fired. One the platform refuses (a host the job cannot go on without) is
# skipped, as one whose target is not running.
FAULT_FAILED = "fault_failed"


@dataclass
class _Removal:
    fault: Fault
    node: Node
    removal: HostRemoval
    global_step: int
    started: float  # wall time


class HostRemovals:
    """The host removals under way: started by the injector, said fired once gone."""

    def __init__(self, platform: Platform, emit: Emit) -> None:
        self._platform = platform
        self._emit = emit
        self._pending: list[_Removal] = []

    def start(self, fault: Fault, node: Node, global_step: int) -> bool:
        """Start removing `node`'s host; False if the platform refuses (said as a skipped fault:
        this target's host may not go, e.g. it also holds the master)."""
        try:
            removal = self._platform.remove_host(node.id)
        except PlatformError as e:
            self._emit(
                "fault",
                f"fault injection: {fault.describe()}: refused, skipped: {e}",
                node,
                "skipped",
                action=fault.action.value,
            )
            return False
        self._pending.append(_Removal(fault, node, removal, global_step, time.time()))
        self._emit(
            "fault_started",
            f"fault injection: {fault.describe()}: removing {removal.host} (id {node.id}); "
            "it counts once the platform sees the host gone",
            node,
            action=fault.action.value,
            host=removal.host,
        )
        return True

    def poll(self) -> None:
        """Say each removal that ended: fired once its host is gone, else failed."""
        for r in list(self._pending):
            outcome = r.removal.outcome()
            if outcome is None:
                continue
            self._pending.remove(r)
            took = time.time() - r.started
            if outcome:
                self._emit(
                    "fault",
                    f"fault injection: {r.fault.describe()} (id {r.node.id}, at global step "
                    f"{r.global_step}): {r.removal.host} gone {took:.1f}s after its removal began",
                    r.node,
                    "fault_injection",
                    signal=int(r.fault.signal),
                    global_step=r.global_step,
                    action=r.fault.action.value,
                    host=r.removal.host,
                    removal_started=r.started,
                    **dict(r.removal.details),
                )
            else:
                self._emit(
                    "fault",
                    f"fault injection: {r.fault.describe()}: {r.removal.host} did not go: "
                    f"{r.removal.error}",
                    r.node,
                    FAULT_FAILED,
                    action=r.fault.action.value,
                    host=r.removal.host,
                )

    def report_unfinished(self) -> None:
        """At the job's end: say the removals whose host had not gone yet (never fired)."""
        self.poll()
        for r in self._pending:
            self._emit(
                "fault",
                f"fault injection: {r.fault.describe()}: {r.removal.host} had not gone by the "
                "job's end",
                r.node,
                "not_fired",
                action=r.fault.action.value,
            )
        self._pending.clear()
