"""The garbage collector's pauses as a Prometheus histogram (master.observability.gc_pauses)."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, generate_latest

from master.observability.gc_pauses import GcPauses


def _full_scans(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value("dlrover_gc_pause_seconds_count", {"generation": "2"})
    assert value is not None
    return value


def test_each_collection_is_timed_while_started_and_none_after_stop() -> None:
    pauses = GcPauses()
    registry = CollectorRegistry()
    registry.register(pauses)
    assert _full_scans(registry) == 0
    pauses.start()
    try:
        gc.collect()
        gc.collect()
    finally:
        pauses.stop()
    assert _full_scans(registry) == 2
    inf = registry.get_sample_value(
        "dlrover_gc_pause_seconds_bucket", {"generation": "2", "le": "+Inf"}
    )
    assert inf == 2
    total = registry.get_sample_value("dlrover_gc_pause_seconds_sum", {"generation": "2"})
    assert total is not None and total > 0
    collections, longest = pauses.take_worst()[2]
    assert collections == 2 and 0 < longest <= total
    assert pauses.take_worst()[2] == (2, 0.0)  # the longest is forgotten once taken
    gc.collect()  # stopped: not counted
    assert _full_scans(registry) == 2
    assert b'dlrover_gc_pause_seconds_bucket{generation="0",le="0.001"}' in generate_latest(
        registry
    )


def test_start_twice_hooks_once() -> None:
    pauses = GcPauses()
    pauses.start()
    pauses.start()
    try:
        assert sum(1 for c in gc.callbacks if c == pauses._hook) == 1
    finally:
        pauses.stop()
    assert all(c != pauses._hook for c in gc.callbacks)
