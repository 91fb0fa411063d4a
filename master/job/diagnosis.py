"""Diagnosis: pure rules from what a node left behind (exit code, log tail, timing) to a cause.

The control loop feeds every failed node's exit status, the tail of its log and what it
reported of itself through `diagnose_exit`; the result names the cause (OOM, communication
error, user-code error, hardware, killed), carries the telling excerpt of the log (the traceback
of a user error) and says whether relaunching could help: an exception before the first step
is deterministic, the same code fails the same way. `find_stragglers` compares step times.
"""

from __future__ import annotations

import bisect
import re
import signal

from master.nodes.model import Diagnosis, ExitReason
from master.nodes.policy import classify_exit

EXCERPT_MAX_LINES = 15
EXCERPT_MAX_CHARS = 2000
# A SIGKILL while the node's last reported RSS was at least this share of its memory limit is
# taken as the kernel's OOM killer (the platform cannot always see the OOM kill itself).
OOM_RSS_SHARE = 0.9
# A node whose mean step time exceeds this many times its peers' median is a straggler.
STRAGGLER_SLOWDOWN = 2.0

_OOM = re.compile(
    r"MemoryError|std::bad_alloc|out of memory|OOM when allocating|ResourceExhaustedError|"
    r"Cannot allocate memory|oom-kill|Killed process \d+",
    re.IGNORECASE,
)
_HARDWARE = re.compile(
    r"ECC error|uncorrectable|Xid \d+|fallen off the bus|NVLink error|Input/output error|"
    r"hardware error|Machine check|Bus error",
    re.IGNORECASE,
)
_COMM = re.compile(
    r"UnavailableError|AbortedError|StatusCode\.UNAVAILABLE|DeadlineExceeded|"
    r"DEADLINE_EXCEEDED|Connection refused|Connection reset|Connection closed|Socket closed|"
    r"failed to connect to all addresses|Broken pipe|ConnectionError|ConnectionResetError|"
    r"NCCL error|ncclSystemError|connectFullMesh|Gloo .*(timed out|failed)|"
    r"RendezvousConnectionError|Network is unreachable|No route to host",
    re.IGNORECASE,
)
# The last line of a Python exception: "ValueError: ...", "pkg.mod.Error: ...", "KeyboardInterrupt".
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Warning)\b(?::.*)?$"
)
_TRACEBACK_START = re.compile(r'^(Traceback \(most recent call last\):|\s*File ".*", line \d+)')


def exception_excerpt(log_tail: str) -> str:
    """The last Python traceback (or bare exception line) in a log tail; '' if there is none.

    Keeps the traceback header, the innermost frames and the exception line, so a reader sees
    where the user's code failed and why, within EXCERPT_MAX_LINES lines.
    """
    lines = log_tail.rstrip().splitlines()
    end = None
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.match(lines[i].strip()) and not lines[i].startswith((" ", "\t")):
            end = i
            break
    if end is None:
        return ""
    start = end
    while start > 0 and (
        lines[start - 1].startswith((" ", "\t")) or _TRACEBACK_START.match(lines[start - 1])
    ):
        start -= 1
        if lines[start].startswith("Traceback"):
            break
    block = lines[start : end + 1]
    if len(block) > EXCERPT_MAX_LINES:
        head = [block[0]] if block[0].startswith("Traceback") else []
        block = head + ["  ..."] + block[-(EXCERPT_MAX_LINES - len(head) - 1) :]
    text = "\n".join(block)
    return text if len(text) <= EXCERPT_MAX_CHARS else "..." + text[-EXCERPT_MAX_CHARS:]


def _last_lines(text: str, n: int = 5) -> str:
    return "\n".join([ln for ln in text.rstrip().splitlines() if ln.strip()][-n:])


def _killed_by(exit_code: int) -> int:
    """The signal that ended the process (shell-style 128+N codes too), or 0."""
    if exit_code < 0:
        return -exit_code
    if exit_code > 128 and exit_code - 128 in (signal.SIGKILL, signal.SIGTERM, signal.SIGBUS):
        return exit_code - 128
    return 0


def diagnose_exit(
    exit_code: int,
    log_tail: str = "",
    *,
    oom_killed: bool = False,
    stop_requested: bool = False,
    reported: ExitReason | None = None,
    started: bool = True,
    memory_limit_mb: int = 0,
    last_rss_bytes: int = 0,
) -> Diagnosis:
    """Classify why a node ended.

    `started` says whether the node got past start-up (made a training step, or registered for
    nodes that do not step); a user-code error before that is deterministic. `memory_limit_mb`
    and `last_rss_bytes` (its last heartbeat) let a bare SIGKILL near the limit count as OOM.
    """
    base = classify_exit(exit_code, oom_killed, stop_requested, reported)
    if base in (ExitReason.STOPPED, ExitReason.SUCCEEDED):
        return Diagnosis(base, base.value)
    if oom_killed:
        return Diagnosis(ExitReason.OOM, "killed by the OOM killer", _last_lines(log_tail))
    sig = _killed_by(exit_code)
    if sig:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGBUS:
            return Diagnosis(ExitReason.HARDWARE, "bus error (SIGBUS)", _last_lines(log_tail))
        limit = memory_limit_mb * 1024 * 1024
        if sig == signal.SIGKILL and limit and last_rss_bytes >= OOM_RSS_SHARE * limit:
            return Diagnosis(
                ExitReason.OOM,
                f"SIGKILL at {last_rss_bytes / 2**20:.0f} MB of its {memory_limit_mb} MB limit",
                _last_lines(log_tail),
            )
        if reported is None or reported in (ExitReason.NONE, ExitReason.UNKNOWN):
            return Diagnosis(ExitReason.KILLED, f"killed by {name}", _last_lines(log_tail))
    excerpt = exception_excerpt(log_tail)
    evidence = excerpt or log_tail
    if reported is not None and reported not in (ExitReason.NONE, ExitReason.UNKNOWN):
        return Diagnosis(
            reported,
            f"the node reported {reported.value}",
            excerpt or _last_lines(log_tail),
            deterministic=reported == ExitReason.USER_ERROR and bool(excerpt) and not started,
        )
    for pattern, reason, what in (
        (_OOM, ExitReason.OOM, "out of memory"),
        (_HARDWARE, ExitReason.HARDWARE, "hardware fault"),
        (_COMM, ExitReason.COMM_ERROR, "communication error"),
    ):
        found = pattern.search(evidence)
        if found:
            return Diagnosis(reason, f"{what} ({found.group(0)})", excerpt or _last_lines(log_tail))
    if excerpt:
        last = excerpt.splitlines()[-1].strip()
        when = "at start-up" if not started else "while training"
        return Diagnosis(
            ExitReason.USER_ERROR,
            f"user-code error {when}: {last}",
            excerpt,
            deterministic=not started,
        )
    return Diagnosis(base, f"exit code {exit_code}", _last_lines(log_tail))


def find_stragglers(
    step_seconds: dict[int, float], slowdown: float = STRAGGLER_SLOWDOWN
) -> dict[int, float]:
    """Nodes (by id) whose mean step time is over `slowdown` times the median of their peers'.

    Returns each straggler's slowdown factor. Needs at least two measured nodes. Sorts once:
    a node's peers are the sorted times without one copy of its own (O(n log n) for n nodes).
    """
    if len(step_seconds) < 2:
        return {}
    ordered = sorted(step_seconds.values())
    found = {}
    for node_id, seconds in step_seconds.items():
        median = _median_without(ordered, bisect.bisect_left(ordered, seconds))
        if median > 0 and seconds > slowdown * median:
            found[node_id] = seconds / median
    return found


def _median_without(ordered: list[float], skip: int) -> float:
    """The median of sorted `ordered` with the value at index `skip` left out."""
    count = len(ordered) - 1

    def at(i: int) -> float:  # the i-th value of what is left
        return ordered[i if i < skip else i + 1]

    mid = count // 2
    return at(mid) if count % 2 else (at(mid - 1) + at(mid)) / 2
