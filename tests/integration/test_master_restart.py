"""A master killed mid-job: the supervisor restarts it, it adopts the running nodes, and the
job finishes with every record trained exactly `epochs` times and no healthy node relaunched."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import threading

import pytest
import yaml

from master.config import parse_job_spec
from master.job.master import JobMaster, JobRuntime, MasterFencedError
from master.platform.local import LocalPlatform
from master.state.sqlite import SQLiteStateStore
from tests.integration.test_local_job import DLROVER, HERE, trained_counts, write_job


def _submit_streaming(job_yaml, tmp_path, *args, on_line=None, timeout=180):
    """Run `dlrover submit`, calling on_line(line) for each output line; returns (rc, out)."""
    proc = subprocess.Popen(
        [
            *DLROVER,
            "submit",
            job_yaml,
            "--summary-json",
            str(tmp_path / "s.json"),
            "--run-dir",
            str(tmp_path / "run"),
            "--status-interval",
            "0.5",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=os.path.dirname(HERE),
    )
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if on_line:
                on_line(line)
        proc.wait()
    finally:
        timer.cancel()
    return proc.returncode, "".join(lines)


def _summary(tmp_path) -> dict:
    return json.loads((tmp_path / "s.json").read_text())


def test_killed_master_is_restarted_and_keeps_every_node(tmp_path):
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.01"})
    rc, out = _submit_streaming(job, tmp_path, "--kill", "master:0@40%")
    assert rc == 0, out
    assert "fault injection: SIGKILL to master-0" in out
    assert "master died (killed by SIGKILL); restarting it (1/5)" in out
    summary = _summary(tmp_path)
    assert summary["status"] == "succeeded"
    # The same two worker incarnations ran from start to end: none was relaunched.
    nodes = [(n["type"], n["rank"], n["relaunches"], n["exit_reason"]) for n in summary["nodes"]]
    assert nodes == [("worker", 0, 0, "succeeded"), ("worker", 1, 0, "succeeded")]
    assert len(glob.glob(str(tmp_path / "ids" / "*.ids"))) == 2  # one process per worker
    d = summary["datasets"]["train"]
    assert d["records_done"] == 6000 and d["records_redone"] == 0
    counts = trained_counts(tmp_path)
    assert counts.min() == 2 and counts.max() == 2  # nothing lost, nothing trained twice
    kinds = [e["kind"] for e in summary["events"]]
    # Events of both master instances are in the summary, in order.
    assert kinds.index("fault") < kinds.index("master_restarted") < kinds.index("job_succeeded")


def test_node_that_dies_while_the_master_is_down_is_relaunched_by_the_new_one(tmp_path):
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.01"})
    killed = []

    def kill_worker_1_while_master_is_down(line: str) -> None:
        if "master died" in line and not killed:
            [ids] = glob.glob(str(tmp_path / "ids" / "worker.1.*.ids"))
            pid = int(ids.rsplit(".", 2)[-2])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    rc, out = _submit_streaming(
        job, tmp_path, "--kill", "master:0@40%", on_line=kill_worker_1_while_master_is_down
    )
    assert rc == 0, out
    assert killed
    summary = _summary(tmp_path)
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert [n["exit_reason"] for n in w1] == ["killed", "succeeded"]
    w0 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 0)]
    assert [n["relaunches"] for n in w0] == [0]
    counts = trained_counts(tmp_path)
    assert counts.min() == 2
    # At most two batches of 16: the one in flight when worker 1 died, and the one whose
    # report went to the dying master (worker 1 died before it could send it again).
    assert int((counts - 2).sum()) <= 32


def test_a_master_that_fails_before_starting_the_job_is_not_restarted(tmp_path):
    job = write_job(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, out = _submit_streaming(job, tmp_path, "--port", str(port))
    assert rc == 2, out
    assert "restarting" not in out
    assert f"cannot listen on 127.0.0.1:{port}" in out


def test_a_port_the_supervisor_picked_and_lost_before_the_master_bound_it_is_picked_again(
    tmp_path,
):
    """Another process (Ray's, in CI) may bind the port between the pick and the master's bind."""
    job = write_job(tmp_path, workers=1, env={"FAKE_SIZE": "200"})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # The first pick returns the busy port; later picks are real.
        run = (
            "import sys; import master.platform.local as local; real = local.free_port; "
            f"picks = iter([{taken}]); "
            "local.free_port = lambda host='127.0.0.1': next(picks, None) or real(host); "
            "from master.cli.main import main; sys.exit(main(sys.argv[1:]))"
        )
        proc = subprocess.run(
            [DLROVER[0], "-c", run, "submit", job, "--summary-json", str(tmp_path / "s.json")],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=os.path.dirname(HERE),
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"cannot listen on 127.0.0.1:{taken}" in proc.stderr
    assert "taken meanwhile; picking again" in proc.stdout
    assert _summary(tmp_path)["status"] == "succeeded"


@pytest.fixture
def spec(tmp_path):
    return parse_job_spec(
        {"name": "fence", "command": ["true"], "worker": {"replicas": 1}},
        source="test",
        base_dir=str(tmp_path),
    )


def test_an_older_master_instance_is_fenced_out(tmp_path, spec):
    store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
    platforms = [LocalPlatform(), LocalPlatform()]
    old, new = (JobMaster(spec, p, store, JobRuntime(str(tmp_path), "", "")) for p in platforms)
    try:
        old._take_epoch()
        old._check_fence()  # alone: it may act
        new._take_epoch()
        assert new.epoch == old.epoch + 1
        old._next_fence_check = 0.0
        with pytest.raises(MasterFencedError, match=f"master epoch {new.epoch} runs this job"):
            old._check_fence()
        new._check_fence()
    finally:
        for job in (old, new):
            job.sharding.close()
        for p in platforms:
            p.shutdown(1)
        store.close()


def test_a_retried_shard_ask_gets_the_same_shard_and_a_new_ask_another(harness):
    from master.pb import data_pb2

    c = harness.client(0)
    spec = data_pb2.DatasetSpec(name="d", size=100, batch_size=10, epochs=1, records_per_shard=10)
    c.create_dataset(spec)
    ask = data_pb2.GetShardRequest(node=c._node_pb(), dataset="d", request_id=7)
    # The same request twice: as a client retries when the first answer was lost.
    first = c._call(c._stub.GetShard, ask).shard
    again = c._call(c._stub.GetShard, ask).shard
    assert (again.shard_id, again.record_indices) == (first.shard_id, first.record_indices)
    other = c.get_shard("d").shard
    assert other.shard_id != first.shard_id
    [stats] = harness.job.sharding.stats()
    assert stats.records_doing == first.end - first.start + other.end - other.start


def test_master_killed_with_its_state_on_etcd_resumes_from_etcd(tmp_path):
    from tests.integration.etcd_server import EtcdServer, etcd_binary

    etcd = EtcdServer(etcd_binary(), tmp_path / "etcd")
    etcd.start()
    try:
        job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.01"})
        state = "etcd://" + etcd.endpoint.split("//", 1)[-1]
        rc, out = _submit_streaming(job, tmp_path, "--state", state, "--kill", "master:0@40%")
        assert rc == 0, out
        assert "restarting it (1/5)" in out
        assert not (tmp_path / "run" / "state.sqlite").exists()  # the state lived in etcd
        summary = _summary(tmp_path)
        assert [n["relaunches"] for n in summary["nodes"]] == [0, 0]
        assert summary["datasets"]["train"]["records_done"] == 6000
        counts = trained_counts(tmp_path)
        assert counts.min() == 2 and counts.max() == 2
    finally:
        etcd.kill()


def test_chaos_run_reports_kills_survived_and_no_record_missing(tmp_path):
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.01"}, max_relaunches=20)
    data = yaml.safe_load(open(job))
    data["worker"]["max_relaunches"] = 10
    open(job, "w").write(yaml.safe_dump(data))
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [*DLROVER, "chaos", job, "--kills", "4", "--seed", "2", "--out-dir", str(tmp_path / "c")]
        + ["--report", str(report), "--by", "records"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=os.path.dirname(HERE),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== chaos report: job fake, seed 2, faults by records" in proc.stdout
    r = json.loads(report.read_text())
    assert r["status"] == "succeeded" and r["records_missing"] == 0
    assert r["kills_planned"] == 4 and r["kills_fired"] + r["kills_skipped"] == 4
    assert r["kills_not_fired"] == 0 and len(r["kills"]) == 4
    master_kills = sum("to master-0" in k for k in r["kills"])
    assert r["master_restarts"] == master_kills
    assert r["command"].startswith("dlrover chaos")
