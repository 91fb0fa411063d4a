"""The TF example job on real processes: a worker SIGKILLed mid-epoch, nothing lost."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS, EPOCHS, BATCH = 24_000, 2, 128

pytestmark = pytest.mark.slow


def test_tf_ps_job_survives_worker_kill_with_exact_record_accounting(tmp_path):
    ids = tmp_path / "ids"
    ids.mkdir()
    job = {
        "name": "wide-deep-e2e",
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
            "2048",
            "--log-trained-ids",
            str(ids / "trained"),
        ],
        "workdir": str(tmp_path),
        "ps": {"replicas": 1},
        "chief": {"replicas": 1},
        "worker": {"replicas": 2, "max_relaunches": 2},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "master.cli",
            "submit",
            str(tmp_path / "job.yaml"),
            "--kill",
            "worker:1@40%",
            "--summary-json",
            str(summary_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "succeeded"
    d = summary["datasets"]["train"]
    assert d["records_done"] == RECORDS * EPOCHS
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert w1[0]["exit_reason"] == "killed" and w1[-1]["status"] == "succeeded"
    assert all(n["status"] == "deleted" for n in summary["nodes"] if n["type"] == "ps")

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
