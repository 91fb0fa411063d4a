"""The auto-scaler's pure decisions: growth while it pays, one step back, no flapping, PS moves."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from master.config import AutoscaleSpec, SpecError, parse_job_spec
from master.job.autoscale_policy import (
    MIGRATE_PS,
    NONE,
    SCALE_WORKERS,
    Observation,
    PSLoad,
    ScalerState,
    decide,
    initial_state,
)

CFG = AutoscaleSpec(enabled=True, min_workers=1, max_workers=8, window=3, settle_seconds=5.0)
INTERVAL = 1.0


def saturating(capacity_workers: int, per_worker: float = 100.0):
    """records/s that grow linearly up to `capacity_workers` workers and stay flat after."""
    return lambda n: per_worker * min(n, capacity_workers)


def run(
    cfg: AutoscaleSpec,
    rate_of,
    start: int = 1,
    seconds: float = 200.0,
    noise=None,
    state: ScalerState | None = None,
    **obs_fields,
):
    """Drive `decide` against a throughput model; the worker counts over time and decisions."""
    state = state or initial_state()
    workers, t, i = start, 0.0, 0
    counts = [workers]
    decisions = []
    while t < seconds:
        rate = rate_of(workers)
        if noise is not None:
            rate *= noise[i % len(noise)]
        obs = Observation(
            time=t,
            workers=workers,
            worker_slots=16,
            ready=workers + obs_fields.get("chief", 0),
            records_per_second=rate,
            **obs_fields,
        )
        state, d = decide(cfg, state, obs)
        if d.action == SCALE_WORKERS:
            workers = d.workers
            counts.append(workers)
            decisions.append((t, d))
        t += INTERVAL
        i += 1
    return counts, decisions, state


def test_grows_while_each_worker_pays_then_steps_back_once():
    counts, decisions, state = run(CFG, saturating(3))
    assert counts == [1, 2, 3, 4, 3]
    assert state.ceiling == 3
    back = decisions[-1][1]
    assert back.reason.startswith("back to 3 workers: worker 4 added 0.0 records/s")
    assert "70%" in back.reason
    assert dict(state.table) == {1: 100.0, 2: 200.0, 3: 300.0, 4: 300.0}


def test_a_worker_count_that_stopped_paying_is_backed_off():
    # The 4th worker brings 50 records/s where each brought 100 before: under 70%.
    counts, _, _ = run(CFG, lambda n: 100.0 * n if n <= 3 else 300.0 + 50.0 * (n - 3))
    assert counts == [1, 2, 3, 4, 3]
    # 80% of the per-worker rate still pays: the scaler keeps going to the max.
    counts, _, _ = run(CFG, lambda n: 100.0 + 80.0 * (n - 1))
    assert counts == list(range(1, 9))


def test_never_above_max_workers_and_holds_there():
    cfg = dataclasses.replace(CFG, max_workers=4)
    counts, decisions, state = run(cfg, lambda n: 100.0 * n)
    assert counts == [1, 2, 3, 4]
    _, d = decide(
        cfg,
        state,
        Observation(time=1000.0, workers=4, worker_slots=16, ready=4, records_per_second=400.0),
    )
    assert d.action == NONE and "autoscale.max_workers is 4" in d.reason


def test_outside_the_limits_goes_straight_back_in():
    state, d = decide(CFG, initial_state(), Observation(time=0.0, workers=0, worker_slots=16))
    assert (d.action, d.workers) == (SCALE_WORKERS, 1) and "min_workers" in d.reason
    cfg = dataclasses.replace(CFG, max_workers=3)
    _, d = decide(cfg, initial_state(), Observation(time=0.0, workers=6, worker_slots=16))
    assert (d.action, d.workers) == (SCALE_WORKERS, 3) and "max_workers" in d.reason
    # The cluster spec's slots bound it too, whatever max_workers says.
    _, d = decide(CFG, initial_state(), Observation(time=0.0, workers=5, worker_slots=4))
    assert d.workers == 4


def test_no_decision_while_settling_busy_or_trainers_not_stepping():
    state = initial_state()
    for t in range(0, 30):
        state, d = decide(
            CFG,
            state,
            Observation(time=t, workers=1, worker_slots=8, ready=0, records_per_second=100.0),
        )
        assert d.action == NONE
    assert "waiting for every trainer to step (0/1)" in d.reason
    for t in range(30, 60):
        state, d = decide(
            CFG,
            state,
            Observation(
                time=t,
                workers=1,
                worker_slots=8,
                ready=1,
                records_per_second=100.0,
                busy="a PS migration is in flight",
            ),
        )
        assert d.action == NONE and d.reason == "waiting: a PS migration is in flight"
    # Free again: settle 5 s from the last busy sample (59), then 3 samples (64, 65, 66).
    times = []
    for t in range(60, 80):
        state, d = decide(
            CFG,
            state,
            Observation(time=t, workers=1, worker_slots=8, ready=1, records_per_second=100.0),
        )
        if d.action != NONE:
            times.append(t)
            break
    assert times == [66]


def test_out_of_data_holds():
    state = initial_state()
    for t in range(20):
        state, d = decide(
            CFG,
            state,
            Observation(
                time=t, workers=1, worker_slots=8, ready=1, records_per_second=9.0, records_todo=0
            ),
        )
        assert d.action == NONE
    assert "no records left" in d.reason


def test_the_chief_counts_as_a_trainer():
    # Chief + 1 worker make 200; the 2nd worker adds 80 (80% of 100 per trainer): it pays.
    counts, _, _ = run(
        dataclasses.replace(CFG, max_workers=3),
        lambda n: 100.0 + 100.0 * min(n, 1) + 80.0 * (n - 1),
        chief=1,
    )
    assert counts[:3] == [1, 2, 3]


def test_brain_hint_is_the_first_step():
    state = initial_state(4, "the brain's history: 4 workers trained fastest in 3 past runs")
    state, d = decide(CFG, state, Observation(time=0.0, workers=1, worker_slots=8))
    assert (d.action, d.workers) == (SCALE_WORKERS, 4)
    assert "brain's history" in d.reason
    counts, _, _ = run(CFG, saturating(3), start=4, state=state)
    assert counts == [4, 5, 4]  # the 5th did not pay; back to 4, nothing below is probed


def _hot_ps(cpu_percent=190.0, rss=500.0):
    return (
        PSLoad(
            rank=0,
            cpu_percent=cpu_percent,
            cpu_cores=2.0,
            memory_rss_mb=rss,
            memory_limit_mb=1000.0,
        ),
    )


def test_cpu_bound_ps_is_migrated_with_more_cpu_up_to_its_budget():
    cfg = dataclasses.replace(CFG, ps_max_cpu=4.0, max_workers=1)
    state, cores, moves = initial_state(), 2.0, []
    for t in range(60):
        # A PS that keeps 95% of whatever cores it has busy.
        ps = (
            PSLoad(
                0,
                cpu_percent=95.0 * cores,
                cpu_cores=cores,
                memory_rss_mb=100.0,
                memory_limit_mb=1000.0,
            ),
        )
        state, d = decide(
            cfg,
            state,
            Observation(time=t, workers=1, worker_slots=8, ready=1, records_per_second=50.0, ps=ps),
        )
        if d.action != NONE:
            assert (d.action, d.ps_rank, d.memory_mb) == (MIGRATE_PS, 0, 0)
            moves.append((t, d.cpu, d.reason))
            cores = d.cpu
    # 2 -> 3 cores (x1.5), then 3 -> 4 (ps_max_cpu), then no more; each after a settle + window.
    assert [(t, cpu) for t, cpu, _ in moves] == [(7, 3.0), (14, 4.0)]
    assert moves[0][2] == (
        "ps-0 is CPU-bound (its 2 cores at least 95% busy over 3 samples): moving it to 3 CPU"
    )


def test_ps_migration_respects_ps_max_and_total_budget():
    def first(cfg, ps):
        state = initial_state()
        for t in range(20):
            state, d = decide(
                cfg,
                state,
                Observation(
                    time=t,
                    workers=1,
                    worker_slots=8,
                    ready=1,
                    records_per_second=50.0,
                    ps=ps,
                    cpu_requested=4.0,
                ),
            )
            if d.action != NONE:
                return d
        return d

    pinned = dataclasses.replace(CFG, max_workers=1)
    assert first(pinned, _hot_ps()).action == NONE  # ps_max_cpu 0: never migrate for CPU
    budget = dataclasses.replace(CFG, max_workers=1, ps_max_cpu=4.0, max_total_cpu=4.5)
    assert first(budget, _hot_ps()).action == NONE  # +1 core would pass the 4.5 total
    memory = dataclasses.replace(CFG, max_workers=1, ps_max_memory_mb=1200)
    d = first(memory, _hot_ps(cpu_percent=10.0, rss=900.0))
    assert (d.action, d.memory_mb, d.cpu) == (MIGRATE_PS, 1200, 0.0)
    assert "memory-bound (900 of 1,000 MB" in d.reason
    # One cool sample in the window: not hot.
    state = initial_state()
    for t, cpu in enumerate([190.0] * 8 + [50.0] + [190.0] * 2):
        state, d = decide(
            dataclasses.replace(CFG, max_workers=1, ps_max_cpu=4.0),
            state,
            Observation(
                time=t,
                workers=1,
                worker_slots=8,
                ready=1,
                records_per_second=50.0,
                ps=_hot_ps(cpu_percent=cpu),
            ),
        )
        if 8 <= t:
            assert d.action == NONE, (t, d)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 10),
    max_workers=st.integers(1, 10),
    start=st.integers(1, 10),
    noise=st.lists(st.floats(0.6, 1.4), min_size=1, max_size=40),
    gain=st.floats(0.1, 1.0),
)
def test_never_flaps_and_never_leaves_the_limits(capacity, max_workers, start, noise, gain):
    cfg = dataclasses.replace(CFG, max_workers=max_workers, marginal_gain=gain)
    start = min(start, max_workers)
    counts, decisions, _ = run(cfg, saturating(capacity), start=start, seconds=150, noise=noise)
    assert all(1 <= c <= max_workers for c in counts)
    steps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
    assert all(abs(s) == 1 for s in steps)
    # Up (any number of times), then down at most once, then nothing: no flapping.
    downs = [i for i, s in enumerate(steps) if s < 0]
    assert len(downs) <= 1 and (not downs or downs[0] == len(steps) - 1)
    # Every change waited for the settling time and a whole window of samples.
    times = [t for t, _ in decisions]
    assert all(
        b - a >= cfg.settle_seconds + cfg.window - 1 for a, b in zip(times, times[1:], strict=False)
    )


@settings(max_examples=100, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=200))
def test_any_throughput_sequence_is_safe(rates):
    cfg = dataclasses.replace(CFG, max_workers=5)
    state, workers, counts = initial_state(), 2, [2]
    for t, rate in enumerate(rates):
        state, d = decide(
            cfg,
            state,
            Observation(
                time=t, workers=workers, worker_slots=5, ready=workers, records_per_second=rate
            ),
        )
        if d.action == SCALE_WORKERS:
            workers = d.workers
            counts.append(workers)
        assert d.reason
    assert all(1 <= c <= 5 for c in counts)
    steps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
    downs = [i for i, s in enumerate(steps) if s < 0]
    assert len(downs) <= 1 and (not downs or downs[0] == len(steps) - 1)


def test_decide_is_pure():
    obs = Observation(time=10.0, workers=2, worker_slots=8, ready=2, records_per_second=10.0)
    state = ScalerState(workers=2, since=0.0, samples=(10.0, 10.0), table={1: 6.0}, came_from=1)
    a = decide(CFG, state, obs)
    b = decide(CFG, state, obs)
    assert a == b
    assert state.samples == (10.0, 10.0) and dict(state.table) == {1: 6.0}


def _spec(**auto):
    return parse_job_spec(
        {
            "name": "j",
            "command": "x",
            "worker": {"replicas": 1, "max_replicas": 4},
            "autoscale": auto,
        },
        "job.yaml",
        "/tmp",
    )


def test_yaml_section_defaults_off_and_is_validated():
    assert _spec().autoscale == AutoscaleSpec() and not AutoscaleSpec().enabled
    spec = _spec(enabled=True, max_workers=3, interval_seconds=2)
    assert spec.autoscale.enabled and spec.autoscale.max_workers == 3
    assert spec.autoscale.interval_seconds == 2.0


@pytest.mark.parametrize(
    "auto, field, fix",
    [
        ({"enabled": "yes"}, "autoscale.enabled", "Use true"),
        ({"max_workers": 9}, "autoscale.max_workers", "raise worker.max_replicas to 9"),
        ({"min_workers": 5}, "autoscale.min_workers", "Use a number <= 4"),
        ({"marginal_gain": 1.5}, "autoscale.marginal_gain", "Use e.g. 0.7"),
        ({"ps_cpu_percent": 0}, "autoscale.ps_cpu_percent", "Use e.g. 90"),
        ({"ps_growth": 1}, "autoscale.ps_growth", "above 1"),
        ({"interval_seconds": 0}, "autoscale.interval_seconds", "positive number of seconds"),
        ({"window": 0}, "autoscale.window", "Use a number >= 1"),
        ({"max_worker": 3}, "autoscale.max_worker", "Rename it to 'max_workers'"),
        ({"enabled": True, "min_workers": 0}, "autoscale.min_workers", "min_workers: 1"),
    ],
)
def test_yaml_errors_name_the_field_and_the_fix(auto, field, fix):
    with pytest.raises(SpecError) as info:
        _spec(**auto)
    assert str(info.value).startswith(f"job.yaml: {field}: "), info.value
    assert fix in str(info.value)


def test_brain_history_gives_the_starting_count(tmp_path):
    from master.brain.client import Brain
    from master.brain.history import JobRecord
    from master.job.autoscaler import brain_hint

    spec = parse_job_spec(
        {"name": "wd", "command": "x", "worker": {"replicas": 1, "max_replicas": 4}},
        "job.yaml",
        str(tmp_path),
    )
    brain = Brain(str(tmp_path / "brain.sqlite"))
    try:
        assert brain_hint(brain, spec) == (0, "")  # no history: no hint
        for t, (workers, rps) in enumerate([(1, 100.0), (3, 290.0), (3, 300.0)]):
            brain.record(
                JobRecord(
                    "wd",
                    f"r{t}",
                    float(t),
                    "succeeded",
                    10.0,
                    replicas={"worker": workers},
                    records_per_second=rps,
                )
            )
        hint, reason = brain_hint(brain, spec)
    finally:
        brain.close()
    assert hint == 3 and reason.startswith("the brain's history: 3 workers trained fastest")
    # A Brain that cannot be reached gives no hint (and no error).
    assert brain_hint(Brain("http://127.0.0.1:9"), spec) == (0, "")


def test_process_probe_reads_a_local_process_without_heartbeats():
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from master.job.autoscaler import ProcessProbe

    # A wrapper whose child does the work, as a node's process group often is.
    busy = subprocess.Popen(
        ["sh", "-c", f"'{sys.executable}' -c 'while True: pass'; :"], start_new_session=True
    )
    probe = ProcessProbe()
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(busy.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe.sample(7, busy.pid) is None  # the first look primes the CPU counters
        time.sleep(1.0)
        cpu, rss = probe.sample(7, busy.pid)
        # The child's CPU counts (the shell itself is idle); a loaded machine gives it less.
        assert cpu > 2.0 and rss > 1_000_000
    finally:
        os.killpg(busy.pid, signal.SIGKILL)
        busy.wait()
    assert probe.sample(7, busy.pid) is None  # gone
    assert probe.sample(8, 0) is None  # no pid: not a local process


def test_a_restarted_master_keeps_the_measurements_and_the_ceiling():
    import json

    from master.job.autoscaler import Autoscaler as AutoscaleExecutor

    _, _, state = run(CFG, saturating(3))
    before = AutoscaleExecutor(None, CFG)
    before.state = state
    record = json.loads(json.dumps(before.record()))  # as the state store keeps it
    after = AutoscaleExecutor(None, CFG)
    after.restore(record)
    assert after.state.ceiling == 3 and dict(after.state.table) == dict(state.table)
    # The new master measures 3 workers again, and never tries the 4th that did not pay.
    counts, _, _ = run(CFG, saturating(3), start=3, state=after.state)
    assert counts == [3]
    # A fresh scaler (what a restart did before) would try it again.
    counts, _, _ = run(CFG, saturating(3), start=3)
    assert 4 in counts
