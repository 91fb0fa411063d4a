"""A real local job with `autoscale:` on: workers grow while each added one pays, then hold.

The fake trainers share a lock standing for a PS that serves one update at a time
(FAKE_PS_SECONDS), so throughput grows linearly up to 3 workers and is flat after: the
scaler goes 1 -> 2 -> 3 -> 4, sees the 4th bring under half a worker's rate, goes back to 3
and stays there. Every record is trained; the decisions are in the events and `dlrover status`.

A step sleeps twice as long as it holds the lock, so 3 workers fill the lock exactly and a 4th
adds only what queueing took from 3 (measured: 16 and 30 records/s, a worker making 255). With
a 4th worker adding half a worker's rate (a step 2.5 times the lock), whether it paid depended
on a few percent of queueing (seen: 3 workers at 618 and 660 records/s, either side of 649).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.integration.test_local_job import DLROVER, start_submit, trained_counts, write_job

SIZE = 12000
MARGINAL_GAIN = 0.5  # a worker is kept when it adds at least half a worker's rate


@pytest.mark.slow
def test_workers_grow_while_throughput_pays_and_back_off_once(tmp_path):
    job = write_job(
        tmp_path,
        workers=1,
        env={
            "FAKE_SIZE": str(SIZE),
            "FAKE_STEP_SECONDS": "0.04",
            "FAKE_PS_SECONDS": "0.02",  # the "PS" saturates at (0.04 + 0.02) / 0.02 = 3 workers
        },
        worker={"replicas": 1, "max_replicas": 4, "max_relaunches": 2},
        autoscale={
            "enabled": True,
            "min_workers": 1,
            "max_workers": 4,
            "interval_seconds": 1,
            "window": 3,
            "settle_seconds": 2,
            "marginal_gain": MARGINAL_GAIN,
        },
    )
    p = start_submit(job, tmp_path, "--status-interval", "5")
    lines: list[str] = []
    status_text = ""
    rpc_decision, rpc_version = None, 0  # read when the back-off shows in the live output
    try:
        first = p.stdout.readline()
        lines.append(first)
        addr = first.split("master at ")[1].split(",")[0]
        token_file = os.path.join(first.split("run dir ")[1].strip(), ".job_token")
        for line in p.stdout:
            lines.append(line)
            if "autoscale: back to 3 workers" in line and not status_text:
                status = subprocess.run(
                    [*DLROVER, "status", "--addr", addr, "--token-file", token_file],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert status.returncode == 0, status.stderr
                status_text = status.stdout
                # The job status RPC carries the decision too (for clients without HTTP).
                from master.client import MasterClient, read_token

                token = read_token({"DLROVER_JOB_TOKEN_FILE": token_file})
                rpc = MasterClient(addr, token).job_status()
                rpc_decision = rpc.autoscale_decision
                rpc_version = rpc.cluster_version
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    out = "".join(lines)
    assert rpc_decision is not None, f"no back-off to 3 workers in the live output:\n{out}"
    assert "back to 3 workers" in rpc_decision, rpc_decision
    assert rpc_version >= 5  # 1 -> 2 -> 3 -> 4 -> 3 workers, a cluster version each
    assert p.returncode == 0, out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["status"] == "succeeded"
    decisions = [e for e in summary["events"] if e["kind"] == "autoscale"]
    assert [d["details"]["workers"] for d in decisions] == [2, 3, 4, 3], out
    assert all(d["details"]["action"] == "scale_workers" for d in decisions)
    back = decisions[-1]
    assert "back to 3 workers: worker 4 added" in back["message"]
    table = back["details"]["throughput_table"]
    # Each of the first three workers paid (at least half a worker's rate), the 4th did not.
    per_worker = table["1"]
    assert table["2"] - table["1"] >= MARGINAL_GAIN * per_worker, table
    assert table["3"] - table["2"] >= MARGINAL_GAIN * table["2"] / 2, table
    assert table["4"] - table["3"] < MARGINAL_GAIN * table["3"] / 3, table
    # The decisions and the scaling they caused are in the live output too.
    assert "autoscale: trying 2 workers" in out and "worker 1 -> 2 (autoscale)" in out
    assert "worker 4 -> 3 (autoscale)" in out
    # Never beyond 4 workers, and the 4th (rank 3) was stopped, not failed.
    workers = [n for n in summary["nodes"] if n["type"] == "worker"]
    assert {n["rank"] for n in workers} == {0, 1, 2, 3}
    assert [n["status"] for n in workers if n["rank"] == 3] == ["deleted"]
    assert all(n["status"] == "succeeded" for n in workers if n["rank"] < 3)
    # Every record trained twice (2 epochs); the stopped worker's one batch may be trained again.
    d = summary["datasets"]["train"]
    assert d["records_done"] == 2 * SIZE
    counts = trained_counts(tmp_path, size=SIZE)
    assert counts.min() == 2 and int((counts - 2).sum()) <= 16
    # `dlrover status` shows the scaler: its last decision, its table.
    assert "autoscale\n  last decision (4 in all" in status_text, status_text
    assert "back to 3 workers" in status_text
    assert "records/s by workers: 1: " in status_text


def test_autoscale_off_by_default_changes_nothing(tmp_path):
    from master.config import load_job_spec
    from master.job.master import JobMaster, JobRuntime
    from master.observability.status_view import render_status, status_document
    from master.platform.local import LocalPlatform
    from master.state.sqlite import SQLiteStateStore

    spec = load_job_spec(write_job(tmp_path, workers=1))
    assert not spec.autoscale.enabled
    store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
    job = JobMaster(spec, LocalPlatform(), store, JobRuntime(str(tmp_path), "", ""))
    try:
        assert job.autoscaler is None
        doc = status_document(job)
        assert doc["autoscale"] == {"enabled": False}
        assert "autoscale" not in render_status(doc, now=time.time())
    finally:
        job.sharding.close()
        store.close()
