"""The Brain on whole local jobs: a PS that ran out of memory gets more in the next run."""

from __future__ import annotations

import json
import os
import subprocess

from tests.integration.test_local_job import DLROVER, HERE, submit, write_job


def test_after_a_ps_oom_the_brain_gives_the_next_run_more_ps_memory(tmp_path):
    fake = ["python", os.path.join(HERE, "fake_trainer.py")]
    job = write_job(
        tmp_path,
        env={"FAKE_PS_OOM_ONCE": "1", "FAKE_STEP_SECONDS": "0.002"},
        ps={"replicas": 1, "memory_mb": 256, "command": fake},
    )
    proc, first = submit(job, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ps = [n for n in first["nodes"] if n["type"] == "ps"]
    assert [n["exit_reason"] for n in ps][0] == "oom"
    assert "ps-0 ran out of memory; relaunch with 384 MB" in proc.stdout
    asked = subprocess.run(
        [*DLROVER, "brain", "propose", job], capture_output=True, text=True, timeout=60
    )
    assert asked.returncode == 0, asked.stderr
    proposal = json.loads(asked.stdout)
    assert proposal["ps_memory_mb"] == 384 and proposal["runs_considered"] == 1

    proc, second = submit(job, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "brain: ps memory 256 -> 384 MB" in proc.stdout
    launched = [
        e for e in second["events"] if e["kind"] == "node_running" and e["node_type"] == "ps"
    ]
    assert [e["details"]["memory_mb"] for e in launched] == [384]  # no OOM this time
    assert os.path.exists(tmp_path / "runs" / "brain.sqlite")
