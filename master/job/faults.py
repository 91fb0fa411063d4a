"""Fault injection for rehearsing failures: `--kill TYPE:RANK@WHEN` on `dlrover submit`."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from master.config import NODE_TYPES

_PATTERN = re.compile(
    r"^(?P<type>[a-z]+):(?P<rank>\d+)@(?:(?P<pct>\d+(?:\.\d+)?)%|(?P<secs>\d+(?:\.\d+)?)s"
    r"|step=(?P<step>\d+))(?::(?P<sig>[A-Z0-9]+))?$"
)


# `--kill master:0@...`: the master kills itself; its supervisor restarts it.
MASTER = "master"


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
    signal: int = signal.SIGKILL

    def describe(self) -> str:
        if self.at_percent is not None:
            when = f"{self.at_percent:g}% of the records done"
        elif self.at_seconds is not None:
            when = f"{self.at_seconds:g}s after start"
        else:
            when = f"global step {self.at_step}"
        return f"{signal.Signals(self.signal).name} to {self.node_type}-{self.rank} at {when}"


def parse_fault(text: str) -> Fault:
    """Parse 'worker:1@50%', 'ps:0@30s', 'chief:0@step=1000', 'master:0@40%' (optionally
    followed by ':SIGTERM')."""
    m = _PATTERN.match(text.strip())
    if not m:
        raise FaultSpecError(
            f"--kill {text!r}: expected TYPE:RANK@WHEN with WHEN one of 50% (of the records), "
            "30s (after start) or step=1000, optionally followed by :SIGTERM; "
            "for example --kill worker:1@50%"
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
    if m["sig"]:
        name = m["sig"] if m["sig"].startswith("SIG") else "SIG" + m["sig"]
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
        signal=int(sig),
    )


def due(fault: Fault, percent_done: float, seconds: float, global_step: int) -> bool:
    """Whether the fault's trigger has been reached."""
    if fault.at_percent is not None:
        return percent_done >= fault.at_percent
    if fault.at_seconds is not None:
        return seconds >= fault.at_seconds
    return fault.at_step is not None and global_step >= fault.at_step
