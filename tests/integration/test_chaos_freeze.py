"""`dlrover chaos --actions freeze`: every planned freeze fires, the master finds each frozen
node by its heartbeat timeout and relaunches it, and the report counts only what happened."""

from __future__ import annotations

import json
import os
import subprocess

import yaml

from tests.integration.test_local_job import DLROVER, HERE, write_job


def test_chaos_freezes_are_fired_found_and_reported(tmp_path):
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.02", "FAKE_SIZE": "6000"})
    data = yaml.safe_load(open(job))
    data["worker"]["max_relaunches"] = 5
    data["max_relaunches"] = 10
    open(job, "w").write(yaml.safe_dump(data))
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [*DLROVER, "chaos", job, "--kills", "3", "--seed", "4", "--actions", "freeze"]
        + ["--by", "records", "--out-dir", str(tmp_path / "c"), "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(HERE),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["status"] == "succeeded" and r["records_missing"] == 0, r
    assert r["kills_planned"] == 3 and r["kills_not_fired"] == 0, r
    fired = [k for k in r["kills"] if "fault injection: SIGSTOP (a freeze) to worker-" in k]
    assert len(fired) == r["kills_fired"]
    # Each freeze that fired was found by the heartbeat timeout (3 s, the freeze lasts 7 s).
    assert r["freezes_detected"] == r["kills_fired"] and r["freezes_thawed"] == 0, r
    assert r["relaunches"] >= 1
    assert "found by the heartbeat timeout" in proc.stdout
