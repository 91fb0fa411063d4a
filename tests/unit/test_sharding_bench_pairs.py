"""benchmarks/sharding.py judges the CPU ratio to the echo by the median of alternated pairs;
the benchmarks share one percentile (benchmarks/common.py)."""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


@pytest.fixture(scope="module")
def bench():
    """The benchmark's names the tests use, imported as `python benchmarks/sharding.py` finds
    them (benchmarks/ first on the path); sys.path and the benchmark modules are undone after."""
    path, before = list(sys.path), set(sys.modules)
    sys.path.insert(0, BENCHMARKS)
    try:
        sharding = importlib.import_module("sharding")
        results = importlib.import_module("sharding_results")
        yield SimpleNamespace(
            Figures=importlib.import_module("sharding_phases").Figures,
            build_results=results.build_results,
            median_pair=results.median_pair,
            parse_args=sharding.parse_args,
            percentile=importlib.import_module("common").percentile,
        )
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - before:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(BENCHMARKS + os.sep):
                del sys.modules[name]


def _figures(bench, cpu_us: float, rate: float = 1000.0):
    return bench.Figures(
        round_trips_per_s=rate,
        p50_ms=1.0,
        p99_ms=2.0,
        count=int(rate),
        server_cpu_us=cpu_us,
        client_cpu_us=300.0,
        other_cpu_pct=0.0,
        drain_ms=0.0,
    )


def test_the_judged_pair_is_the_median_ratio_and_every_ratio_is_kept(bench):
    # Master/echo CPU per round trip of three pairs: ratios 3.0, 1.2, 2.0 (median 2.0).
    masters = [_figures(bench, 150.0, 900.0), _figures(bench, 60.0, 1100.0), _figures(bench, 100.0)]
    echoes = [_figures(bench, 50.0), _figures(bench, 50.0), _figures(bench, 50.0, 1500.0)]
    measured = {64: {("master", "coalesced"): masters, ("echo", "coalesced"): echoes}}

    doc = bench.build_results(measured, 1, ["coalesced"])

    top = doc["results"][0]
    assert top["coalesced_cpu_ratio_to_echo"] == 2.0
    assert top["coalesced_cpu_ratios_to_echo"] == [3.0, 1.2, 2.0]
    assert top["coalesced"]["server_cpu_us_per_rt"] == 100.0  # the median pair's own figures
    assert top["echo_coalesced"]["round_trips_per_s"] == 1500.0
    assert doc["coalesced_cpu_within_1_5x_echo_64"] is False


def test_an_even_count_judges_the_upper_middle_pair(bench):
    # Two pairs must not be judged by the better one: the less flattering middle counts.
    masters = [_figures(bench, c) for c in (70.0, 90.0, 80.0, 100.0)]
    echoes = [_figures(bench, 50.0) for _ in masters]
    ours, echo = bench.median_pair(list(zip(masters, echoes, strict=True)))
    assert (ours.server_cpu_us, echo.server_cpu_us) == (90.0, 50.0)


def test_pairs_below_one_are_refused_with_the_flag_named(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--pairs", "0"])
    assert "--pairs must be >= 1, got 0" in capsys.readouterr().err


def test_one_percentile_for_every_benchmark(bench):
    # The value at index floor(q/100 * n): at 50 the upper middle of an even count.
    assert bench.percentile([1, 2, 3, 4], 50) == 3
    assert bench.percentile([1, 2, 3], 50) == 2
    assert bench.percentile(list(range(100)), 99) == 99
    assert bench.percentile(list(range(1000)), 99) == 990
    assert bench.percentile([5], 100) == 5
    assert bench.percentile([], 50) != bench.percentile([], 50)  # nan
