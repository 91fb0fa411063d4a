"""The standby PS on real processes: a TF-loaded spare is promoted when the PS is SIGKILLed,
serves at the PS's address, and a new standby follows; nothing is left when the job stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _events(run_dir) -> list[dict]:
    try:
        with open(run_dir / "events.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _wait_event(run_dir, match, timeout=120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in _events(run_dir):
            if match(e):
                return e
        time.sleep(0.05)
    raise AssertionError(f"no such event; events: {[e['message'] for e in _events(run_dir)]}")


def _process(run_dir, module: str) -> psutil.Process:
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd, env = p.info["cmdline"] or [], p.info["environ"] or {}
        except psutil.Error:
            continue
        # `python -m module` itself, not a guard whose command line ends with it
        if cmd[1:3] == ["-m", module] and env.get("DLROVER_RUN_DIR") == str(run_dir):
            return p
    raise AssertionError(f"no {module} process in {run_dir}")


def _serves(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


FROZEN_TIMEOUT = 3.0  # the job's heartbeat timeout when its PS is frozen


def test_killed_ps_is_replaced_by_the_standby_at_its_address(tmp_path):
    standby_story(tmp_path)


def test_a_frozen_ps_is_found_by_its_heartbeat_timeout_and_replaced_by_the_standby(tmp_path):
    standby_story(tmp_path, freeze=True)


def standby_story(tmp_path, *submit_args: str, freeze: bool = False) -> None:
    """A job with a built-in PS: its standby gets ready, the PS is SIGKILLed (or frozen with
    SIGSTOP: alive, silent), the standby serves at its address, a new standby follows, and
    nothing is left when the job stops."""
    ids = tmp_path / "ids"
    ids.mkdir()
    job = {
        "name": "standby",
        "command": ["python", os.path.join(HERE, "fake_trainer.py")],
        "env": {
            "FAKE_IDS_DIR": str(ids),
            "FAKE_SIZE": "200000",
            "FAKE_STEP_SECONDS": "0.05",
            "TF_CPP_MIN_LOG_LEVEL": "2",
        },
        "ps": {"replicas": 1},  # the built-in TF PS: a standby is kept for it
        "worker": {"replicas": 1},
    }
    if freeze:
        job["heartbeat_timeout_seconds"] = FROZEN_TIMEOUT
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
        + ["--run-dir", str(run_dir), "--summary-json", str(tmp_path / "s.json"), *submit_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        started = _wait_event(run_dir, lambda e: e["message"].startswith("ps-0 (id 1) launched"))
        address = started["message"].rsplit(" at ", 1)[1]
        ready = _wait_event(
            run_dir, lambda e: e["kind"] == "ps_standby" and e["reason"] == "ready", 180
        )
        standby_id = ready["details"]["id"]
        standby = _process(run_dir, "dlrover_tf.ps_standby")
        ps = _process(run_dir, "dlrover_tf.ps")
        assert _serves(address)

        if freeze:  # once the PS beats (it registers after it serves)
            ps_log = run_dir / "logs" / "ps-0.1.log"
            deadline = time.monotonic() + 60
            while "beats to the master" not in ps_log.read_text():
                assert time.monotonic() < deadline, ps_log.read_text()
                time.sleep(0.05)
        killed_at = time.time()
        os.kill(ps.pid, signal.SIGSTOP if freeze else signal.SIGKILL)
        promoted = _wait_event(run_dir, lambda e: "promoted from the standby" in e["message"])
        assert promoted["node_id"] == standby_id
        assert promoted["message"].endswith(f"at {address}")
        while not _serves(address):
            assert time.time() - killed_at < 30, "the promoted standby does not serve"
            time.sleep(0.01)
        serving_after = time.time() - killed_at
        # Same process: TensorFlow was already loaded (a fresh PS takes seconds to import it).
        assert standby.is_running()
        log = run_dir / "logs" / f"ps-standby.{standby_id}.log"
        deadline = time.monotonic() + 10
        while f"ps task 0 serving at {address}" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert serving_after < 10.0, serving_after
        failed = _wait_event(run_dir, lambda e: e["kind"] == "node_failed")
        assert failed["node_type"] == "ps"
        if freeze:
            assert failed["reason"] == "heartbeat_lost", failed
            assert failed["time"] - killed_at < FROZEN_TIMEOUT + 1.0, failed
            assert not ps.is_running() or ps.status() == psutil.STATUS_ZOMBIE
        else:
            assert failed["time"] - killed_at < 1.0
        # The next standby starts once training has resumed (here, without restore reports
        # from a chief, at the first step past the checkpoint the data went back to).
        _wait_event(
            run_dir,
            lambda e: (
                e["kind"] == "ps_standby"
                and e["reason"] == "started"
                and e["details"]["id"] != standby_id
            ),
            60,
        )
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    summary = json.loads((tmp_path / "s.json").read_text())
    ps_nodes = [n for n in summary["nodes"] if n["type"] == "ps"]
    assert [n["id"] for n in ps_nodes] == [1, standby_id]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [
            p
            for p in psutil.process_iter(["environ"])
            if (p.info["environ"] or {}).get("DLROVER_RUN_DIR") == str(run_dir)
        ]
        if not left:
            break
        time.sleep(0.1)
    assert not left, [p.cmdline() for p in left]
