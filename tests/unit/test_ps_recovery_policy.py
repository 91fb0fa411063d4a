"""PS recovery's pure parts: the recovery timeline, the standby PS decisions, the checkpoint
interval, and the node registry's standby ids."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from dlrover_tf.ps_standby import (
    IDLE_NICE,
    at_idle_priority,
    promoted_env,
    promotion,
    wait_port_free,
)
from master.client import CHIEF_SESSION_KEY, ps_serving_key
from master.config import parse_job_spec
from master.job.checkpoint_interval import (
    MIN_INTERVAL_STEPS,
    interval_steps,
    worth_changing,
)
from master.job.exit_plan import ended_at
from master.job.ps_standby import (
    MAX_DELAY_SECONDS,
    Standby,
    may_replace,
    promotion_message,
    retire_message,
    standby_due,
    standby_wanted,
)
from master.job.recovery_timeline import (
    JOB_START,
    PS_FAILURE,
    RecoveryPhase,
    RecoveryTimeline,
    RecoveryTracker,
    format_timeline,
    serving_report,
)
from master.nodes.manager import STANDBY_RANK, NodeManager, StaleNodeError
from master.nodes.model import Node
from master.platform.api import NodeEvent
from master.state.sqlite import SQLiteStateStore

SPEC = parse_job_spec(
    {"name": "j", "command": "python t.py", "ps": {"replicas": 1}, "worker": {"replicas": 2}},
    "job.yaml",
    "/tmp",
)


# -- the timeline ---------------------------------------------------------------------------


def test_timeline_keeps_the_first_stamp_of_each_phase_in_phase_order():
    t = RecoveryTimeline(PS_FAILURE, "ps-0", started=100.0)
    assert t.mark("ps_serving", 100.5)
    assert t.mark("detected", 100.01)
    assert not t.mark("detected", 101.0)  # the first stamp wins
    assert not t.mark("no_such_phase", 101.0)
    assert list(t.offsets()) == ["detected", "ps_serving"]
    assert t.offsets()["detected"] == pytest.approx(0.01)
    assert t.total() == pytest.approx(0.5)
    assert not t.resumed


def test_timeline_summary_reads_as_one_line():
    t = RecoveryTimeline(PS_FAILURE, "ps-0", started=10.0, standby=True)
    t.mark("detected", 10.02)
    t.mark("first_step", 11.2)
    line = format_timeline(t.summary())
    assert line.startswith("ps failure ps-0 (standby promoted): resumed in 1.20 s")
    assert "failure detected +0.02 s" in line and "first step +1.20 s" in line


def test_serving_report_is_parsed_or_ignored():
    assert serving_report(json.dumps({"node_id": 7, "at": 12.5}).encode()) == (7, 12.5)
    assert serving_report(b"not json") is None
    assert serving_report(b"{}") is None


class _Job:
    """A recovery tracker and the events it emits."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []
        self.tracker = RecoveryTracker(self._emit)

    def _emit(self, kind, message, node=None, reason="", **details):
        self.events.append((kind, message, details))


def test_a_recovery_ends_at_the_first_step_after_the_restore_and_is_emitted_once():
    job = _Job()
    t0 = time.time()
    job.tracker.open(PS_FAILURE, "ps-0", started=t0)
    job.tracker.mark("detected", t0 + 0.01)
    job.tracker.mark("ps_started", t0 + 0.02, standby=True)
    serving = json.dumps({"node_id": 5, "at": t0 + 0.3}).encode()
    job.tracker.on_kv(ps_serving_key(0), serving)
    job.tracker.on_step(900)  # a late report from before the restore: no restore yet
    job.tracker.on_restore(500)
    job.tracker.on_kv(CHIEF_SESSION_KEY, b"2")
    job.tracker.on_kv(CHIEF_SESSION_KEY, b"2")  # a worker reading the counter
    job.tracker.on_step(500)  # not past the restored step
    job.tracker.on_step(501)
    job.tracker.on_step(502)
    assert [e[0] for e in job.events] == ["recovery"]
    details = job.events[0][2]
    assert details["recovery"] == PS_FAILURE and details["standby"] is True
    assert details["restored_step"] == 500
    assert list(details["phases"]) == [
        "detected",
        "ps_started",
        "ps_serving",
        "chief_restored",
        "workers_told",
        "first_step",
    ]
    assert details["phases"]["ps_serving"] == pytest.approx(0.3)


def test_a_job_start_without_a_restore_report_ends_its_recovery_at_the_first_step():
    # Trainers on the built-in PS without a TF chief (a custom loop) never report a restore:
    # their first step still means training runs, so the first standby need not wait.
    job = _Job()
    job.tracker.open(JOB_START, "")
    assert job.tracker.recovering()
    job.tracker.on_step(0)
    assert job.tracker.recovering()
    job.tracker.on_step(1)
    assert not job.tracker.recovering()
    assert job.events == []  # no restore: nothing to time
    # A PS failure is a recovery until the step past its restore, whatever was stepped before.
    job.tracker.open(PS_FAILURE, "ps-0")
    job.tracker.on_step(40)
    assert job.tracker.recovering()
    job.tracker.mark(RecoveryPhase.PS_STARTED)
    job.tracker.on_restore(30)
    job.tracker.on_step(31)
    assert not job.tracker.recovering()


def test_a_step_before_the_replacement_ps_started_resumes_nothing():
    """A loaded master: a trainer's step report (one that needs no PS, or in flight) lands
    while the new PS's launch is still under way: the timeline waits for the PS, so it never
    says training resumed before a PS existed."""
    job = _Job()
    t0 = time.time()
    job.tracker.open(PS_FAILURE, "ps-0", started=t0)
    job.tracker.mark(RecoveryPhase.DETECTED, t0, restored_step=0)  # rolled back, no restore
    job.tracker.on_step(1)
    assert job.events == [] and job.tracker.recovering()
    job.tracker.mark(RecoveryPhase.PS_STARTED)
    job.tracker.on_step(2)
    (event,) = job.events
    assert list(event[2]["phases"]) == ["detected", "ps_started", "first_step"]


def test_a_stale_timeline_is_dropped():
    job = _Job()
    job.tracker.open(PS_FAILURE, "ps-0", started=time.time() - 3600)
    job.tracker.on_restore(3)
    job.tracker.on_step(4)
    assert job.events == []


def test_no_timeline_open_means_nothing_is_stamped():
    job = _Job()
    job.tracker.mark("detected")
    job.tracker.on_restore(3)
    job.tracker.on_step(4)
    assert job.events == []


def test_the_platforms_end_time_starts_a_failure_timeline():
    event = NodeEvent("ps", 0, 1, -9, details={"ended_at": "100.25"})
    assert ended_at(event, 101.0) == 100.25
    assert ended_at(NodeEvent("ps", 0, 1, -9), 101.0) == 101.0
    assert ended_at(NodeEvent("ps", 0, 1, -9, details={"ended_at": "x"}), 101.0) == 101.0


# -- the standby PS ---------------------------------------------------------------------------


def test_a_standby_is_wanted_for_built_in_ps_jobs_on_platforms_that_run_one():
    assert standby_wanted(SPEC, 1, True, False)
    assert not standby_wanted(SPEC, 1, False, False)  # e.g. Kubernetes, for now
    assert not standby_wanted(SPEC, 1, True, True)  # training is over
    assert not standby_wanted(SPEC, 0, True, False)  # no PS
    assert not standby_wanted(SPEC.with_overrides(ps_standby=False), 1, True, False)
    own_ps = SPEC.with_overrides(ps=SPEC.ps.__class__(replicas=1, command=("my-ps",)))
    assert not standby_wanted(own_ps, 1, True, False)


def test_a_standby_starts_once_training_runs_and_no_recovery_is_in_progress():
    assert not standby_due(100.0, earliest=101.0, training=True, recovering=False)
    assert standby_due(101.0, earliest=101.0, training=True, recovering=False)
    assert not standby_due(101.0, earliest=101.0, training=False, recovering=False)
    assert not standby_due(101.0, earliest=101.0, training=True, recovering=True)
    # A job that never reports steps (or never ends a recovery) gets one all the same.
    assert standby_due(101.0 + MAX_DELAY_SECONDS, 101.0, training=False, recovering=True)


def test_a_standby_replaces_only_an_older_incarnation_with_resources_it_has():
    standby = Standby(id=9, log_path="", memory_mb=1024, cpu=1.0)
    old = Node(type="ps", rank=0, id=1)
    # Still loading TensorFlow: a new PS process recovers sooner than waiting for it.
    assert not may_replace(standby, old, 1024, 1.0, platform_enforces_resources=True)
    standby.ready_at = 1.0
    assert may_replace(standby, old, 1024, 1.0, platform_enforces_resources=True)
    assert may_replace(standby, None, 1024, 1.0, platform_enforces_resources=True)
    assert not may_replace(None, old, 1024, 1.0, platform_enforces_resources=False)
    # A restarted master takes the highest id of a rank as current.
    assert not may_replace(standby, Node(type="ps", rank=0, id=12), 1024, 1.0, False)
    # A PS moved to more memory: only where resources are not enforced (local processes).
    assert not may_replace(standby, old, 2048, 1.0, platform_enforces_resources=True)
    assert may_replace(standby, old, 2048, 1.0, platform_enforces_resources=False)


def test_promotion_messages_round_trip_to_the_standby():
    config = json.dumps({"cluster": {"ps": ["h:1"]}, "task": {"type": "ps", "index": 0}})
    assert promotion(promotion_message(config, 7)) == (config, 7)
    assert promotion(retire_message()) is None
    env = promoted_env({"DLROVER_NODE_RANK": "-1", "X": "1"}, config, 0)
    assert env == {"DLROVER_NODE_RANK": "0", "X": "1", "TF_CONFIG": config}


def test_wait_port_free_waits_for_the_old_listener():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not wait_port_free(f"127.0.0.1:{port}", timeout=0.05)
    assert wait_port_free(f"127.0.0.1:{port}", timeout=1.0)


def test_standby_ids_talk_as_the_standby_rank_until_promoted(tmp_path):
    nodes = NodeManager(SQLiteStateStore(str(tmp_path / "s.db")))
    ps = nodes.new_incarnation("ps", 0, 0, 0)
    sid = nodes.reserve_standby_id()
    assert sid == ps.id + 1
    assert nodes.check("ps", STANDBY_RANK, sid).rank == STANDBY_RANK
    with pytest.raises(StaleNodeError):
        nodes.check("ps", 0, sid)  # not a node yet
    assert nodes.new_incarnation("worker", 0, 0, 0).id == sid + 1
    promoted = nodes.promote_standby(sid, "ps", 0, 1, 512)
    assert nodes.current("ps", 0) is promoted and promoted.id == sid
    assert nodes.check("ps", 0, sid) is promoted
    with pytest.raises(ValueError):
        nodes.promote_standby(sid, "ps", 0, 1, 512)  # only once
    nodes.skip_ids_below(100)
    assert nodes.new_incarnation("worker", 1, 0, 0).id == 100


# -- the checkpoint interval ----------------------------------------------------------------


def test_interval_keeps_checkpointing_within_its_share_of_the_time():
    # 0.5 s per save, 5%: 9.5 s of training between saves, at 40 steps/s.
    choice = interval_steps(0.5, 40.0, 0.05)
    assert choice.steps == 380
    assert choice.expected_redo_steps == 190
    assert interval_steps(0.001, 40.0, 0.5).steps == MIN_INTERVAL_STEPS


@pytest.mark.parametrize(
    ("cost", "rate", "overhead"), [(0.0, 10.0, 0.05), (0.5, 0.0, 0.05), (0.5, 10.0, 0.0)]
)
def test_interval_is_unknown_until_measured_or_when_off(cost, rate, overhead):
    assert interval_steps(cost, rate, overhead) is None


def test_small_moves_of_the_interval_are_not_worth_telling():
    assert worth_changing(None, 100)
    assert not worth_changing(100, 115)
    assert worth_changing(100, 130)


def test_the_standby_warms_up_at_idle_priority_and_leaves_the_rest_of_the_process_alone():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []
    at_idle_priority(
        lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    )
    assert seen == [IDLE_NICE]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_failed_warm_up_fails_the_standby():
    def broken() -> None:
        raise ImportError("no tensorflow")

    with pytest.raises(ImportError, match="no tensorflow"):
        at_idle_priority(broken)
