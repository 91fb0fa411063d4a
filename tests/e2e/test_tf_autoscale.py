"""The TF example with `autoscale:` on and a PS given too little CPU: it is migrated on its own.

The PS asks for 0.05 cores; any real PS serving a chief and two workers keeps more than that
busy, so after settling and a window of samples (read by the master from the PS process, which
sends no heartbeats) the scaler migrates it to 1.5x the cores, up to `ps_max_cpu`, through the
same protocol as `dlrover migrate`: workers pause, the chief checkpoints, the PS is replaced,
the chief restores. Nothing is lost and nothing is relaunched.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.e2e.test_tf_job import EPOCHS, ROOT, write_job

pytestmark = pytest.mark.slow

# Small batches: 1,500 steps. The scaler judges within ~5 s of the first step (settle 2 s, 3
# samples a second apart), about step 250 on a quiet machine, where training lasts ~20 s.
RECORDS, BATCH = 24_000, 32


def test_tf_cpu_bound_ps_is_migrated_by_the_autoscaler(tmp_path):
    ids = write_job(tmp_path, records=RECORDS, eval_records=1024)
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    job["command"][job["command"].index("--batch-size") + 1] = str(BATCH)
    job["ps"] = {"replicas": 1, "cpu": 0.05}
    job["autoscale"] = {
        "enabled": True,
        "min_workers": 2,
        "max_workers": 2,  # workers stay: this test is about the PS
        "interval_seconds": 1,
        "window": 3,
        "settle_seconds": 2,
        "ps_cpu_percent": 50,
        "ps_max_cpu": 0.075,  # one move: 0.05 -> 0.075 cores, then it may not grow more
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
    cmd += ["--summary-json", str(tmp_path / "s.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["status"] == "succeeded"
    assert summary["datasets"]["train"]["records_done"] == RECORDS * EPOCHS
    decisions = [e for e in summary["events"] if e["kind"] == "autoscale"]
    assert [d["details"]["action"] for d in decisions] == ["migrate_ps"], proc.stdout[-4000:]
    assert decisions[0]["details"]["cpu"] == 0.075
    assert "ps-0 is CPU-bound" in decisions[0]["message"]
    migrated = [e for e in summary["events"] if e["kind"] == "migrated"]
    assert len(migrated) == 1 and migrated[0]["reason"] == "autoscale"
    assert "0.075 CPU" in migrated[0]["message"]
    assert "autoscale: ps-0 is CPU-bound" in proc.stdout
    kinds = [e["kind"] for e in summary["events"]]
    assert "relaunch" not in kinds and "migration_failed" not in kinds
    ps = [n for n in summary["nodes"] if n["type"] == "ps"]
    assert len(ps) == 2 and ps[1]["relaunches"] == 0  # a move, not a failure
    redo = sum(
        e["details"].get("records_to_redo", 0) for e in summary["events"] if e["kind"] == "rollback"
    )
    assert redo <= 2 * BATCH, redo
    # Every record `epochs` times, plus what the migration's restore rolled back (up to a
    # batch a trainer).
    files = glob.glob(str(ids / "trained.*.ids"))
    counts = np.bincount(
        np.concatenate([np.fromfile(f, dtype=np.int64) for f in files]), minlength=RECORDS
    )
    assert len(counts) == RECORDS and counts.min() == EPOCHS
    assert abs(int((counts - EPOCHS).sum()) - redo) <= 3 * BATCH, redo
