"""Hang detection for a local worker group: step reports when the script sends them, CPU otherwise.

A group is hung when a worker that has reported steps reports none for ``timeout_seconds``, or,
when no worker reports steps at all, when some worker's CPU use over the last ``timeout_seconds``
stays under ``idle_cpu_percent`` of one core (a rank stuck in a collective or a sleep burns
nothing).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from dlrover_torch.progress import StepRecord, read_progress

log = logging.getLogger(__name__)

CPU_SAMPLE_SECONDS = 0.5


@dataclass(frozen=True)
class HangConfig:
    """When a worker group counts as hung; 0 turns a check off."""

    timeout_seconds: float = 300.0
    idle_cpu_percent: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.timeout_seconds > 0


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds used by a process and its live descendants (None when it is gone)."""
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        total = times.user + times.system
        for child in proc.children(recursive=True):
            try:
                ct = child.cpu_times()
                total += ct.user + ct.system
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return None


class HangDetector:
    """Watches one incarnation of a worker group; ``check`` returns a reason once it is hung."""

    def __init__(
        self,
        config: HangConfig,
        clock: Callable[[], float] = time.monotonic,
        cpu_seconds: Callable[[int], float | None] = process_cpu_seconds,
    ) -> None:
        self.config = config
        self._clock = clock
        self._cpu_seconds = cpu_seconds
        self._pids: dict[int, int] = {}
        self._files: dict[int, str] = {}
        self._last: dict[int, tuple[StepRecord, float]] = {}
        self._cpu: dict[int, deque[tuple[float, float]]] = {}
        self._started = 0.0
        self._next_cpu_sample = 0.0

    def reset(self, pids: dict[int, int], progress_files: dict[int, str]) -> None:
        """Start watching a new group: local rank -> pid, local rank -> progress file."""
        self._pids = dict(pids)
        self._files = dict(progress_files)
        self._last = {}
        self._cpu = {rank: deque() for rank in pids}
        self._started = self._clock()
        self._next_cpu_sample = self._started

    def last_steps(self) -> dict[int, int]:
        """The last step each reporting worker sent (local rank -> step)."""
        return {rank: rec.step for rank, (rec, _) in self._last.items()}

    def check(self) -> str | None:
        """A one-line reason when the group is hung, else None."""
        if not self.config.enabled or not self._pids:
            return None
        now = self._clock()
        timeout = self.config.timeout_seconds
        for rank, path in self._files.items():
            rec = read_progress(path)
            if rec is None:
                continue
            prev = self._last.get(rank)
            if prev is None or prev[0].count != rec.count:
                self._last[rank] = (rec, now)
        if self._last:
            for rank, (rec, seen) in sorted(self._last.items()):
                if now - seen >= timeout:
                    return (
                        f"local rank {rank} reported no step for {now - seen:.1f}s "
                        f"(last step {rec.step}; hang timeout {timeout:g}s)"
                    )
            return None
        return self._check_cpu(now, timeout)

    def _check_cpu(self, now: float, timeout: float) -> str | None:
        """No step reports: a worker idle on CPU for the whole window is hung."""
        if self.config.idle_cpu_percent <= 0 or now < self._next_cpu_sample:
            return None
        self._next_cpu_sample = now + CPU_SAMPLE_SECONDS
        for rank, pid in sorted(self._pids.items()):
            used = self._cpu_seconds(pid)
            if used is None:
                continue
            samples = self._cpu[rank]
            samples.append((now, used))
            while len(samples) > 1 and now - samples[1][0] >= timeout:
                samples.popleft()
            t0, c0 = samples[0]
            window = now - t0
            if window >= timeout:
                percent = 100.0 * (used - c0) / window
                if percent < self.config.idle_cpu_percent:
                    return (
                        f"local rank {rank} (pid {pid}) used {percent:.2f}% CPU over the last "
                        f"{window:.1f}s and reports no steps (hang timeout {timeout:g}s, "
                        f"idle below {self.config.idle_cpu_percent:g}%)"
                    )
        return None
