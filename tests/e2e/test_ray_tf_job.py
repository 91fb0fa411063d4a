"""The TF example job on the Ray platform: a worker SIGKILLed mid-epoch, nothing lost."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS, EPOCHS, BATCH = 12_000, 2, 128
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
    ids = tmp_path / "ids"
    ids.mkdir()
    job = {
        "name": "wide-deep-ray",
        "command": [
            "python",
            os.path.join(ROOT, "examples", "tf", "wide_deep.py"),
            "--records",
            str(RECORDS),
            "--epochs",
            str(EPOCHS),
            "--batch-size",
            str(BATCH),
            "--eval-records",
            "1024",
            "--log-trained-ids",
            str(ids / "trained"),
        ],
        "workdir": str(tmp_path),
        "env": {"TF_CPP_MIN_LOG_LEVEL": "2"},
        "ps": {"replicas": 1},
        "chief": {"replicas": 1},
        "worker": {"replicas": 2, "max_relaunches": 2},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    summary_path = tmp_path / "summary.json"
    env = dict(os.environ, **{MARKER: str(tmp_path)})
    # No --ray-address: the master starts its own Ray cluster on loopback and must stop it.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "master.cli",
            "submit",
            str(tmp_path / "job.yaml"),
            "--platform",
            "ray",
            "--kill",
            "worker:1@40%",
            "--summary-json",
            str(summary_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "succeeded"
    d = summary["datasets"]["train"]
    assert d["records_done"] == RECORDS * EPOCHS
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert w1[0]["exit_reason"] == "killed" and w1[-1]["status"] == "succeeded"
    assert all(n["status"] == "deleted" for n in summary["nodes"] if n["type"] == "ps")
    logs = os.listdir(os.path.join(summary["run_dir"], "logs"))
    headers = [open(os.path.join(summary["run_dir"], "logs", f)).readline() for f in logs]
    assert all("on Ray node 127.0.0.1" in h for h in headers), headers

    files = glob.glob(str(ids / "trained.*.ids"))
    assert len(files) >= 4, files  # chief, worker 0, and both incarnations of worker 1
    trained = np.concatenate([np.fromfile(f, dtype=np.int64) for f in files])
    counts = np.bincount(trained, minlength=RECORDS)
    assert len(counts) == RECORDS, "a trained id outside the dataset"
    assert counts.min() == EPOCHS, f"{int((counts < EPOCHS).sum())} records trained too few times"
    extra = int((counts - EPOCHS).sum())
    assert extra <= BATCH, (
        f"{extra} records trained more than {EPOCHS} times (one kill: <= {BATCH})"
    )

    # The Ray cluster the master started (GCS, raylet, workers) went with it.
    deadline = time.monotonic() + 15
    while _marked(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _marked(str(tmp_path))
    assert left == [], [(p.pid, p.name()) for p in left]
