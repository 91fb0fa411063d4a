"""Facts about local processes read from /proc (Linux): the CPU time of process groups (how busy
a node is even when its program reports nothing to the master), a process's children and what
they wait on, and the machine's stall pressure."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator

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
    for _, _, fields in _stats(proc_root):
        if len(fields) < 13 or int(fields[2]) not in wanted:
            continue
        pgid = int(fields[2])
        totals[pgid] = totals.get(pgid, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS
    return totals


def children_states(parent: int, proc_root: str = "/proc") -> list[str]:
    """Each child of `parent` as "name[pid] state wait-channel" (e.g. "raylet[42] D
    folio_wait_bit"), in one pass over /proc."""
    out = []
    for pid, name, fields in _stats(proc_root):
        if len(fields) > 1 and fields[1] == str(parent):
            wchan = _read(os.path.join(proc_root, pid, "wchan")) or "-"
            out.append(f"{name}[{pid}] {fields[0]} {wchan}")
    return out


def stall_pressure(proc_root: str = "/proc") -> list[str]:
    """The kernel's CPU, I/O and memory stall pressure ("io: some avg10=..."), where it has it."""
    lines = []
    for kind in ("cpu", "io", "memory"):
        text = _read(os.path.join(proc_root, "pressure", kind))
        if text:
            lines.append(f"{kind}: {text.splitlines()[0]}")
    return lines


def _stats(proc_root: str) -> Iterator[tuple[str, str, list[str]]]:
    """(pid, command name, the fields after it) of each process /proc lists."""
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        stat = _read(os.path.join(proc_root, entry, "stat"))
        # The command (which may hold spaces or parentheses) ends at the last ')'.
        head, _, rest = stat.rpartition(")")
        if head:
            yield entry, head.partition("(")[2], rest.split()


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace").strip()
    except OSError:
        return ""
