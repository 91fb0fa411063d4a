"""The torch DDP job through `dlrover submit --platform ray`: each node a Ray actor."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.e2e.test_torch_job import STEPS, run_torch_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")
def test_two_node_torch_job_on_ray_survives_a_worker_kill(tmp_path):
    # No --ray-address: the master starts a Ray cluster on loopback; each node is an actor.
    result, evs, _ = run_torch_job(tmp_path, "torch-ray", "worker:1@step=30", "--platform", "ray")
    assert result["status"] == "succeeded", result
    worker1 = [n for n in result["nodes"] if n["type"] == "worker" and n["rank"] == 1]
    assert [n["exit_reason"] for n in worker1][0] == "killed" and len(worker1) == 2, worker1
    logs = os.listdir(os.path.join(result["run_dir"], "logs"))
    headers = [open(os.path.join(result["run_dir"], "logs", f)).readline() for f in logs]
    assert all("on Ray node 127.0.0.1" in h for h in headers if h.startswith("#")), headers
    done = [e for e in evs if e["event"] == "done" and e["step"] == STEPS]
    assert done and {e["world"] for e in done} <= {1, 2}
    assert [e for e in evs if e["event"] == "loop" and e["step"] > 0], "no resume from checkpoint"
