"""The garbage collector's pauses of the master's process, as a Prometheus histogram.

A collection holds the interpreter lock: every call the master is answering waits for it. A
latency spike that lines up with `dlrover_gc_pause_seconds{generation="2"}` is the collector
(see master.rpc.serving_gc for the master's settings)."""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Iterable

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

GC_PAUSE_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GENERATIONS = 3


class GcPauses(Collector):
    """Times every collection from a `gc.callbacks` hook while started.

    The hook keeps plain counters: it runs inside the collector, which may have interrupted
    this very thread while it held a metrics lock, so it must not take one."""

    def __init__(self) -> None:
        self._began = 0.0
        # Per generation: observations per bucket (the last one beyond every bound), the sum.
        self._counts = [[0] * (len(GC_PAUSE_BUCKETS_SECONDS) + 1) for _ in range(GENERATIONS)]
        self._sums = [0.0] * GENERATIONS
        self._worst = [0.0] * GENERATIONS  # the longest since the last `take_worst`

    def start(self) -> None:
        if self._hook not in gc.callbacks:
            gc.callbacks.append(self._hook)

    def stop(self) -> None:
        if self._hook in gc.callbacks:
            gc.callbacks.remove(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        seconds = time.perf_counter() - self._began
        generation = info["generation"]
        self._counts[generation][bisect.bisect_left(GC_PAUSE_BUCKETS_SECONDS, seconds)] += 1
        self._sums[generation] += seconds
        if seconds > self._worst[generation]:
            self._worst[generation] = seconds

    def take_worst(self) -> list[tuple[int, float]]:
        """Per generation: (collections so far, the longest pause in seconds since the last
        call); the longest are forgotten."""
        worst, self._worst = self._worst, [0.0] * GENERATIONS
        return [(sum(self._counts[g]), worst[g]) for g in range(GENERATIONS)]

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(
            "dlrover_gc_pause_seconds",
            "Pauses of the master's process for a garbage collection, per generation "
            "(2: a full scan)",
            labels=["generation"],
        )
        bounds = [*(str(b) for b in GC_PAUSE_BUCKETS_SECONDS), "+Inf"]
        for generation in range(GENERATIONS):
            total = 0
            buckets = []
            for bound, count in zip(bounds, self._counts[generation], strict=True):
                total += count
                buckets.append((bound, total))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        yield family
