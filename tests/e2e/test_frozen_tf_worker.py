"""The TF example with a worker frozen mid-epoch (`--kill worker:1@40%:freeze`: SIGSTOP to all
its processes): the heartbeat timeout finds it, it is killed and relaunched, and every record
is trained, at most one batch twice."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.e2e.test_tf_job import EPOCHS, RECORDS, ROOT, check_trained_ids, write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TIMEOUT_S = 8  # TF's start-up on two busy cores must not look like a lost heartbeat


def test_tf_frozen_worker_is_found_killed_and_relaunched(tmp_path):
    ids = write_job(tmp_path, records=RECORDS, eval_records=1024)
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    job["heartbeat_timeout_seconds"] = TIMEOUT_S
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
    cmd += ["--kill", "worker:1@40%:freeze", "--summary-json", str(summary_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "succeeded"
    assert summary["datasets"]["train"]["records_done"] == RECORDS * EPOCHS
    with open(f"{summary['run_dir']}/events.jsonl") as f:
        events = [json.loads(line) for line in f]
    (freeze,) = [e for e in events if e["kind"] == "fault" and e["reason"] == "fault_injection"]
    assert freeze["details"]["action"] == "freeze" and freeze["node_rank"] == 1
    lost = [e for e in events if e["kind"] == "heartbeat_lost"]
    (found,) = [e for e in lost if e["node_id"] == freeze["node_id"]]
    detected = found["time"] - freeze["time"]
    print(f"frozen TF worker-1 found {detected:.2f}s after SIGSTOP (timeout {TIMEOUT_S}s)")
    assert detected <= TIMEOUT_S + 1.0
    assert not [e for e in events if e.get("reason") == "fault_thawed"]
    # Not asserted: that no healthy node lost its heartbeat. With 8 s on two overloaded cores
    # a busy TF worker once did (1 run in 5, 2026-11-29); said here when it happens.
    for e in lost:
        if e is not found:
            print(f"also lost (not frozen): {e['message']}")
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert w1[0]["id"] == freeze["node_id"] and w1[0]["exit_reason"] == "heartbeat_lost", w1
    assert len(w1) >= 2, w1
    assert w1[-1]["status"] == "succeeded" or w1[-1]["exit_reason"] in ("stopped", "heartbeat_lost")
    # Killed while stopped: its position file was read back, so at most one batch twice (and
    # one more per healthy node wrongly lost).
    check_trained_ids(ids, RECORDS, extra_batches=len(lost))
