"""The pod guard (a Kubernetes node's first process): it runs the node's command, passes the
kubelet's signals on, and hands a dead trainer's unreported steps to the master."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from master.client.env import ENV_POSITION_FILE
from master.platform.pod_guard import guarded_command
from tests.integration.conftest import TOKEN
from tests.integration.test_local_job import (
    _wait_for_node_process,
    run_events,
    submit,
    trained_counts,
    write_job,
)

GUARD = guarded_command([], python=sys.executable)[:-1]  # [python, -m, pod_guard]
HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_TRAINER = os.path.join(HERE, "fake_trainer.py")

# A trainer as ShardedDataset drives it, coalescing (its reports would go out once an hour):
# the first step goes out at once, the six after it only into the guard's position file;
# then it dies without a word.
KILLED_TRAINER = """
import os, signal
from master.client import MasterClient, ProgressStream
from master.client.env import read_position_base
client = MasterClient.from_env()
stream = ProgressStream(client, position_file=read_position_base(os.environ), flush_seconds=3600)
assert stream.coalescing, "the guard named no position file"
shard = client.get_shard("d").shard
for step in range(1, 8):
    stream.send("d", [(shard.shard_id, 10 * step)], global_step=step)
os.kill(os.getpid(), signal.SIGKILL)
"""


def node_env(harness, i: int = 0) -> dict[str, str]:
    node = harness.nodes[i]
    env = {k: v for k, v in os.environ.items() if k != ENV_POSITION_FILE}
    return env | {
        "DLROVER_MASTER_ADDR": harness.addr,
        "DLROVER_JOB_TOKEN": TOKEN,
        "DLROVER_NODE_TYPE": node.type,
        "DLROVER_NODE_RANK": str(node.rank),
        "DLROVER_NODE_ID": str(node.id),
    }


def run_guarded(command: list[str], env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*GUARD, "--", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(os.path.dirname(HERE)),
    )


def test_a_killed_trainers_unreported_steps_reach_the_master_before_the_guard_ends(harness):
    from master.pb import data_pb2

    harness.client(0).create_dataset(
        data_pb2.DatasetSpec(name="d", size=1000, batch_size=10, epochs=1, records_per_shard=100)
    )
    proc = run_guarded([sys.executable, "-c", KILLED_TRAINER], env=node_env(harness))
    # It ends as its command did (killed), and only once the master holds all seven steps:
    # one reached it on the stream, six through the guard.
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    stats = harness.job.sharding.stats()[0]
    assert stats.records_done == 70
    assert proc.stderr == ""  # nothing of the guard's in the node's log


def test_the_guard_ends_as_its_command_did_and_passes_signals_on(tmp_path):
    assert run_guarded([sys.executable, "-c", "raise SystemExit(3)"]).returncode == 3
    missing = run_guarded(["/nonexistent/train"])
    assert missing.returncode == 127 and "cannot run '/nonexistent/train'" in missing.stderr
    usage = subprocess.run([*GUARD, "python"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "usage: python -m master.platform.pod_guard" in usage.stderr

    # A kubelet's SIGTERM goes to the container's first process only: the command gets it.
    ready, got = tmp_path / "ready", tmp_path / "got"
    trainer = (
        "import os, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (open({str(got)!r}, 'w').close(), "
        "sys.exit(0)))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(60)\n"
    )
    guard = subprocess.Popen([*GUARD, "--", sys.executable, "-c", trainer])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.02)
        guard.send_signal(signal.SIGTERM)
        assert guard.wait(timeout=30) == 0
        assert got.exists()
    finally:
        guard.kill()


def test_a_job_whose_trainer_is_sigkilled_under_the_guard_redoes_at_most_one_batch(tmp_path):
    """Each worker runs as in a pod: the guard's position file, not the local platform's, holds
    the steps its coalesced reports have not carried; the trainer alone is SIGKILLed."""
    command = ["python", "-m", "master.platform.pod_guard", "--", sys.executable, FAKE_TRAINER]
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.02"}, command=command)
    killed = []

    def kill_worker_1_trainer() -> None:
        pid = _wait_for_node_process(tmp_path, "worker.1")
        ids = next((tmp_path / "ids").glob(f"worker.1.{pid}.ids"))
        deadline = time.monotonic() + 60
        while ids.stat().st_size < 40 * 16 * 8 and time.monotonic() < deadline:
            time.sleep(0.01)  # 40 batches of 16 int64 ids trained
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_worker_1_trainer, daemon=True)
    killer.start()
    proc, summary = submit(job, tmp_path)
    killer.join(timeout=10)
    assert killed, "worker-1's trainer was not killed"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["status"] == "succeeded"
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert [n["exit_reason"] for n in w1] == ["killed", "succeeded"]
    counts = trained_counts(tmp_path)
    # Every record exactly `epochs` times, except at most one batch (16) for the one kill.
    assert counts.min() == 2
    assert int((counts - 2).sum()) <= 16
    failed = next(e for e in run_events(summary) if e["kind"] == "node_failed")
    assert failed["details"]["diagnosis"] == "killed by SIGKILL"
