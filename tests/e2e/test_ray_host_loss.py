"""The TF example on a multi-node Ray cluster loses the Ray node holding ps-0 (and its standby):
Ray tells the master, ps-0 comes back on a Ray node left, the trainers restart with the new
cluster spec, and no record is lost."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from master.client.progress import COALESCE_SECONDS
from tests.e2e.test_tf_job import (
    BATCH,
    EPOCHS,
    RECORDS,
    ROOT,
    _checkpoint_every,
    _checkpoint_in,
    write_job,
)
from tests.integration.ray_cluster import ray_cluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray"),
]


def _events(run_dir) -> list[dict]:
    try:
        text = (run_dir / "events.jsonl").read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _records_between(ids, start: float, end: float) -> int:
    """Records the trainers trained in steps that ended between `start` and `end` (wall time),
    from each trainer's PATH.steps file (global step, records, end time in microseconds)."""
    total = 0
    for path in ids.glob("trained.*.ids.steps"):
        rows = np.fromfile(path, dtype="<i8").reshape(-1, 3)
        ended = rows[:, 2] / 1e6
        total += int(rows[(ended >= start) & (ended <= end), 1].sum())
    return total


def _wait(condition, proc, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.05)


def test_tf_job_loses_the_ray_node_of_ps_0_and_no_record(tmp_path):
    records = 2 * RECORDS  # 750 steps, a checkpoint every 100
    ids = write_job(tmp_path, records=records, args=_checkpoint_every(100))
    run_dir = tmp_path / "run"
    with ray_cluster(worker_nodes=3, cpus_per_node=1) as cluster:
        cmd = [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
        cmd += ["--platform", "ray", "--ray-address", cluster.address, "--run-dir", str(run_dir)]
        cmd += ["--summary-json", str(tmp_path / "s.json")]
        with open(tmp_path / "submit.log", "w+") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                # Lost once training runs past a checkpoint, with the standby PS beside ps-0.
                _wait(lambda: _checkpoint_in(run_dir / "model") > 0, proc, "a checkpoint")
                ps_node = cluster.node_of_log(str(run_dir / "logs" / "ps-0.1.log"))
                removed = cluster.remove(ps_node)
                proc.wait(timeout=240)
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(timeout=60)
            log.seek(0)
            out = log.read()
        assert proc.returncode == 0, out[-4000:]
        summary = json.loads((tmp_path / "s.json").read_text())
        assert summary["status"] == "succeeded"
        assert summary["datasets"]["train"]["records_done"] == records * EPOCHS
        ps = [n for n in summary["nodes"] if n["type"] == "ps"]
        assert ps[0]["exit_reason"] == "node_lost", ps
        assert len(ps) == 2, ps
        events = _events(run_dir)
        relaunched = next(
            e for e in events if e["kind"] == "node_running" and e["node_type"] == "ps"
            and e["node_id"] == ps[1]["id"]
        )  # fmt: skip
        new_ps = cluster.node_of_log(str(run_dir / "logs" / f"ps-0.{ps[1]['id']}.log"))
        assert new_ps in cluster.alive() and new_ps != ps_node, relaunched
    # The recovery, from the removal of the Ray node: detected (Ray's health checks mark it dead),
    # the PS started and serving elsewhere, the trainers restarted, the first step.
    recovery = [e for e in events if e["kind"] == "recovery" and e["reason"] == "ps_failure"]
    assert recovery, [e["kind"] for e in events]
    details = recovery[0]["details"]
    phases = {p: details["started"] + s - removed for p, s in details["phases"].items()}
    assert {"detected", "ps_started", "first_step"} <= set(phases), details
    print(f"Ray node of ps-0 removed: {json.dumps({p: round(s, 2) for p, s in phases.items()})}")
    assert phases["detected"] < 10.0, phases
    # No record lost. Trained twice: what the rollback to the restored checkpoint redoes, the
    # batch each restarted trainer had in flight, and the steps a trainer on the lost Ray node
    # took since its last coalesced report (its position file went with the node: up to
    # COALESCE_SECONDS of steps).
    rollback = [e for e in events if e["kind"] == "rollback"]
    redo = sum(e["details"].get("records_to_redo", 0) for e in rollback)
    unreported = _records_between(
        ids, removed - COALESCE_SECONDS - 0.5, removed + phases["detected"] + 0.5
    )
    files = list(ids.glob("trained.*.ids"))
    counts = np.bincount(
        np.concatenate([np.fromfile(f, dtype=np.int64) for f in files]), minlength=records
    )
    assert counts.min() == EPOCHS, int((counts < EPOCHS).sum())
    extra = int((counts - EPOCHS).sum())
    assert extra <= redo + unreported + 4 * BATCH, (extra, redo, unreported, rollback)
