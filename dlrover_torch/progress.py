"""Step reports from the training loop to the dlrover-run agent, for hang detection.

Usage in a training script (works unchanged under torchrun, where it does nothing)::

    from dlrover_torch.progress import StepReporter

    reporter = StepReporter.from_env()
    for step in range(start, steps):
        train_one_step()
        reporter.report(step)

A report is one ``pwrite`` of 16 bytes into a small file the agent gave this worker, so it costs
microseconds and never blocks on the agent.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV_PROGRESS_FILE = "DLROVER_PROGRESS_FILE"
_RECORD = struct.Struct("<qq")  # (last step, number of reports)


class StepReporter:
    """Writes the latest step of this worker where its agent can see it."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._count = 0
        self._fd: int | None = None
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        else:
            log.debug("%s is not set: step reports go nowhere", ENV_PROGRESS_FILE)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepReporter:
        """The reporter for this worker; inert outside dlrover-run (e.g. under torchrun)."""
        env = os.environ if env is None else env
        return cls(env.get(ENV_PROGRESS_FILE) or None)

    @property
    def enabled(self) -> bool:
        """Whether reports reach an agent."""
        return self._fd is not None

    def report(self, step: int) -> None:
        """Record that ``step`` finished."""
        if self._fd is None:
            return
        self._count += 1
        os.pwrite(self._fd, _RECORD.pack(int(step), self._count), 0)

    def close(self) -> None:
        """Release the file descriptor."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class StepRecord:
    """What a worker last reported: its step and how many reports it made."""

    step: int
    count: int


def read_progress(path: str) -> StepRecord | None:
    """The record a worker wrote to ``path``, or None when it has reported nothing."""
    try:
        with open(path, "rb") as f:
            data = f.read(_RECORD.size)
    except FileNotFoundError:
        return None
    if len(data) < _RECORD.size:
        return None
    step, count = _RECORD.unpack(data)
    return StepRecord(step, count) if count > 0 else None
