"""`--rpc-server`: a whole local job on the thread server (`sync`; the default `aio` runs every
other job test) keeps the same guarantees, and a wrong value is one clear error."""

from __future__ import annotations

import subprocess

from tests.integration.test_local_job import DLROVER, submit, trained_counts, write_job


def test_a_worker_killed_on_the_sync_server_loses_no_record(tmp_path):
    # The kill ends the worker, not a heartbeat timeout: a long one, so a starved machine
    # (a loaded run once went 3 s without a heartbeat) does not declare it lost first.
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.02"}, heartbeat_timeout_seconds=30)
    proc, summary = submit(job, tmp_path, "--rpc-server", "sync", "--kill", "worker:1@40%")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["status"] == "succeeded"
    d = summary["datasets"]["train"]
    assert d["records_done"] == d["size"] * d["epochs"] == 6000
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert [n["exit_reason"] for n in w1] == ["killed", "succeeded"]
    counts = trained_counts(tmp_path)
    # Every record exactly `epochs` times, except at most one batch (16) for the one kill.
    assert counts.min() == 2 and int((counts - 2).sum()) <= 16


def test_an_unknown_rpc_server_is_one_clear_error(tmp_path):
    out = subprocess.run(
        [*DLROVER, "submit", write_job(tmp_path), "--rpc-server", "uvloop"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "--rpc-server: invalid choice: 'uvloop' (choose from 'sync', 'aio')" in out.stderr
