"""Time series a master keeps about its job: throughput, data progress and checkpoints.

A sampler thread reads the job's state once per interval and keeps a bounded history, from
which the dashboard draws its charts and the metrics endpoint takes steps/s and records/s. It
also notices new checkpoints in the registry and records them as events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from master.job.master import JobMaster

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_SECONDS = 1.0
MAX_SAMPLES = 3600  # an hour at one sample per second; older samples are thinned
RATE_WINDOW_SECONDS = 5.0  # throughput is averaged over about this long


@dataclass
class Sample:
    """The job at one moment: totals, and rates over the last RATE_WINDOW_SECONDS."""

    time: float
    elapsed: float
    global_step: int
    records_done: int
    steps_per_second: float = 0.0
    records_per_second: float = 0.0
    datasets: dict[str, int] = field(default_factory=dict)  # records done per dataset
    loss: float | None = None


class JobTelemetry:
    """Samples a JobMaster periodically; thread-safe readers get the history and latest rates."""

    def __init__(
        self,
        job: JobMaster,
        interval: float = SAMPLE_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.job = job
        self.interval = interval
        self._clock = clock
        self._samples: deque[Sample] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
        self._last_checkpoint_step: int | None = None
        self._last_checkpoint_time = 0.0
        self.checkpoint_listeners: list[Callable[[int, float | None], None]] = []

    def start(self) -> None:
        """Start sampling in the background (one sample at once)."""
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        """Take a last sample and stop the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # keep sampling: a transient error must not end the charts
                log.exception("telemetry sample failed")

    def sample(self) -> Sample:
        """Read the job once and append a sample."""
        now = self._clock()
        stats = self.job.sharding.stats()
        datasets = {s.name: s.records_done for s in stats}
        current = Sample(
            time=now,
            elapsed=self.job.elapsed(),
            global_step=self.job.global_step,
            records_done=sum(datasets.values()),
            datasets=datasets,
            loss=self.job.last_loss,
        )
        with self._lock:
            base = None
            for s in reversed(self._samples):
                base = s
                if now - s.time >= RATE_WINDOW_SECONDS:
                    break
            if base is not None and now > base.time:
                span = now - base.time
                current.steps_per_second = max(0.0, (current.global_step - base.global_step) / span)
                current.records_per_second = max(
                    0.0, (current.records_done - base.records_done) / span
                )
            self._samples.append(current)
            if len(self._samples) > MAX_SAMPLES:
                # Thin the older half so long jobs keep their whole shape in bounded memory.
                old = list(self._samples)[: MAX_SAMPLES // 2 : 2]
                recent = list(self._samples)[MAX_SAMPLES // 2 :]
                self._samples = deque(old + recent)
        self._check_checkpoint(now)
        return current

    def _check_checkpoint(self, now: float) -> None:
        latest = self.job.checkpoints.latest()
        if latest is None or latest.global_step == self._last_checkpoint_step:
            return
        interval = now - self._last_checkpoint_time if self._last_checkpoint_step else None
        self._last_checkpoint_step = latest.global_step
        self._last_checkpoint_time = now
        self.job.emit(
            "checkpoint",
            f"checkpoint at global step {latest.global_step}",
            global_step=latest.global_step,
            path=latest.path,
            datasets=list(latest.datasets),
            seconds_since_previous=round(interval, 3) if interval is not None else None,
        )
        for listener in self.checkpoint_listeners:
            listener(latest.global_step, interval)

    def latest(self) -> Sample | None:
        """The most recent sample, or None before the first."""
        with self._lock:
            return self._samples[-1] if self._samples else None

    def series(self, since: float = 0.0) -> list[dict]:
        """Samples taken after `since` (a time.time() value), as JSON-able dicts."""
        with self._lock:
            return [asdict(s) for s in self._samples if s.time > since]
