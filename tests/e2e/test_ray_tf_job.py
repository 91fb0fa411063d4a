"""The TF example job on the Ray platform: a worker SIGKILLed mid-epoch, nothing lost."""

from __future__ import annotations

import importlib.util
import os
import time

import psutil
import pytest

from tests.e2e.test_tf_job import run_worker_kill_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = 12_000
MARKER = "DLROVER_RAY_E2E_MARKER"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray"),
]


def _marked(marker: str) -> list[psutil.Process]:
    """Processes started under this test's submit: the master, Ray's own and the nodes."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARKER) == marker and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def test_tf_ps_job_on_ray_survives_worker_kill_with_exact_record_accounting(tmp_path):
    env = dict(os.environ, **{MARKER: str(tmp_path)})
    # No --ray-address: the master starts its own Ray cluster on loopback and must stop it.
    summary, _ = run_worker_kill_job(tmp_path, "--platform", "ray", records=RECORDS, env=env)
    logs = os.listdir(os.path.join(summary["run_dir"], "logs"))
    headers = [open(os.path.join(summary["run_dir"], "logs", f)).readline() for f in logs]
    assert all("on Ray node 127.0.0.1" in h for h in headers), headers

    # The Ray cluster the master started (GCS, raylet, workers) went with it.
    deadline = time.monotonic() + 15
    while _marked(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _marked(str(tmp_path))
    assert left == [], [(p.pid, p.name()) for p in left]
