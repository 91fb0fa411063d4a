"""Bad requests get a clear status and the master keeps serving."""

import grpc
import pytest

from master.client import MasterClient, MasterError, NodeIdentity, StaleNodeError, decode_indices
from master.pb import data_pb2

from .conftest import TOKEN


def spec(name="d", size=100, batch=10, epochs=1, per_shard=0):
    return data_pb2.DatasetSpec(
        name=name, size=size, batch_size=batch, epochs=epochs, records_per_shard=per_shard
    )


def test_wrong_token_is_unauthenticated_and_master_keeps_serving(harness):
    bad = harness.client(0, token="wrong", retry_seconds=0)
    with pytest.raises(MasterError) as e:
        bad.create_dataset(spec())
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in str(e.value)
    none = MasterClient(harness.addr, "", harness.nodes[0], retry_seconds=0)
    with pytest.raises(MasterError) as e:
        none.job_status()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert harness.client(0).create_dataset(spec()) is True


def test_unknown_and_stale_node_ids_are_failed_precondition(harness):
    ghost = MasterClient(harness.addr, TOKEN, NodeIdentity("worker", 0, 999))
    with pytest.raises(StaleNodeError, match="unknown node id 999"):
        ghost.create_dataset(spec())
    liar = MasterClient(harness.addr, TOKEN, NodeIdentity("worker", 1, harness.nodes[0].id))
    with pytest.raises(StaleNodeError, match="not worker-1"):
        liar.heartbeat()
    # A relaunch makes the old incarnation stale.
    old = harness.client(2)
    new = harness.job.nodes.new_incarnation("worker", 2, 1, 0)
    harness.job.nodes.mark_running(new.id, "", "")
    with pytest.raises(StaleNodeError, match="old incarnation"):
        old.heartbeat()
    assert harness.client(0).heartbeat() == []


def test_bad_dataset_requests(harness):
    c = harness.client(0)
    with pytest.raises(MasterError) as e:
        c.create_dataset(spec(size=-5))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "size" in str(e.value)
    with pytest.raises(MasterError) as e:
        c.create_dataset(spec(batch=0))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "batch_size" in str(e.value)
    with pytest.raises(MasterError) as e:
        c.get_shard("nope")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "nope" in str(e.value)
    assert c.create_dataset(spec()) is True
    assert c.create_dataset(spec()) is False  # idempotent
    with pytest.raises(MasterError) as e:
        c.create_dataset(spec(size=200))
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS and "size" in str(e.value)
    with pytest.raises(MasterError) as e:
        c.get_shard("d", wait_ms=-1)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    shard = c.get_shard("d").shard
    with pytest.raises(MasterError) as e:
        c.report_progress("d", [(shard.shard_id, 10**6)])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # Another node reporting on a shard it does not hold is stale.
    with pytest.raises(StaleNodeError):
        harness.client(1).report_progress("d", [(shard.shard_id, 1)])
    c.report_progress("d", [(shard.shard_id, shard.end - shard.start)])
    assert harness.job.sharding.stats()[0].records_done == shard.end - shard.start


def test_unconsumed_remainder_requeued_after_death(harness):
    a, b = harness.client(0), harness.client(1)
    a.create_dataset(spec(size=100, batch=10, epochs=1))
    shard = a.get_shard("d").shard
    a.report_progress("d", [(shard.shard_id, 30)])
    harness.job.sharding.release_everywhere(harness.nodes[0].id)
    got = b.get_shard("d").shard
    assert (got.start, got.end) == (shard.start + 30, shard.end)
    assert decode_indices(got.record_indices) == list(range(shard.start + 30, shard.end))
    with pytest.raises(StaleNodeError):
        a.report_progress("d", [(shard.shard_id, 40)])


def test_blocking_get_shard_returns_when_remainder_comes_back(harness):
    import threading
    import time

    a, b = harness.client(0), harness.client(1)
    a.create_dataset(data_pb2.DatasetSpec(name="d", size=10, batch_size=10, epochs=1))
    held = a.get_shard("d").shard
    assert b.get_shard("d", wait_ms=0).status == data_pb2.GetShardReply.PENDING
    result = {}

    def wait():
        t0 = time.monotonic()
        result["reply"] = b.get_shard("d", wait_ms=10_000)
        result["waited"] = time.monotonic() - t0

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    a.report_progress("d", [(held.shard_id, 4)])
    harness.job.sharding.release("d", harness.nodes[0].id)
    t.join(5)
    assert result["reply"].status == data_pb2.GetShardReply.SHARD
    assert decode_indices(result["reply"].shard.record_indices) == list(range(4, 10))
    assert 0.2 < result["waited"] < 3
    b.report_progress("d", [(result["reply"].shard.shard_id, 6)])
    assert b.get_shard("d", wait_ms=10_000).status == data_pb2.GetShardReply.END


def test_ledger_snapshot_and_restore(harness):
    c = harness.client(0)
    c.create_dataset(spec(size=100, batch=10, per_shard=20))
    s1 = c.get_shard("d").shard
    c.report_progress("d", [(s1.shard_id, s1.end - s1.start)])
    s2 = c.get_shard("d").shard
    c.report_progress("d", [(s2.shard_id, 5)], global_step=7)
    snap = c.save_ledger("d", 7)
    assert snap.global_step == 7 and snap.records_done == (s1.end - s1.start) + 5
    c.report_progress("d", [(s2.shard_id, s2.end - s2.start)])
    restored = c.restore_ledger("d", 7)
    assert restored.records_done == snap.records_done
    assert harness.job.sharding.stats()[0].records_done == snap.records_done
    # The latest snapshot at or before the asked step is restored (checkpoints may be sparse).
    assert c.restore_ledger("d", 9).global_step == 7
    assert c.restore_ledger("d", 6).global_step == 0  # the one saved at creation
    with pytest.raises(MasterError) as e:
        c.restore_ledger("d", -1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "saved steps: [0, 7]" in str(e.value)


def test_checkpoint_registry_keeps_the_latest(harness):
    c = harness.client(0)
    c.create_dataset(spec())
    assert harness.job.checkpoints.latest() is None
    assert c.report_checkpoint(500, "/m/model.ckpt-500", ["d"]).latest_step == 500
    assert c.report_checkpoint(1000, "/m/model.ckpt-1000", ["d"]).latest_step == 1000
    latest = harness.job.checkpoints.latest()
    assert (latest.global_step, latest.path, latest.datasets) == (
        1000,
        "/m/model.ckpt-1000",
        ("d",),
    )
    with pytest.raises(MasterError) as e:
        c.report_checkpoint(-5, "", [])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def _status(addr, token_file):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "master.cli", "status", "--addr", addr, "--token-file", token_file],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_command_prints_the_running_job(harness, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    harness.client(0).create_dataset(spec())
    out = _status(harness.addr, str(token_file))
    assert out.returncode == 0, out.stderr
    assert "job harness: pending" in out.stdout
    import re

    # The harness serves no dashboard: the screen is built from the gRPC status alone.
    assert re.search(r"\n  d +epoch 1/1 \[-+\] 0/100 ", out.stdout), out.stdout
    assert re.search(r"\n  worker-3 +4  running ", out.stdout), out.stdout
    token_file.write_text("wrong")
    out = _status(harness.addr, str(token_file))
    assert out.returncode == 2 and "refused the job token" in out.stderr


def test_ps_moves_and_count_changes_are_refused_for_a_keras_coordinator_job(harness):
    from master.client import COORDINATOR_KEY

    c = harness.client(0)
    harness.job.kv.set(COORDINATOR_KEY, b"1")  # what dlrover_tf.keras_ps's coordinator sets
    for call in (lambda: c.scale("ps", 2), lambda: c.migrate("ps", 0, memory_mb=4096)):
        with pytest.raises(MasterError, match="ParameterServerStrategy") as e:
            call()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert harness.job.migrator.active is None  # nothing was started


def test_a_ps_change_that_could_not_be_applied_says_why(harness, monkeypatch):
    """Seen in a loaded e2e run: training ended before the chief checkpointed, the change was
    dropped, and the caller read "DEADLINE_EXCEEDED: the master did not apply it in time"."""
    from master.job.migration import MigrationFailedError

    def ended(*args, **kwargs):
        raise MigrationFailedError("training ended before the chief made the checkpoint")

    monkeypatch.setattr(harness.job, "request_scale", ended)
    with pytest.raises(MasterError, match="training ended before the chief") as e:
        harness.client(0).scale("ps", 2)
    assert e.value.code == grpc.StatusCode.ABORTED
