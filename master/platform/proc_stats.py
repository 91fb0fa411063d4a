"""CPU time of a local process group, read from /proc (Linux): how busy a node is even when
its program reports nothing to the master."""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_group_cpu_seconds(pgid: int, proc_root: str = "/proc") -> float | None:
    """User + system CPU seconds of every live process in group `pgid`; None when /proc cannot
    be read or the group has no process left."""
    total, found = 0.0, False
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return None
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
        if len(fields) < 13 or int(fields[2]) != pgid:
            continue
        found = True
        total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total if found else None
