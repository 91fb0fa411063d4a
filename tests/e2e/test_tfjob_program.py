"""A TFJob-style TF2 PS program (tests/e2e/tfjob_program.py, which knows nothing of dlrover) run
unmodified with 1 PS, a chief and 2 workers: it ends when the chief does, survives a worker
SIGKILL half way, and with reserved worker slots stuck detection names the missing workers."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(ROOT, "tests", "e2e", "tfjob_program.py")

pytestmark = pytest.mark.slow


def write_job(tmp_path, epochs=2, steps=50, **fields):
    """job.yaml: the program as chief, workers and PS (1 PS, chief, 2 workers)."""
    command = ["python", PROGRAM, "--epochs", str(epochs), "--steps-per-epoch", str(steps)]
    job = {
        "name": "tfjob-style",
        "command": command,
        "workdir": str(tmp_path),
        "env": {"TF_CPP_MIN_LOG_LEVEL": "2"},
        "ps": {"replicas": 1, "command": ["python", PROGRAM]},
        "chief": {"replicas": 1},
        "worker": {"replicas": 2},
        **fields,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def submit(job_yaml, tmp_path):
    cmd = [sys.executable, "-m", "master.cli", "submit", str(job_yaml)]
    cmd += ["--summary-json", str(tmp_path / "summary.json")]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )


def finish(proc, tmp_path, timeout=400):
    out = proc.communicate(timeout=timeout)[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    return out, summary


def event_time(summary, kind, node=""):
    return next(
        e["time"]
        for e in summary["events"]
        if e["kind"] == kind and (not node or f"{e['node_type']}-{e['node_rank']}" == node)
    )


def test_the_job_succeeds_within_seconds_of_the_chiefs_exit(tmp_path):
    proc = submit(write_job(tmp_path), tmp_path)
    out, summary = finish(proc, tmp_path)
    assert proc.returncode == 0, out[-4000:]
    assert summary["status"] == "succeeded"
    assert summary["reason"] == "chief-0 finished (success_policy: chief)"
    ended = event_time(summary, "job_succeeded") - event_time(summary, "node_exited", "chief-0")
    assert ended < 10.0, f"{ended:.1f}s from the chief's exit to the job's end"
    print(f"chief exit -> job end: {ended:.2f}s")
    by_name = {f"{n['type']}-{n['rank']}": n for n in summary["nodes"]}
    assert by_name["chief-0"]["status"] == "succeeded"
    for name in ("ps-0", "worker-0", "worker-1"):  # in server.join(): stopped, not failed
        assert by_name[name]["exit_reason"] == "stopped", by_name[name]
        assert by_name[name]["note"] == "stopped: job done"
    stopped = [e["message"] for e in summary["events"] if e["kind"] == "node_exited"]
    assert "ps-0 (id 1) stopped: job done" in stopped
    assert not [e for e in summary["events"] if e["kind"] in ("node_failed", "stuck")]
    # A program without our hooks: the live display shows node states and CPU, said once.
    hints = out.count("this program reports no steps to the master")
    assert hints == 1 if summary["wall_seconds"] > 25 else hints <= 1  # said after 20 s
    assert re.search(r"no step reports \| ps-0:run \d+%cpu chief-0:run", out), out[-2000:]
    assert "step 0 |" not in out


def _pgid_of(run_dir, node_type, rank):
    """The process group of a node of this job, found by its DLROVER_* environment."""
    want = {
        f"DLROVER_RUN_DIR={run_dir}".encode(),
        f"DLROVER_NODE_TYPE={node_type}".encode(),
        f"DLROVER_NODE_RANK={rank}".encode(),
    }
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:
            continue
        if want <= env:
            return os.getpgid(int(pid))
    raise AssertionError(f"no {node_type}-{rank} process of {run_dir}")


def _wait_for_line(path_glob, pattern, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in glob.glob(path_glob):
            with open(path, errors="replace") as f:
                if re.search(pattern, f.read(), re.MULTILINE):
                    return
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} never appeared in {path_glob}")


def test_a_worker_sigkilled_half_way_is_relaunched_at_its_address_and_the_job_succeeds(tmp_path):
    # Without step reports a percent-based --kill never fires, and TF's start-up here takes
    # 15-40 s, so the test kills worker-1 itself once the chief's log shows epoch 4 of 6.
    proc = submit(write_job(tmp_path, epochs=6, steps=150), tmp_path)
    try:
        first = proc.stdout.readline()
        run_dir = first.split("run dir ")[1].strip()
        _wait_for_line(os.path.join(run_dir, "logs", "chief-0.*.log"), r"^Epoch 4/6")
        os.killpg(_pgid_of(run_dir, "worker", 1), signal.SIGKILL)
        out, summary = finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert summary["status"] == "succeeded"
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert [n["exit_reason"] for n in w1] == ["killed", "stopped"]
    chiefs = [n for n in summary["nodes"] if n["type"] == "chief"]
    assert len(chiefs) == 1 and chiefs[0]["status"] == "succeeded"  # the coordinator went on
    launched = [
        e["message"].split(" launched at ")[1]
        for e in summary["events"]
        if e["kind"] == "node_running" and e["node_type"] == "worker" and e["node_rank"] == 1
    ]
    assert len(launched) == 2 and launched[0] == launched[1]  # the same host:port
    ended = event_time(summary, "job_succeeded") - event_time(summary, "node_exited", "chief-0")
    assert ended < 10.0
    print(f"worker kill: chief exit -> job end: {ended:.2f}s")


def test_reserved_slots_the_coordinator_waits_and_stuck_detection_names_the_missing_workers(
    tmp_path,
):
    job = write_job(
        tmp_path,
        worker={"replicas": 2, "reserve_slots": True},  # TF_CONFIG lists 4 workers
        stuck_timeout_seconds=15,
        stuck_action="fail",
    )
    proc = submit(job, tmp_path)
    out, summary = finish(proc, tmp_path)
    assert proc.returncode != 0
    assert summary["status"] == "failed"
    assert summary["reason"].startswith("possibly stuck: no step report and every node near idle")
    assert "worker-2, worker-3 are listed in TF_CONFIG but not running" in summary["reason"]
    stuck = [e for e in summary["events"] if e["kind"] == "stuck"]
    assert len(stuck) == 1
    names = [n["name"] for n in stuck[0]["details"]["nodes"]]
    assert names == ["ps-0", "chief-0", "worker-0", "worker-1"]
    assert "ps-0 running, cpu " in stuck[0]["message"]
    assert "last log line: 'worker 1 serving'" in stuck[0]["message"]
    # Judged after the quiet spell, not from the start (TF's start-up takes its own time).
    quiet = stuck[0]["details"]["quiet_seconds"]
    assert 15 <= quiet < 30, quiet


def test_a_ps_sigkilled_half_way_fails_the_chief_which_is_relaunched_naming_the_cause(tmp_path):
    # The program has no recovery of its own: its coordinator fails on the lost PS. The master
    # relaunches the PS at its address and the chief, which trains again from scratch (it
    # writes no checkpoint) with the workers still serving; never a hang.
    proc = submit(write_job(tmp_path, epochs=6, steps=150), tmp_path)
    try:
        run_dir = proc.stdout.readline().split("run dir ")[1].strip()
        _wait_for_line(os.path.join(run_dir, "logs", "chief-0.*.log"), r"^Epoch 3/6")
        os.killpg(_pgid_of(run_dir, "ps", 0), signal.SIGKILL)
        out, summary = finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert summary["status"] == "succeeded"
    chiefs = [n for n in summary["nodes"] if n["type"] == "chief"]
    assert [n["status"] for n in chiefs] == ["failed", "succeeded"]
    assert chiefs[0]["exit_reason"] == "comm_error"
    failed = [e for e in summary["events"] if e["kind"] == "node_failed"]
    chief_failed = [e for e in failed if e["node_type"] == "chief"]
    assert "after ps-0 was lost" in chief_failed[0]["message"]
    assert chief_failed[0]["details"]["cause"].startswith("after ps-0 was lost")
    ps = [n for n in summary["nodes"] if n["type"] == "ps"]
    assert [n["exit_reason"] for n in ps] == ["killed", "stopped"]
    launched = {
        e["message"].split(" launched at ")[1]
        for e in summary["events"]
        if e["kind"] == "node_running" and e["node_type"] == "ps"
    }
    assert len(launched) == 1  # the relaunched PS serves at the same address
