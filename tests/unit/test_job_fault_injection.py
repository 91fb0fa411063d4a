"""Which faults given at submit fire now: each once, when its trigger is reached."""

from __future__ import annotations

import signal

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


def _trainer(kind: str, rank: int, node_id: int, steps: int = 0):
    from master.nodes.model import Node, NodeState

    # Registered: a node's last progress is its registration until it reports.
    return Node(kind, rank, node_id, state=NodeState.RUNNING, steps=steps, last_progress=5.0)


def test_a_kill_mid_training_waits_for_a_late_trainers_first_step():
    from master.job.faults import waits_for_first_step

    pct = parse_fault("worker:1@40%")
    chief, w0 = _trainer("chief", 0, 1, steps=70), _trainer("worker", 0, 2, steps=5)
    late = _trainer("worker", 1, 3)
    # Its peers train and report steps: a kill now would hit a worker that never trained.
    assert waits_for_first_step(pct, late, False, [chief, w0, late], coordinator=None)
    assert waits_for_first_step(parse_fault("worker:1@step=75"), late, False, [chief, late], None)
    # It holds a shard: it reports steps, so its first one is awaited even with no peer's yet.
    assert waits_for_first_step(pct, late, True, [late], coordinator=None)
    # Registered but holding nothing, with no peer's step: nothing says it will report.
    assert not waits_for_first_step(pct, late, False, [late], coordinator=None)
    # Once it has stepped, or for a time trigger, or a PS, nothing waits.
    stepped = _trainer("worker", 1, 3, steps=1)
    assert not waits_for_first_step(pct, stepped, True, [chief, w0, stepped], None)
    at_30s = parse_fault("worker:1@30s")
    assert not waits_for_first_step(at_30s, late, False, [chief, w0, late], None)
    ps = _trainer("ps", 0, 4)
    assert not waits_for_first_step(parse_fault("ps:0@40%"), ps, False, [chief, w0, ps], None)


def test_a_tf2_workers_kill_never_waits_for_steps_only_its_coordinator_reports():
    from master.job.faults import waits_for_first_step

    coordinator = _trainer("chief", 0, 1, steps=70)
    w1 = _trainer("worker", 1, 3)
    pct = parse_fault("worker:1@40%")
    assert not waits_for_first_step(pct, w1, False, [coordinator, w1], coordinator.id)
    # Without the coordinator's key the chief's steps say trainers report their own.
    assert waits_for_first_step(pct, w1, False, [coordinator, w1], coordinator=None)


class _Nodes:
    def __init__(self, nodes):
        self.nodes = nodes

    def current(self, kind, rank):
        return next((n for n in self.nodes if (n.type, n.rank) == (kind, rank)), None)

    def all_current(self):
        return list(self.nodes)


class _Platform:
    def __init__(self):
        self.signals = []

    def signal_node(self, node_id, sig):
        self.signals.append((node_id, sig))
        return True


def _fault_master(tmp_path, nodes, fault):
    """The fault-injection part of a master, over a real shard service and fake nodes."""
    from types import SimpleNamespace

    from master.job.faults import FaultInjector, JobProgress
    from master.sharding.ledger import DatasetSpec
    from master.sharding.service import ShardingService
    from master.state.sqlite import SQLiteStateStore

    tmp_path.mkdir(parents=True, exist_ok=True)
    sharding = ShardingService(SQLiteStateStore(str(tmp_path / "s.sqlite")), flush_seconds=3600)
    sharding.create(DatasetSpec("train", size=400, batch_size=10, records_per_shard=100))
    sharding.create(DatasetSpec("eval", size=100, batch_size=10, records_per_shard=100))
    events, platform = [], _Platform()
    injector = FaultInjector(
        fault if isinstance(fault, list) else [fault],
        _Nodes(nodes),
        platform,
        sharding,
        coordinator=lambda: None,
        catch_up_positions=lambda: 0,
        emit=lambda kind, message, *a, **k: events.append((kind, message)),
        save=lambda: None,
    )
    m = SimpleNamespace(
        injector=injector, sharding=sharding, platform=platform, events=events, global_step=0
    )
    m.tick = lambda: injector.tick(lambda: JobProgress(50.0, 1.0, m.global_step))
    return m


def test_a_kill_waiting_for_a_late_trainer_keeps_its_peers_data_for_it(tmp_path):
    from master.sharding.service import ShardStatus

    w0, late = _trainer("worker", 0, 1, steps=5), _trainer("worker", 1, 2)
    chief = _trainer("chief", 0, 3, steps=5)
    m = _fault_master(tmp_path, [w0, late, chief], parse_fault("worker:1@40%"))
    assert m.sharding.get_shard("train", holder=w0.id).status == ShardStatus.SHARD
    assert m.sharding.get_shard("eval", holder=chief.id).status == ShardStatus.SHARD
    m.tick()
    assert [k for k, _ in m.events] == ["fault_waiting"] and m.platform.signals == []
    # Its peer (a worker) reads "train": that is kept; the chief's "eval" is not a worker's.
    assert m.injector._kept_datasets == {"train"}
    assert m.sharding.get_shard("train", holder=chief.id).status == ShardStatus.PENDING
    assert m.sharding.get_shard("train", holder=late.id).status == ShardStatus.SHARD
    late.steps = 1  # its first step: the kill lands, and the others' asks go on
    m.tick()
    assert m.platform.signals == [(late.id, signal.SIGKILL)] and m.injector._kept_datasets == set()
    assert m.sharding.get_shard("train", holder=chief.id).status == ShardStatus.SHARD
    m.sharding.close()


def test_a_late_trainer_that_never_steps_holds_the_others_back_for_a_bounded_time(
    tmp_path, monkeypatch
):
    from master.job import faults
    from master.sharding.service import ShardStatus

    w0, late = _trainer("worker", 0, 1, steps=5), _trainer("worker", 1, 2)
    m = _fault_master(tmp_path, [w0, late], parse_fault("worker:1@40%"))
    m.sharding.get_shard("train", holder=w0.id)
    m.tick()
    assert m.sharding.get_shard("train", holder=w0.id).status == ShardStatus.PENDING
    now = faults.time.monotonic()
    monkeypatch.setattr(faults.time, "monotonic", lambda: now + faults.KEEP_WORK_SECONDS + 1)
    m.tick()
    m.tick()  # said once
    said = [msg for k, msg in m.events if k == "fault_waiting"]
    assert len(said) == 2 and "the others train on without waiting for it" in said[1]
    assert m.sharding.get_shard("train", holder=w0.id).status == ShardStatus.SHARD
    assert m.platform.signals == []  # still due: it fires at the late trainer's first step
    m.sharding.close()


def test_a_freeze_is_parsed_with_or_without_its_length():
    from master.job.faults import FaultAction, FaultSpecError

    frozen = parse_fault("worker:1@step=40:freeze")
    assert (frozen.action, frozen.signal, frozen.freeze_seconds) == (
        FaultAction.FREEZE,
        signal.SIGSTOP,
        None,
    )
    assert frozen.describe() == "SIGSTOP (a freeze) to worker-1 at global step 40"
    timed = parse_fault("chief:0@30s:freeze=12.5s")
    assert timed.freeze_seconds == 12.5
    assert timed.describe() == "SIGSTOP (a freeze for 12.5s) to chief-0 at 30s after start"
    assert parse_fault("worker:0@5%:TERM").signal == signal.SIGTERM
    assert parse_fault("worker:0@5%").action == FaultAction.KILL
    for bad, said in [
        ("master:0@40%:freeze", "the master cannot be frozen"),
        ("worker:0@40%:SIGTERM=3s", "only :freeze takes a length"),
        ("worker:0@40%:SIGNOPE", "unknown signal"),
    ]:
        try:
            parse_fault(bad)
        except FaultSpecError as e:
            assert said in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_a_frozen_node_is_thawed_at_the_end_of_its_freeze_unless_the_master_ended_it(
    tmp_path, monkeypatch
):
    from master.job import faults
    from master.nodes.model import NodeState

    w0, w1 = _trainer("worker", 0, 1, steps=5), _trainer("worker", 1, 2, steps=5)
    m = _fault_master(tmp_path, [w0, w1], parse_fault("worker:1@40%:freeze=10s"))
    now = faults.time.monotonic()
    monkeypatch.setattr(faults.time, "monotonic", lambda: now)
    m.tick()
    assert m.platform.signals == [(w1.id, signal.SIGSTOP)]
    assert "SIGSTOP (a freeze for 10s) to worker-1" in m.events[-1][1]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now + 9.9)
    m.tick()
    assert m.platform.signals == [(w1.id, signal.SIGSTOP)]  # still frozen
    monkeypatch.setattr(faults.time, "monotonic", lambda: now + 10.0)
    m.tick()
    assert m.platform.signals[-1] == (w1.id, signal.SIGCONT)
    assert "thawed (SIGCONT)" in m.events[-1][1]
    m.tick()
    assert len(m.platform.signals) == 2  # once

    # Found by the master (its heartbeat lost) and ended before the freeze's end: no SIGCONT.
    w0b, w1b = _trainer("worker", 0, 1, steps=5), _trainer("worker", 1, 2, steps=5)
    m2 = _fault_master(tmp_path / "2", [w0b, w1b], parse_fault("worker:1@40%:freeze=10s"))
    m2.tick()
    w1b.state = NodeState.FAILED
    monkeypatch.setattr(faults.time, "monotonic", lambda: now + 60)
    m2.tick()
    assert m2.platform.signals == [(w1b.id, signal.SIGSTOP)]
    m.sharding.close()
    m2.sharding.close()


def test_a_freeze_without_a_length_lasts_past_the_heartbeat_timeout():
    from master.job.faults import default_freeze_seconds

    assert default_freeze_seconds(15) == 30
    assert default_freeze_seconds(2) == 7
    assert default_freeze_seconds(0) == 5


def test_two_faults_due_at_once_on_one_node_hit_two_incarnations(tmp_path):
    """A second SIGKILL to a dying process is no fault: it waits for the next incarnation."""
    from master.nodes.model import NodeState

    w1 = _trainer("worker", 1, 2, steps=5)
    m = _fault_master(
        tmp_path, [w1], [parse_fault("worker:1@step=10"), parse_fault("worker:1@step=20")]
    )
    m.global_step = 25
    m.tick()
    m.tick()
    assert m.platform.signals == [(2, signal.SIGKILL)] and m.injector.fired == [0]
    w1.state = NodeState.FAILED
    m.injector._nodes.nodes = [_trainer("worker", 1, 3, steps=1)]  # its relaunch, stepping
    m.tick()
    assert m.platform.signals == [(2, signal.SIGKILL), (3, signal.SIGKILL)]
    assert m.injector.fired == [0, 1]
    m.sharding.close()


def test_a_kill_that_reaches_no_process_is_skipped_not_fired(tmp_path):
    w1 = _trainer("worker", 1, 2, steps=5)
    m = _fault_master(tmp_path, [w1], parse_fault("worker:1@40%"))
    m.platform.signal_node = lambda node_id, sig: False  # it ended just now
    m.tick()
    assert m.injector.fired == [0]
    assert [k for k, _ in m.events] == ["fault"] and m.events[0][1].endswith("skipped")
    m.sharding.close()


def test_a_kill_due_while_its_target_is_relaunched_waits_for_the_relaunch(tmp_path):
    """A loaded machine: the trigger comes while the target's last incarnation failed and the
    next is not running yet. The fault waits for it (said once), not skipped; a target that
    succeeded never comes back, so its fault is skipped."""
    from master.nodes.model import NodeState

    w1 = _trainer("worker", 1, 2, steps=5)
    w1.state = NodeState.FAILED
    m = _fault_master(tmp_path, [w1], parse_fault("worker:1@step=10"))
    m.global_step = 25
    m.tick()
    m.tick()
    assert m.platform.signals == [] and m.injector.fired == []
    assert [k for k, _ in m.events] == ["fault_waiting"], m.events
    assert "waiting for worker-1 to run (failed now)" in m.events[0][1]
    starting = _trainer("worker", 1, 3, steps=5)  # its relaunch, restored from a checkpoint
    starting.state = NodeState.PENDING
    m.injector._nodes.nodes = [starting]
    m.tick()
    assert m.platform.signals == [] and m.injector.fired == []
    starting.state = NodeState.RUNNING
    m.tick()
    assert m.platform.signals == [(3, signal.SIGKILL)] and m.injector.fired == [0]
    m.sharding.close()

    done = _trainer("worker", 1, 4, steps=5)
    done.state = NodeState.SUCCEEDED
    m = _fault_master(tmp_path / "b", [done], parse_fault("worker:1@step=10"))
    m.global_step = 25
    m.tick()
    assert m.platform.signals == [] and m.injector.fired == [0]
    assert m.events[-1][1].endswith("node not running, skipped"), m.events
    m.sharding.close()


def test_a_torch_agent_counts_as_trained_by_the_global_step_of_its_heartbeats():
    """dlrover-run reports its workers' global step in heartbeats, no steps of its own: a step
    fault waits for a relaunched agent's first reported step, as for a shard reader."""
    from master.job.faults import waits_for_first_step

    at_step = parse_fault("worker:0@step=100")
    peer = _trainer("worker", 1, 2)
    peer.global_step = 150
    relaunched = _trainer("worker", 0, 3)
    assert waits_for_first_step(at_step, relaunched, False, [peer, relaunched], None)
    relaunched.global_step = 120  # restored and stepping
    assert not waits_for_first_step(at_step, relaunched, False, [peer, relaunched], None)
