"""Whole jobs on the local platform with a TF-free trainer: relaunch, accounting, cleanup."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import yaml

from master.cli.exit_codes import EXIT_STOPPED

HERE = os.path.dirname(os.path.abspath(__file__))
DLROVER = [sys.executable, "-m", "master.cli"]


def write_job(tmp_path, workers=2, env=None, **extra) -> str:
    ids = tmp_path / "ids"
    ids.mkdir(exist_ok=True)
    job = {
        "name": "fake",
        "command": ["python", os.path.join(HERE, "fake_trainer.py")],
        "env": {"FAKE_IDS_DIR": str(ids), "FAKE_SIZE": "3000", "FAKE_STEP_SECONDS": "0.004"}
        | (env or {}),
        "worker": {"replicas": workers, "max_relaunches": 2},
        "heartbeat_timeout_seconds": 3,
    } | extra
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def submit(job_yaml, tmp_path, *args, timeout=120):
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            *DLROVER,
            "submit",
            job_yaml,
            "--summary-json",
            str(summary),
            "--status-interval",
            "0.5",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(HERE),
    )
    data = json.loads(summary.read_text()) if summary.exists() else None
    return proc, data


def start_submit(job_yaml, tmp_path, *args) -> subprocess.Popen:
    """`dlrover submit` in the background, its output on a pipe, the summary in s.json."""
    return subprocess.Popen(
        [*DLROVER, "submit", job_yaml, "--summary-json", str(tmp_path / "s.json"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=os.path.dirname(HERE),
    )


def run_events(summary) -> list[dict]:
    """Every event of the job, from its run dir's events.jsonl."""
    with open(os.path.join(summary["run_dir"], "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def trained_counts(tmp_path, size=3000):
    files = glob.glob(str(tmp_path / "ids" / "*.ids"))
    ids = np.concatenate([np.fromfile(f, dtype=np.int64) for f in files])
    return np.bincount(ids, minlength=size)


def test_killed_worker_is_relaunched_and_no_record_is_lost(tmp_path):
    # Progress reaches the master coalesced, once a second: the job must outlast that lag for
    # a kill at 40% to find the worker still training.
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.02"})
    proc, summary = submit(job, tmp_path, "--kill", "worker:1@40%")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fault injection: SIGKILL to worker-1" in proc.stdout
    assert summary["status"] == "succeeded"
    d = summary["datasets"]["train"]
    assert d["records_done"] == d["size"] * d["epochs"] == 6000
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert [n["exit_reason"] for n in w1] == ["killed", "succeeded"]
    assert w1[1]["relaunches"] == 1
    counts = trained_counts(tmp_path)
    # Every record exactly `epochs` times, except at most one batch (16) for the one kill.
    assert counts.min() == 2
    assert int((counts - 2).sum()) <= 16
    assert summary["wall_seconds"] > 0 and summary["global_step"] > 0
    logs = subprocess.run(
        [*DLROVER, "logs", "worker-1", "--run-dir", summary["run_dir"], "--tail", "1"],
        capture_output=True,
        text=True,
    )
    assert logs.returncode == 0
    assert [ln.split(" (")[0] for ln in logs.stdout.splitlines() if ln.startswith("=====")] == [
        f"===== worker-1 id {n['id']}" for n in w1
    ]
    missing = subprocess.run(
        [*DLROVER, "logs", "worker-9", "--run-dir", summary["run_dir"]],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "nodes with logs: worker-0, worker-1" in missing.stderr
    events = run_events(summary)
    kinds = [e["kind"] for e in events if e["kind"] not in ("node_running", "node_exited")]
    assert kinds[:3] == ["fault", "node_failed", "relaunch"] and kinds[-1] == "job_succeeded"
    # Structured: which node, the classified reason, and the details of each decision.
    fault, failed, relaunch = (next(e for e in events if e["kind"] == k) for k in kinds[:3])
    assert (fault["node_type"], fault["node_rank"], fault["node_id"]) == ("worker", 1, w1[0]["id"])
    assert fault["details"]["signal"] == signal.SIGKILL
    assert (failed["node_type"], failed["node_rank"], failed["reason"]) == ("worker", 1, "killed")
    assert failed["details"]["exit_code"] == -signal.SIGKILL
    assert failed["details"]["diagnosis"] == "killed by SIGKILL"
    assert (relaunch["node_id"], relaunch["reason"]) == (w1[1]["id"], "killed")
    assert relaunch["details"]["previous_id"] == w1[0]["id"]
    launched = [(e["node_type"], e["node_rank"]) for e in events if e["kind"] == "node_running"]
    assert sorted(launched) == [("worker", 0), ("worker", 1), ("worker", 1)]


def test_relaunch_budget_exhausted_fails_with_reason(tmp_path):
    proc, summary = submit(write_job(tmp_path, workers=1, env={"FAKE_FAIL": "1"}), tmp_path)
    assert proc.returncode == 1
    assert summary["status"] == "failed"
    assert "worker-0" in summary["reason"] and "max_relaunches" in summary["reason"]
    assert "deliberate failure" in summary["reason"]  # the last log line of the failure
    assert len(summary["nodes"]) == 3  # first launch + 2 relaunches


def test_frozen_worker_is_detected_by_heartbeat_loss_and_replaced(tmp_path):
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.01"})
    p = start_submit(job, tmp_path)
    try:
        victim = _wait_for_node_process(tmp_path, "worker.1")
        frozen_at = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    summary = json.loads((tmp_path / "s.json").read_text())
    assert p.returncode == 0, out
    assert "sent no heartbeat for 3s" in out
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert w1[0]["exit_reason"] == "heartbeat_lost" and w1[-1]["status"] == "succeeded"
    assert time.monotonic() - frozen_at < 100
    counts = trained_counts(tmp_path)
    assert counts.min() == 2 and int((counts - 2).sum()) <= 16


def test_hung_worker_is_restarted_and_its_shards_requeued(tmp_path):
    # Shards of 40 batches: the worker hangs half-way through its first, holding it.
    job = write_job(
        tmp_path,
        env={
            "FAKE_STEP_SECONDS": "0.01",
            "FAKE_HANG_AT_STEP": "20",
            "FAKE_RECORDS_PER_SHARD": "640",
        },
        hang_timeout_seconds=2,
    )
    proc, summary = submit(job, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "made no step for 2s; restarting it" in proc.stdout
    hung = [n for n in summary["nodes"] if n["exit_reason"] == "hang"]
    assert len(hung) == 1 and hung[0]["type"] == "worker"
    counts = trained_counts(tmp_path)
    assert counts.min() == 2 and int((counts - 2).sum()) <= 16


def test_a_worker_idle_with_no_shard_is_neither_hung_nor_lost_under_a_short_timeout(tmp_path):
    """A trainer that holds no shard may wait (here: stops at the end of its first shard of
    20 batches while the other trains the rest, about 7 s); its heartbeat thread keeps it
    alive even though its beats rode its progress reports until then."""
    job = write_job(
        tmp_path,
        env={
            "FAKE_STEP_SECONDS": "0.01",
            "FAKE_SLOW_RANK": "0:0.02",  # room for worker 1 to start late and still step
            "FAKE_HANG_AT_STEP": "20:1",  # worker 1: worker 0's end ends the job
            "FAKE_SIZE": "3200",  # ten shards of 320 records: the first always ends at step 20
            "FAKE_RECORDS_PER_SHARD": "320",
        },
        hang_timeout_seconds=2,
    )
    proc, summary = submit(job, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = run_events(summary)
    assert not [e for e in events if e["kind"] in ("heartbeat_lost", "hang")], proc.stdout
    idle = glob.glob(str(tmp_path / "ids" / "worker.1.*.ids"))
    assert [os.path.getsize(f) for f in idle] == [320 * 8]  # one shard, then it waited
    counts = trained_counts(tmp_path, size=3200)
    assert counts.min() == 2 and int((counts - 2).sum()) == 0


def _scale(addr, token_file, target):
    return subprocess.run(
        [*DLROVER, "scale", target, "--addr", addr, "--token-file", token_file],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_workers_scale_up_and_down_while_training(tmp_path):
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.01", "FAKE_SIZE": "6000"})
    p = start_submit(job, tmp_path)
    try:
        first = p.stdout.readline()
        addr = first.split("master at ")[1].split(",")[0]
        token_file = os.path.join(first.split("run dir ")[1].strip(), ".job_token")
        _wait_for_node_process(tmp_path, "worker.1")
        # Refused requests first, while the job surely runs (it may end soon after the
        # scale-down: the chief's success ends it).
        bad = _scale(addr, token_file, "chief=2")
        assert bad.returncode == 2 and "cannot scale 'chief'" in bad.stderr
        no_ps = _scale(addr, token_file, "ps=2")  # this fake job has no PS
        assert no_ps.returncode == 2 and "the job has no PS" in no_ps.stderr
        up = _scale(addr, token_file, "worker=3")
        assert up.returncode == 0 and "worker: 2 -> 3 (cluster version 2)" in up.stdout, up
        _wait_for_node_process(tmp_path, "worker.2")
        down = _scale(addr, token_file, "worker=1")
        assert down.returncode == 0 and "worker: 3 -> 1" in down.stdout, down
        out = first + p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    summary = json.loads((tmp_path / "s.json").read_text())
    by_rank = {(n["type"], n["rank"]): n for n in summary["nodes"]}
    assert by_rank[("worker", 2)]["status"] == "deleted"
    assert by_rank[("worker", 1)]["status"] == "deleted"
    assert by_rank[("worker", 0)]["status"] == "succeeded"
    counts = trained_counts(tmp_path, size=6000)
    # Two workers were stopped mid-epoch: at most one batch each trained twice.
    assert counts.min() == 2 and int((counts - 2).sum()) <= 2 * 16


def _wait_for_node_process(tmp_path, prefix, timeout=30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = glob.glob(str(tmp_path / "ids" / f"{prefix}.*.ids"))
        if files and os.path.getsize(files[0]) > 0:
            return int(files[0].rsplit(".", 2)[-2])
        time.sleep(0.05)
    raise AssertionError(f"no {prefix} process started")


def _job_processes(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            if (p.info["environ"] or {}).get("FAKE_IDS_DIR", "").startswith(marker):
                out.append(p)
        except psutil.Error:
            continue
    return out


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_no_orphans_when_master_is_interrupted_or_killed(tmp_path, how):
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.05", "FAKE_SIZE": "100000"})
    p = subprocess.Popen(
        [*DLROVER, "submit", job],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=os.path.dirname(HERE),
    )
    _wait_for_node_process(tmp_path, "worker.0")
    _wait_for_node_process(tmp_path, "worker.1")
    assert len(_job_processes(str(tmp_path))) >= 2
    p.send_signal(signal.SIGINT if how == "sigint" else signal.SIGKILL)
    out, _ = p.communicate(timeout=30)
    if how == "sigint":
        assert p.returncode == EXIT_STOPPED, out  # stopped by the user: not a failure
        assert "== job stopped in" in out and "interrupted by SIGINT" in out, out
    deadline = time.monotonic() + 10
    while _job_processes(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _job_processes(str(tmp_path)) == []


def test_bad_yaml_gives_one_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncommand: [python, t.py]\nwroker: {replicas: 2}\n")
    proc = subprocess.run([*DLROVER, "submit", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "wroker" in proc.stderr and "did you mean 'worker'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(
        [*DLROVER, "submit", write_job(tmp_path), "--kill", "worker@x"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "TYPE:RANK@WHEN" in proc.stderr
