"""Health verdicts: a lost heartbeat or a hang kills the node once; stragglers are reported."""

from __future__ import annotations

from collections import deque

import pytest

from master.job.health import (
    STRAGGLER_MIN_REPORTS,
    hang_verdicts,
    heartbeat_verdicts,
    straggler_verdicts,
)
from master.nodes.manager import NodeManager
from master.nodes.model import ExitReason, Finding, Node, NodeState
from master.state.sqlite import SQLiteStateStore

R = NodeState.RUNNING
HEARTBEAT_LOST, HUNG = Finding.HEARTBEAT_LOST, Finding.HUNG
STRAGGLER, STRAGGLER_REPLACED = Finding.STRAGGLER, Finding.STRAGGLER_REPLACED


def test_a_registered_node_silent_past_the_timeout_is_killed():
    quiet = Node("worker", 0, id=1, state=R, registered=True, last_heartbeat=80.0)
    fresh = Node("worker", 1, id=2, state=R, registered=True, last_heartbeat=95.0)
    unregistered = Node("ps", 0, id=3, state=R, last_heartbeat=0.0)  # judged by its exit only
    [v] = heartbeat_verdicts([quiet, fresh, unregistered], now=100.0, timeout=15.0)
    assert v.node is quiet and v.kind == "heartbeat_lost" and v.kill
    assert v.marks == (HEARTBEAT_LOST,)
    assert v.message == "worker-0 (id 1) sent no heartbeat for 15s; killing it"
    assert v.details == {"timeout_seconds": 15.0}


def test_a_lost_heartbeat_is_acted_on_once():
    quiet = Node("worker", 0, id=1, state=R, registered=True, last_heartbeat=80.0)
    quiet.findings.add(HEARTBEAT_LOST)
    assert heartbeat_verdicts([quiet], now=100.0, timeout=15.0) == []


def test_a_trainer_holding_shards_without_a_step_is_restarted():
    stuck = Node("worker", 0, id=1, state=R, last_progress=10.0, steps=42)
    waiting = Node("worker", 1, id=2, state=R, last_progress=10.0)  # holds no shard: may wait
    busy = Node("chief", 0, id=3, state=R, last_progress=390.0)
    [v] = hang_verdicts([stuck, waiting, busy], now=400.0, timeout=300.0, holding_shards={1, 3})
    assert v.node is stuck and v.kill and v.marks == (HUNG,)
    assert v.details == {"timeout_seconds": 300.0, "steps": 42}
    assert "holds shards but made no step for 300s; restarting it" in v.message


def test_hang_detection_off_or_already_found():
    stuck = Node("worker", 0, id=1, state=R, last_progress=10.0)
    assert hang_verdicts([stuck], now=400.0, timeout=0.0, holding_shards={1}) == []
    stuck.findings.add(HUNG)
    assert hang_verdicts([stuck], now=400.0, timeout=300.0, holding_shards={1}) == []


def _trainers(*step_seconds, steps=50, reports=STRAGGLER_MIN_REPORTS):
    return [
        Node(
            "worker",
            i,
            id=10 + i,
            state=R,
            steps=steps,
            step_seconds=s,
            step_samples=deque([s] * reports),
        )
        for i, s in enumerate(step_seconds)
    ]


def test_a_step_time_measured_over_too_few_reports_is_not_judged():
    nodes = _trainers(0.1, 0.1, 0.5, reports=STRAGGLER_MIN_REPORTS - 1)
    assert straggler_verdicts(nodes, "report", min_steps=20) == []


def test_a_pause_inside_one_coalesced_report_does_not_make_a_straggler():
    manager = NodeManager(SQLiteStateStore(":memory:"))
    steady, paused = (manager.new_incarnation("worker", r, 0, 0) for r in (0, 1))
    for node in (steady, paused):
        manager.note_progress(node)  # the first step: no gap yet
    for report in range(16):
        for node in (steady, paused):
            # 20 steps of 50 ms a report; `paused`'s last two took 3 s (a stalled machine): 40
            # of its last 64 steps, but 2 of its 16 reports
            node.last_step_at -= 3.0 if (node is paused and report >= 14) else 1.0
            manager.note_progress(node, steps=20)
    assert abs(paused.step_seconds - 0.05) < 0.005 and abs(steady.step_seconds - 0.05) < 0.005
    assert straggler_verdicts([steady, paused], "report", min_steps=20) == []


def test_a_report_spanning_a_pause_of_the_whole_job_is_not_a_step_time():
    # A chief with a few reports when a PS fails: its first report after the recovery covers
    # the recovery's seconds, which would otherwise be most of its step time.
    manager = NodeManager(SQLiteStateStore(":memory:"))
    chief = manager.new_incarnation("chief", 0, 0, 0)
    manager.note_progress(chief)
    for _ in range(2):
        chief.last_step_at -= 1.0
        manager.note_progress(chief, steps=20)  # 50 ms a step
    chief.last_step_at -= 4.0  # its steps before the PS failure, and the recovery
    manager.restart_step_clocks(chief.last_step_at + 1.0)
    manager.note_progress(chief, steps=20)
    # The spanning report left out:
    assert list(chief.step_samples) == pytest.approx([0.05, 0.05], abs=1e-3)
    chief.last_step_at -= 1.0
    manager.note_progress(chief, steps=20)
    assert chief.step_seconds == pytest.approx(0.05, abs=1e-3) and chief.steps == 81


def test_the_chief_is_no_workers_peer_and_never_a_straggler():
    # A chief saving checkpoints often takes longer steps than the workers: not a straggler.
    chief, *workers = _trainers(0.5, 0.1, 0.1, 0.12)
    chief.type = "chief"
    assert straggler_verdicts([chief, *workers], "replace", min_steps=20) == []
    # The workers are still judged among themselves.
    workers[2].step_seconds = 0.3
    [v] = straggler_verdicts([chief, *workers], "replace", min_steps=20)
    assert v.node is workers[2]


def test_a_worker_far_slower_than_its_peers_is_reported():
    nodes = _trainers(0.1, 0.1, 0.5)
    [v] = straggler_verdicts(nodes, "report", min_steps=20)
    assert v.node is nodes[2] and not v.kill and v.marks == (STRAGGLER,)
    assert v.details == {"step_seconds": 0.5, "slowdown": 5.0, "action": "report"}
    assert v.message == "worker-2 (id 12) is a straggler: 500 ms per step, 5.0x its peers' median"


def test_replace_kills_the_straggler_and_marks_why():
    nodes = _trainers(0.1, 0.1, 0.5)
    [v] = straggler_verdicts(nodes, "replace", min_steps=20)
    assert v.kill and v.marks == (STRAGGLER, STRAGGLER_REPLACED)
    assert v.message.endswith("; replacing it") and v.details["action"] == "replace"


def test_no_straggler_verdicts_when_off_too_early_or_already_found():
    assert straggler_verdicts(_trainers(0.1, 0.1, 0.5), "off", min_steps=20) == []
    assert straggler_verdicts(_trainers(0.1, 0.1, 0.5, steps=5), "report", min_steps=20) == []
    assert straggler_verdicts(_trainers(0.1, 0.12, 0.11), "report", min_steps=20) == []
    found = _trainers(0.1, 0.1, 0.5)
    found[2].findings.add(STRAGGLER)
    assert straggler_verdicts(found, "report", min_steps=20) == []


def test_a_silent_nodes_warning_names_what_its_process_does():
    from master.job.health import silence_cause

    assert silence_cause(None) == ""
    assert silence_cause(97.0) == (
        "its process still runs at 97% CPU: busy, not dead (its reports are starved)"
    )
    assert silence_cause(0.4).startswith("its process still exists but is idle (0.4% CPU)")
    quiet = Node("worker", 0, id=1, state=R, registered=True, last_heartbeat=80.0)
    [v] = heartbeat_verdicts([quiet], now=100.0, timeout=15.0, measured_cpu={1: 97.0})
    assert v.message == (
        "worker-0 (id 1) sent no heartbeat for 15s (its process still runs at 97% CPU: busy, "
        "not dead (its reports are starved)); killing it"
    )
    assert v.details["cause"].startswith("its process still runs at 97% CPU")


def test_a_lapsed_rendezvous_lease_is_logged_with_what_the_node_does(caplog):
    from master.rendezvous.rounds import Participant, RoundConfig, RoundStateMachine

    run = RoundStateMachine(RoundConfig(min_nodes=1, max_nodes=1, lease_seconds=10.0))
    run.join(Participant("worker", 0, 1, local_world_size=1), now=0.0)
    run.advance(0.0)  # the round closes with worker-0
    with caplog.at_level("WARNING"):
        run.advance(11.0, lambda key: f"{key[0]}-{key[1]} is busy")
    assert "worker-0 lost (silent > 10.0s; worker-0 is busy): round 1 is broken" in caplog.text


def test_a_restarted_master_counts_a_nodes_silence_from_the_end_of_its_adoption():
    import time

    store = SQLiteStateStore(":memory:")
    before = NodeManager(store)
    node = before.new_incarnation("worker", 1, 0, 0)
    before.mark_running(node.id, "127.0.0.1:2222", "")
    before.mark_exited(before.new_incarnation("worker", 0, 0, 0).id, 0, ExitReason.SUCCEEDED)
    after = NodeManager(store)
    [running, ended] = sorted(after.restore(), key=lambda n: -n.rank)
    # It registered with the new master, whose adoption took longer than the timeout (a loaded
    # Ray cluster): seen as silent.
    running.registered = True
    running.last_heartbeat = running.last_progress = ended.last_heartbeat = 1.0
    assert heartbeat_verdicts([running], now=time.monotonic(), timeout=3.0)
    after.restart_liveness_clocks()
    assert heartbeat_verdicts([running], now=time.monotonic(), timeout=3.0) == []
    assert running.last_progress >= running.last_heartbeat > 1.0
    assert ended.last_heartbeat == 1.0  # an ended incarnation is left as it was


def test_hang_clocks_count_from_the_end_of_a_pause_of_the_whole_job():
    prefetched = Node("worker", 0, id=1, state=R, last_progress=5.0)  # took a shard, no step
    assert not hang_verdicts([prefetched], now=21.3, timeout=15.0, holding_shards={1}, since=21.1)
    [v] = hang_verdicts([prefetched], now=36.2, timeout=15.0, holding_shards={1}, since=21.1)
    assert v.node is prefetched


def _health_monitor(nodes, recovering):
    from types import SimpleNamespace

    from master.job.health import HealthMonitor

    events = []
    monitor = HealthMonitor(
        SimpleNamespace(heartbeat_timeout_seconds=1e9, hang_timeout_seconds=15.0, stragglers="off"),
        SimpleNamespace(all_current=lambda: list(nodes), restart_step_clocks=lambda now: None),
        SimpleNamespace(holders=lambda: {n.id for n in nodes}),
        measured_cpu={},
        recovering=recovering,
        kill=lambda node: events.append(("killed", node.name)),
        emit=lambda kind, message, *a, **k: events.append((kind, message)),
    )
    return monitor, events


def test_trainers_waiting_for_the_jobs_start_or_a_ps_recovery_are_not_hung(monkeypatch):
    from master.job import health

    clock = [20.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: clock[0])
    # The job's start: worker-0 prefetched a shard at 5 s; the chief restores until 21 s.
    w0 = Node("worker", 0, id=1, state=R, last_progress=5.0)
    chief = Node("chief", 0, id=2, state=R, last_progress=5.0)
    recovering = [True]
    m, events = _health_monitor([w0, chief], lambda: recovering[0])
    m.check()
    assert events == []
    recovering[0], chief.steps, clock[0] = False, 1, 21.3  # the first step: training runs
    chief.last_progress = 21.2
    m.check()
    assert events == []  # worker-0 gets a full timeout from the start's end
    clock[0] = 35.5
    m.check()
    assert events[0][0] == "hang" and "worker-0" in events[0][1]
    assert events[1:] == [("killed", "worker-0")]
    assert Finding.HUNG in w0.findings


def test_a_job_no_trainer_of_which_stepped_yet_is_not_judged_hung(monkeypatch):
    from master.job import health

    clock = [100.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: clock[0])
    # No recovery timeline (no TF chief): nobody has stepped, so the job has not started.
    w0 = Node("worker", 0, id=1, state=R, last_progress=5.0)
    chief = Node("chief", 0, id=2, state=R, last_progress=5.0)
    m, events = _health_monitor([w0, chief], lambda: False)
    m.check()
    assert events == []
    # The chief steps: worker-0's hang clock runs from the last look before (100 s), not 5 s.
    chief.steps, chief.last_progress, clock[0] = 1, 114.0, 114.0
    m.check()
    assert events == []
    clock[0] = 115.5
    chief.last_progress = 115.5
    m.check()
    assert [kind for kind, _ in events] == ["hang", "killed"]
