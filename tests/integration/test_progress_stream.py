"""Per-step progress on a stream: applied in order, stale reports skipped, drained at death."""

import threading
import time

from master.client import ProgressStream
from master.pb import data_pb2
from master.platform.api import NodeEvent


def make_dataset(client, size=1000, per_shard=100):
    client.create_dataset(
        data_pb2.DatasetSpec(
            name="d", size=size, batch_size=10, epochs=1, records_per_shard=per_shard
        )
    )


def wait_for_done(job, records, timeout=10.0, what="the reports"):
    """Wait, with a deadline, until the master counts `records` of dataset "d" done."""
    deadline = time.monotonic() + timeout
    while (done := job.sharding.stats()[0].records_done) < records:
        assert time.monotonic() < deadline, f"{what} not applied: {done} of {records} records"
        time.sleep(0.01)


def test_stream_applies_reports_in_order_and_skips_stale_ones(harness):
    c = harness.client(0)
    make_dataset(c)
    a = c.get_shard("d").shard
    b = c.get_shard("d").shard
    stream = ProgressStream(c)
    for consumed in range(10, 101, 10):
        stream.send("d", [(a.shard_id, consumed)], global_step=consumed)
    reply = stream.close()  # waits until the master applied all ten
    assert (reply.applied, reply.stale) == (10, 0)
    c.return_shards("d")  # b goes back to todo: its id is stale from now on
    stream.send("d", [(b.shard_id, 10)])  # reopens the stream
    reply = stream.close()
    assert (reply.applied, reply.stale) == (0, 1)
    stats = harness.job.sharding.stats()[0]
    assert stats.records_done == 100 and stats.records_todo == 900
    assert harness.job.global_step == 100


def test_a_streams_reply_comes_once_the_shard_ends_it_carried_are_stored(
    harness, tmp_path, monkeypatch
):
    from master.sharding.service import ShardingService
    from master.state.sqlite import SQLiteStateStore

    sharding = harness.job.sharding
    sharding._flush_seconds = 3600  # no periodic flush: only the stream's writes
    time.sleep(0.3)  # the flusher's current wait ends
    commit = sharding.commit

    def slow_commit(*args):  # the aio server's group writes take their time
        time.sleep(0.2)
        commit(*args)

    monkeypatch.setattr(sharding, "commit", slow_commit)
    c = harness.client(0)
    make_dataset(c)
    shards = [c.get_shard("d").shard for _ in range(3)]
    stream = ProgressStream(c)
    for s in shards:
        stream.send("d", [(s.shard_id, s.end - s.start)])
    assert stream.close().applied == 3
    stored = ShardingService(SQLiteStateStore(str(tmp_path / "state.sqlite")), 3600)
    assert stored.stats()[0].records_done == 300
    stored.close()


def test_node_end_waits_for_its_stream_before_requeueing(harness):
    c = harness.client(0)
    make_dataset(c)
    shard = c.get_shard("d").shard
    stream = ProgressStream(c)
    stream.send("d", [(shard.shard_id, 10)])
    time.sleep(0.2)
    node = harness.nodes[0]

    def late_reports_then_close():
        time.sleep(0.3)
        stream.send("d", [(shard.shard_id, 40)])
        stream.close()

    t = threading.Thread(target=late_reports_then_close)
    t.start()
    harness.job.exits.handle(NodeEvent(node.type, node.rank, node.id, exit_code=-9))
    t.join()
    stats = harness.job.sharding.stats()[0]
    # The report sent after the process "died" but before its stream closed counts.
    assert stats.records_done == 40
    assert stats.records_todo == 960
    assert harness.job.nodes.get(node.id).state.value == "failed"


def test_reported_exit_reason_and_message_are_used_when_the_node_ends(harness):
    from master.pb import nodes_pb2

    c = harness.client(1)
    c.report_exit(1, nodes_pb2.HARDWARE, "ECC error on GPU 0")
    node = harness.nodes[1]
    harness.job.exits.handle(NodeEvent(node.type, node.rank, node.id, exit_code=1))
    ended = harness.job.nodes.get(node.id)
    assert ended.exit_reason.value == "hardware"
    assert ended.exit_message == "ECC error on GPU 0"
    assert any("hardware" in e.message for e in harness.job.events)


def test_a_stream_the_master_ended_is_reopened_at_once_and_its_progress_resent(tmp_path):
    """A node that takes no step after its master died (paused, say) still gives the new
    master the progress the old one had not stored: its stream reopens by itself."""
    import shutil

    from master.client import MasterClient, NodeIdentity
    from master.config import parse_job_spec
    from master.job.master import JobMaster, JobRuntime
    from master.platform.local import LocalPlatform
    from master.rpc.server import start_server
    from master.state.sqlite import SQLiteStateStore

    from .conftest import TOKEN

    spec = parse_job_spec(
        {"name": "reopen", "command": ["true"], "worker": {"replicas": 1}},
        source="test",
        base_dir=str(tmp_path),
    )

    def master(path, port=0):
        store = SQLiteStateStore(str(path))
        job = JobMaster(spec, LocalPlatform(), store, JobRuntime(str(tmp_path), "", ""))
        server, port = start_server(job, "127.0.0.1", port, TOKEN, 16, 1000)
        return job, server, port, store

    job, server, port, store = master(tmp_path / "a.sqlite")
    node = job.nodes.new_incarnation("worker", 0, 0, 0)
    job.nodes.mark_running(node.id, "127.0.0.1:1", "")
    client = MasterClient(f"127.0.0.1:{port}", TOKEN, NodeIdentity("worker", 0, node.id))
    make_dataset(client)
    shard = client.get_shard("d").shard
    job.sharding.flush()
    # The new master's state: the grant, but none of the progress below (lost with the old).
    for suffix in ("", "-wal"):  # WAL mode: committed pages may still be in the -wal file
        shutil.copy(tmp_path / f"a.sqlite{suffix}", tmp_path / f"b.sqlite{suffix}")
    stream = ProgressStream(client)
    stream.send("d", [(shard.shard_id, 30)], global_step=3)
    wait_for_done(job, 30)
    server.stop(grace=0).wait()
    job.sharding.close()
    store.close()
    job2, server2, _, store2 = master(tmp_path / "b.sqlite", port)
    try:
        job2.nodes.restore()
        assert job2.sharding.stats()[0].records_done == 0
        wait_for_done(job2, 30, 15, "the progress re-sent")  # no send() since the restart
        assert stream.close(timeout=10).applied >= 1  # the re-sent report, on the new stream
    finally:
        server2.stop(grace=0).wait()
        job2.sharding.close()
        store2.close()


def test_coalesced_steps_go_out_as_one_report_and_the_rest_via_the_position_file(harness, tmp_path):
    """Coalescing: each step only writes the node-local position file; the steps of an
    interval reach the master as one report (with their count, for step times); a trainer
    killed between two flushes loses nothing, because the platform hands its position file
    back with the exit event and the master applies it before re-queueing."""
    from master.client.position import collect_positions, encode_positions
    from master.platform.api import POSITIONS_DETAIL

    c = harness.client(0)
    make_dataset(c)
    shard = c.get_shard("d").shard
    base = str(tmp_path / "worker-0.position")
    stream = ProgressStream(c, position_file=base, flush_seconds=3600)
    assert stream.coalescing
    for step, consumed in enumerate(range(10, 51, 10), start=1):
        stream.send("d", [(shard.shard_id, consumed)], global_step=step)
    assert harness.job.sharding.stats()[0].records_done == 0  # nothing sent yet
    stream.flush()
    node = harness.nodes[0]
    wait_for_done(harness.job, 50)
    assert harness.job.sharding.stats()[0].records_done == 50
    assert harness.job.nodes.get(node.id).steps == 5  # one report, five steps
    assert harness.job.global_step == 5
    for step, consumed in enumerate(range(60, 81, 10), start=6):
        stream.send("d", [(shard.shard_id, consumed)], global_step=step)
    positions = collect_positions(base, remove=False)
    assert positions == {"d": [(shard.shard_id, 80)]}
    # The trainer dies before its next flush: its stream ends without the last three steps.
    stream._stop_flusher.set()
    stream._queue.put(stream._END)
    stream._future.result(timeout=5)
    harness.job.exits.handle(
        NodeEvent(
            node.type,
            node.rank,
            node.id,
            exit_code=-9,
            details={POSITIONS_DETAIL: encode_positions(collect_positions(base))},
        )
    )
    stats = harness.job.sharding.stats()[0]
    assert stats.records_done == 80  # the file's position counts: none of its steps is redone
    assert stats.records_todo == 920


def test_a_coalescing_stream_flushes_by_itself_and_on_close(harness, tmp_path):
    c = harness.client(0)
    make_dataset(c)
    shard = c.get_shard("d").shard
    stream = ProgressStream(c, position_file=str(tmp_path / "p"), flush_seconds=0.05)
    stream.send("d", [(shard.shard_id, 10)], global_step=1)
    wait_for_done(harness.job, 10)
    assert harness.job.sharding.stats()[0].records_done == 10  # no further step was needed
    stream._flush_seconds = 3600  # the next flush only on close
    time.sleep(0.1)
    stream.send("d", [(shard.shard_id, 100)], global_step=2)
    reply = stream.close()
    assert reply.applied >= 1
    stats = harness.job.sharding.stats()[0]
    assert stats.records_done == 100 and stats.records_doing == 0


def test_the_local_platform_hands_a_killed_nodes_positions_back(tmp_path):
    import os
    import signal
    import sys

    from master.client.position import decode_positions
    from master.platform.api import POSITIONS_DETAIL, NodeLaunchSpec
    from master.platform.local import LocalPlatform

    code = (
        "import os, time\n"
        "from master.client.env import read_position_base\n"
        "from master.client.position import PositionFile, stream_position_path\n"
        "f = PositionFile(stream_position_path(read_position_base(os.environ)))\n"
        "f.write({'d': {3: 40}})\n"
        "open(os.environ['READY'], 'w').close()\n"
        "time.sleep(60)\n"
    )
    ready = tmp_path / "ready"
    platform = LocalPlatform()
    try:
        platform.launch(
            NodeLaunchSpec(
                type="worker",
                rank=0,
                id=7,
                command=(sys.executable, "-c", code),
                env={**os.environ, "READY": str(ready)},
                workdir=str(tmp_path),
                log_path=str(tmp_path / "logs" / "worker-0.7.log"),
            )
        )
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        assert platform.signal_node(7, signal.SIGKILL)
        event = platform.events.get(timeout=10)
        assert event.id == 7 and event.exit_code == -signal.SIGKILL
        assert decode_positions(event.details[POSITIONS_DETAIL]) == {"d": [(3, 40)]}
    finally:
        platform.shutdown(1)


def test_a_ledger_snapshot_counts_the_steps_coalesced_reports_have_not_carried_yet(
    harness, tmp_path, monkeypatch
):
    """The chief saves the ledger just before the model: steps the workers took but have not
    reported yet (coalescing) are in the model, so the snapshot must count them, as it did
    with a report per step; the master reads them from the trainers' position files."""
    from master.client.position import collect_positions

    c = harness.client(0)
    make_dataset(c)
    shard = c.get_shard("d").shard
    base = str(tmp_path / "worker-0.position")
    stream = ProgressStream(c, position_file=base, flush_seconds=3600)
    for step, consumed in enumerate(range(10, 71, 10), start=1):
        stream.send("d", [(shard.shard_id, consumed)], global_step=step)
    node = harness.nodes[0]
    monkeypatch.setattr(
        harness.job.platform,
        "read_positions",
        lambda node_id: collect_positions(base, remove=False) if node_id == node.id else {},
    )
    snapshot = c.save_ledger("d", 7)
    assert snapshot.records_done == 70  # nothing was sent on the stream yet
    assert harness.job.sharding.stats()[0].records_done == 70
    stream.close()


def test_a_coalesced_report_carries_the_heartbeat_and_leaves_commands_for_the_call(
    harness, tmp_path
):
    """A flush carries the node's heartbeat (liveness, stats, step) on its report; commands
    queued for the node stay queued until its next Heartbeat call, whose reply brings them."""
    from master.client import HeartbeatThread
    from master.pb import nodes_pb2

    c = harness.client(0)
    make_dataset(c)
    shard = c.get_shard("d").shard
    node = harness.job.nodes.get(harness.nodes[0].id)
    node.last_heartbeat = 0.0
    command = nodes_pb2.Command(kind=nodes_pb2.Command.CHECKPOINT, reason="test")
    harness.job.nodes.queue_command(node.id, command)
    beat = HeartbeatThread(c, interval=3600)  # not started: only the carried beats go out
    stream = ProgressStream(c, position_file=str(tmp_path / "p"), flush_seconds=3600)
    stream.carry_heartbeats(beat)
    before = time.monotonic()
    stream.send("d", [(shard.shard_id, 10)], global_step=7)
    stream.flush()
    deadline = time.monotonic() + 5
    while node.last_heartbeat < before:
        assert time.monotonic() < deadline, "the carried heartbeat never reached the master"
        time.sleep(0.01)
    assert node.memory_rss_bytes > 0  # this process's stats, as HeartbeatThread samples them
    assert node.global_step == 7
    assert beat._last_carried >= before  # the thread skips its next call for it
    assert c.heartbeat() == [command]  # still queued: a carried beat does not take it
    stream.close()


def test_a_coalescing_stream_sends_the_first_step_after_a_quiet_interval_at_once(harness, tmp_path):
    """After an interval with no report (a pause, a recovery), the next step is not held for
    the rest of a new interval: the master learns at once that training resumed."""
    c = harness.client(0)
    make_dataset(c)
    shard = c.get_shard("d").shard
    stream = ProgressStream(c, position_file=str(tmp_path / "p"), flush_seconds=3600)
    stream.send("d", [(shard.shard_id, 10)], global_step=1)
    stream.flush()
    stream._flushed_at -= 3600  # an interval went by with no step
    stream.send("d", [(shard.shard_id, 20)], global_step=2)
    wait_for_done(harness.job, 20)
    assert harness.job.sharding.stats()[0].records_done == 20  # long before the interval ends
    assert harness.job.global_step == 2
    stream.send("d", [(shard.shard_id, 30)], global_step=3)  # coalesced again, sent on close
    assert stream.close().applied >= 1
    assert harness.job.sharding.stats()[0].records_done == 30


def test_a_coordinator_restarted_for_a_ps_loss_keeps_the_reports_still_on_its_stream(tmp_path):
    """TF2 PS training: a PS loss restarts the coordinator (the chief). Its shards go back
    only once its end has drained its stream, so a report on the wire still counts (before,
    they went back first and the report was refused as stale: records trained, then lost)."""
    from master.client import COORDINATOR_KEY, KVClient, MasterClient, NodeIdentity
    from master.config import parse_job_spec
    from master.job.master import JobMaster, JobRuntime
    from master.platform.local import LocalPlatform
    from master.rpc.server import start_server
    from master.state.sqlite import SQLiteStateStore

    from .conftest import TOKEN

    spec = parse_job_spec(
        {"name": "coord", "command": ["true"], "chief": {"replicas": 1}, "ps": {"replicas": 1}},
        source="test",
        base_dir=str(tmp_path),
    )
    store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
    platform = LocalPlatform()
    job = JobMaster(spec, platform, store, JobRuntime(str(tmp_path), "", ""))
    server, port = start_server(job, "127.0.0.1", 0, TOKEN, 16, 1000)
    try:
        chief, ps = (job.nodes.new_incarnation(t, 0, 0, 0) for t in ("chief", "ps"))
        for node in (chief, ps):
            job.nodes.mark_running(node.id, platform.address_for(node.type, 0), "")
        client = MasterClient(f"127.0.0.1:{port}", TOKEN, NodeIdentity("chief", 0, chief.id))
        make_dataset(client)
        KVClient(client).set(COORDINATOR_KEY, b"1")
        client.report_model_restored(0)  # the chief reports restores: it rolls the data back
        shard = client.get_shard("d").shard
        stream = ProgressStream(client)
        stream.send("d", [(shard.shard_id, 10)], global_step=1)
        wait_for_done(job, 10)
        replies = []

        def report_on_the_wire_then_die():
            time.sleep(0.3)  # the master is handling the PS loss by now
            stream.send("d", [(shard.shard_id, 40)], global_step=4)
            replies.append(stream.close())

        t = threading.Thread(target=report_on_the_wire_then_die)
        t.start()
        job.exits.handle(NodeEvent("ps", 0, ps.id, exit_code=-9))
        t.join()
        assert job.nodes.get(chief.id).state.ended  # restarted for the PS loss
        assert (replies[0].applied, replies[0].stale) == (2, 0)  # both reports on it counted
        stats = job.sharding.stats()[0]
        assert (stats.records_done, stats.records_todo) == (40, 960)
    finally:
        server.stop(grace=0).wait()
        job.sharding.close()
        platform.shutdown(1)
        store.close()
