"""The garbage collector of a process that serves many nodes: rare, short pauses of its loop.

CPython's cyclic collector holds the interpreter lock while it scans. With a thousand nodes'
streams open the master tracks some 200,000 objects, and at CPython's thresholds a full scan
came every few seconds and took 60-145 ms (benchmarks/scale.py, 1,000 workers, 2026-11-28):
the worst RPC latencies were those pauses. Inside `serving_gc()` the objects start-up built
(modules, configuration, the servers) are frozen out of every scan, and the young generation is
scanned every `YOUNG_THRESHOLD` allocations instead of every 700, so objects that live for one
call are freed by their reference counts before a scan would promote them to older generations.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

YOUNG_THRESHOLD = 20_000
# Young scans per middle-generation scan, middle scans per full scan (CPython: 10 and 10).
OLDER_THRESHOLDS = (20, 10)


@contextlib.contextmanager
def serving_gc() -> Iterator[None]:
    """Freeze what exists now and scan young objects seldom; restores both on exit."""
    before = gc.get_threshold()
    gc.collect()  # garbage is not frozen with the rest
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
