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
    harness.job._on_node_exit(NodeEvent(node.type, node.rank, node.id, exit_code=-9))
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
    harness.job._on_node_exit(NodeEvent(node.type, node.rank, node.id, exit_code=1))
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
    deadline = time.monotonic() + 10
    while job.sharding.stats()[0].records_done < 30:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.stop(grace=0).wait()
    job.sharding.close()
    store.close()
    job2, server2, _, store2 = master(tmp_path / "b.sqlite", port)
    try:
        job2.nodes.restore()
        assert job2.sharding.stats()[0].records_done == 0
        deadline = time.monotonic() + 15
        while job2.sharding.stats()[0].records_done < 30:  # no send() since the restart
            assert time.monotonic() < deadline, "the progress was not re-sent"
            time.sleep(0.05)
        assert stream.close(timeout=10).applied >= 1  # the re-sent report, on the new stream
    finally:
        server2.stop(grace=0).wait()
        job2.sharding.close()
        store2.close()
