"""Low CPU priority for spare workers while they warm up, restored when one becomes a worker.

A spare runs in a session of its own, so with the kernel's autogroup scheduling (the default on
Linux desktops and most distributions) its share of the CPU is set by its session's autogroup
nice value: the spare lowers it to 19, and the agent sets it back to 0 when it hands the spare a
job. Raising an autogroup's priority back to 0 needs no privilege, unlike a process's nice value,
which is the fallback only where the agent may restore it (root or ``RLIMIT_NICE``). Where
neither works, spares warm at normal priority.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger(__name__)

LOW_NICE = 19
AUTOGROUP = "autogroup"
NICE = "nice"
NONE = "none"


def _autogroup_enabled() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def _may_restore_nice() -> bool:
    """Whether this process may set a nice value back below LOW_NICE (to its own)."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    return soft == resource.RLIM_INFINITY or 20 - soft <= own


def lowering_method() -> str:
    """How spares started by this process lower their priority: autogroup, nice or none."""
    if _autogroup_enabled():
        return AUTOGROUP
    if _may_restore_nice():
        return NICE
    return NONE


def lower_self(method: str) -> None:
    """In the spare: drop this process's CPU priority by ``method`` (errors are ignored)."""
    try:
        if method == AUTOGROUP:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(LOW_NICE))
        elif method == NICE:
            os.setpriority(os.PRIO_PROCESS, 0, LOW_NICE)
    except OSError as e:
        log.debug("could not lower the spare's priority: %s", e)


def restore(pid: int, method: str, nice: int) -> None:
    """In the agent: give spare ``pid`` (every thread of it) the agent's priority again."""
    try:
        if method == AUTOGROUP:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write("0")
        elif method == NICE:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    except (OSError, ValueError) as e:  # the spare exited meanwhile, or no permission
        log.warning("could not restore the CPU priority of spare %s: %s", pid, e)
