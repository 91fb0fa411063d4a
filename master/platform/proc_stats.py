"""CPU time of local process groups, read from /proc (Linux): how busy a node is even when
its program reports nothing to the master."""

from __future__ import annotations

import os
from collections.abc import Collection

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_groups_cpu_seconds(
    pgids: Collection[int], proc_root: str = "/proc"
) -> dict[int, float]:
    """User + system CPU seconds of the live processes of each group in `pgids`, in one pass
    over /proc; a group with no process left (or /proc unreadable) is left out."""
    wanted = set(pgids)
    totals: dict[int, float] = {}
    if not wanted:
        return totals
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return totals
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc_root, entry, "stat"), "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        # Fields after the command (which may hold spaces) start after its closing ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 13 or int(fields[2]) not in wanted:
            continue
        pgid = int(fields[2])
        totals[pgid] = totals.get(pgid, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS
    return totals
