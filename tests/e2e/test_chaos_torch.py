"""`dlrover chaos` on the torch example, as issue 37 tried it: the job has no dataset, so the
faults are planned by global step (measured in a fault-free run first); all ten fire, within
the relaunch budgets, and the job succeeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_chaos_on_the_torch_example_fires_every_fault_and_the_job_succeeds(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "master.cli", "chaos", "examples/torch/job.yaml"]
        + ["--kills", "10", "--seed", "1", "--out-dir", str(tmp_path / "c")]
        + ["--report", str(report)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=880,
    )
    assert proc.returncode == 0, proc.stdout[-5000:]
    r = json.loads(report.read_text())
    assert r["trigger"] == "steps" and r["status"] == "succeeded", r
    assert (r["kills_planned"], r["kills_fired"], r["kills_not_fired"]) == (10, 10, 0), r
    assert r["warnings"] == []
    node_kills = sum("to worker-" in k for k in r["kills"])
    assert r["relaunches"] >= 1 and node_kills >= 1
    assert r["master_restarts"] == sum("to master-0" in k for k in r["kills"])
    assert "faults: 10 fired of 10 planned" in proc.stdout
