"""Helpers more than one benchmark uses: this checkout on `sys.path`, one percentile, and the
spawned processes (with their CPU use) that the sharding and scale benchmarks drive.

Standard library only at import time: the anchors' Python (DLRover's venv) may import it too.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing.context
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository's root: this checkout."""

T = TypeVar("T")


def use_checkout() -> None:
    """Put this checkout first on `sys.path`: `master` and `dlrover_*` are its code, also where
    the environment's editable install points at another checkout."""
    sys.path.insert(0, ROOT)


def percentile(sorted_values: Sequence[T], q: float) -> T | float:
    """The value at index floor(q/100 * n) of an ascending sequence (q in [0, 100]), nan if empty:
    the smallest value with more than q% of the values at or below it (at 50, the upper middle
    of an even count)."""
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sleep_until(t: float) -> None:
    """Sleep until time.monotonic() reaches `t` (not at all if it has)."""
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class Child:
    """A spawned process and the parent's end of its pipe; stop() never leaves it running."""

    def __init__(
        self,
        ctx: multiprocessing.context.SpawnContext,
        name: str,
        target: Callable[..., None],
        *args: object,
    ) -> None:
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), name=name, daemon=True)
        self.proc.start()
        child_conn.close()

    def recv(self, timeout: float, what: str) -> tuple:
        """The child's next message; raises if it does not come in time, the child exited, or
        the message is ("error", why)."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout:.0f}s while {what}")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"{self.name} exited (code {self.proc.exitcode}) while {what}"
            ) from None
        if msg[0] == "error":
            raise RuntimeError(f"{self.name}: {msg[1]}")
        return msg

    def stop(self) -> None:
        """Ask the child to stop (None on the pipe), then terminate, then kill it."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.proc.join(3)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(3)
        self.conn.close()


class CpuMeter:
    """CPU seconds used by the server, by the client processes, and by everything else."""

    def __init__(self, server: Child, client_procs: list[Child]) -> None:
        import psutil

        self._psutil = psutil
        self._server = psutil.Process(server.proc.pid)
        self._clients = [psutil.Process(c.proc.pid) for c in client_procs]

    def sample(self) -> tuple[float, float, float]:
        """(server, clients, everything else) CPU seconds so far; the last one machine-wide."""

        def used(p) -> float:
            t = p.cpu_times()
            return t.user + t.system

        machine = self._psutil.cpu_times()
        busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        server = used(self._server)
        clients = sum(used(p) for p in self._clients)
        return server, clients, busy - server - clients
