"""Which faults given at submit fire now: each once, when its trigger is reached."""

from __future__ import annotations

from master.job.faults import faults_due, parse_fault

FAULTS = [
    parse_fault("worker:1@50%"),
    parse_fault("ps:0@30s"),
    parse_fault("chief:0@step=1000"),
    parse_fault("master:0@80%"),
]


def test_nothing_fires_before_its_trigger():
    assert faults_due(FAULTS, [], percent_done=10.0, seconds=5.0, global_step=10) == []


def test_every_reached_trigger_fires_in_order():
    assert faults_due(FAULTS, [], percent_done=85.0, seconds=31.0, global_step=1000) == [0, 1, 2, 3]
    assert faults_due(FAULTS, [], percent_done=50.0, seconds=0.0, global_step=0) == [0]


def test_a_fault_that_fired_never_fires_again():
    assert faults_due(FAULTS, [0, 1], percent_done=85.0, seconds=31.0, global_step=0) == [3]
    assert faults_due(FAULTS, [0, 1, 2, 3], 100.0, 1e6, 10**9) == []


def test_a_fault_that_never_fired_is_said_with_why_for_a_program_without_reports():
    from master.job.faults import parse_fault, unfired_message

    pct = parse_fault("worker:1@50%")
    assert unfired_message(pct, reports_progress=True) == (
        "fault injection: SIGKILL to worker-1 at 50% of the records done never fired before "
        "the job's end"
    )
    assert unfired_message(pct, reports_progress=False).endswith(
        ": the program reports no records or steps to the master, so use a time, "
        "e.g. --kill worker:1@30s"
    )
    secs = parse_fault("ps:0@300s")
    assert unfired_message(secs, reports_progress=False).endswith("before the job's end")
