"""A torch DDP job through `dlrover submit`: worker nodes run dlrover-run against the job master."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "examples", "torch", "train.py")
STEPS = 120

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def run_torch_job(tmp_path, name: str, kill: str, *args: str) -> tuple[dict, list[dict], str]:
    """The example torch job through `dlrover submit --kill KILL`: (summary, events, output)."""
    events = tmp_path / "events.jsonl"
    with open(os.path.join(ROOT, "examples", "torch", "job.yaml")) as f:
        job = yaml.safe_load(f)
    command = list(job["command"])
    script = command.index("train.py")
    command[script:] = [TRAIN, "--steps", str(STEPS), "--step-seconds", "0.05"]
    command += ["--events", str(events), "--ckpt-every", "5"]
    job.update(name=name, command=command, workdir=str(tmp_path))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    summary = tmp_path / "summary.json"
    out = subprocess.run(
        [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
        + ["--kill", kill, "--summary-json", str(summary)]
        + ["--status-interval", "5", "--run-dir", str(tmp_path / "run"), *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=380,
    )
    assert out.returncode == 0, out.stdout[-4000:]
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    return json.loads(summary.read_text()), evs, out.stdout


def test_killed_worker_node_is_relaunched_and_training_finishes(tmp_path):
    result, evs, _ = run_torch_job(tmp_path, "torch-e2e", "worker:1@step=30")
    assert result["status"] == "succeeded", result
    worker1 = [n for n in result["nodes"] if n["type"] == "worker" and n["rank"] == 1]
    assert sum(n["relaunches"] for n in worker1) >= 1 or len(worker1) >= 2, worker1
    done = [e for e in evs if e["event"] == "done" and e["step"] == STEPS]
    assert done and {e["world"] for e in done} <= {1, 2}
    # Training went on after the kill from a checkpoint, not from step 0.
    resumed = [e for e in evs if e["event"] == "loop" and e["step"] > 0]
    assert resumed, "no group resumed from the checkpoint"


def test_torch_job_survives_its_master_being_killed(tmp_path):
    result, evs, output = run_torch_job(tmp_path, "torch-master-kill", "master:0@step=30")
    assert "master died (killed by SIGKILL); restarting it" in output
    assert result["status"] == "succeeded", result
    # Both node agents ran from start to end: the new master adopted them, relaunched none.
    assert [(n["type"], n["rank"], n["relaunches"]) for n in result["nodes"]] == [
        ("worker", 0, 0),
        ("worker", 1, 0),
    ]
    done = [e for e in evs if e["event"] == "done" and e["step"] == STEPS]
    assert done and {e["world"] for e in done} == {2}
    # Their round survived too: each rank's training process started once and ran to the end
    # (the new master served the same rendezvous round, so no agent restarted its workers).
    starts = sorted((e["rank"], e["pid"]) for e in evs if e["event"] == "start")
    assert [rank for rank, _ in starts] == [0, 1], starts
    assert {(e["rank"], e["pid"]) for e in done} == set(starts)
    logs = os.path.join(result["run_dir"], "logs")
    for name in sorted(f for f in os.listdir(logs) if f.endswith(".log")):
        with open(os.path.join(logs, name)) as f:
            assert "re-rendezvous" not in f.read(), name
