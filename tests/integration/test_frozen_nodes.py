"""Frozen, briefly paused and cut-off nodes on the local platform (issue 37): a real master
(JobMaster, its aio gRPC server, the local platform) and real trainer processes
(fake_trainer.py), with a short heartbeat timeout.

- frozen (its process group SIGSTOPped): found within the timeout + 1 s, killed (SIGKILL ends
  a stopped process), relaunched, its shards re-queued;
- paused for half the timeout (SIGSTOP, SIGCONT): never killed;
- cut off (its traffic to the master goes through a loopback proxy the test cuts, while it
  keeps training): found within the timeout + 1 s and relaunched. The kill cannot reach it, as
  on a partitioned host; when its traffic comes back its stale incarnation is refused, and
  nothing it trained after the cut is counted.

Detection is timed from the signal or the cut to the `heartbeat_lost` event (both wall clock);
every other wait has a generous deadline."""

from __future__ import annotations

import dataclasses
import glob
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest

from master.cli.submit import write_token
from master.client.env import ENV_MASTER_ADDR
from master.config import parse_job_spec
from master.job.events import JobEvent
from master.job.master import JobMaster, JobRuntime
from master.job.model import JobState
from master.nodes.model import Node
from master.nodes.policy import heartbeat_interval
from master.platform.api import NodeLaunchSpec
from master.platform.local import LocalPlatform
from master.rpc.aio_server import start_aio_server
from master.state.sqlite import SQLiteStateStore
from tests.integration.conftest import TOKEN
from tests.integration.loopback_proxy import LoopbackProxy

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "fake_trainer.py")
WAIT_S = 90.0  # generous: two busy cores; nothing but detection is timed
SIZE, EPOCHS, BATCH = 4000, 2, 16
T = TypeVar("T")


class CutOffPlatform(LocalPlatform):
    """The local platform, with the first incarnation of one rank talking to the master through
    a proxy. Once `cut()`, that node is as on a partitioned host: its calls fail, and a signal
    to it does not arrive (so the master takes it for gone, as a platform does with a host it
    cannot reach)."""

    def __init__(self, node_type: str, rank: int) -> None:
        super().__init__()
        self._key = (node_type, rank)
        self.proxy: LoopbackProxy | None = None
        self.behind: int | None = None  # the node id behind the proxy
        self.unreachable = False
        self.undelivered: list[int] = []  # signals that could not reach it

    def launch(self, spec: NodeLaunchSpec) -> None:
        if self.proxy is not None and self.behind is None and (spec.type, spec.rank) == self._key:
            self.behind = spec.id
            spec = dataclasses.replace(spec, env={**spec.env, ENV_MASTER_ADDR: self.proxy.addr})
        super().launch(spec)

    def cut(self) -> None:
        self.unreachable = True
        assert self.proxy is not None
        self.proxy.cut()

    def reconnect(self) -> None:
        assert self.proxy is not None
        self.proxy.restore()

    def signal_node(self, node_id: int, sig: int = signal.SIGKILL) -> bool:
        if self.unreachable and node_id == self.behind:
            self.undelivered.append(sig)
            return False
        return super().signal_node(node_id, sig)


class LiveJob:
    """A job's master running in a thread of this test, with its gRPC server on loopback."""

    def __init__(
        self,
        tmp_path,
        platform: LocalPlatform,
        timeout_s: float,
        env: dict,
        epochs: int = EPOCHS,
        size: int = SIZE,
    ) -> None:
        self.size = size
        self.ids_dir = tmp_path / "ids"
        self.ids_dir.mkdir()
        run_dir = tmp_path / "run"
        (run_dir / "logs").mkdir(parents=True)
        spec = parse_job_spec(
            {
                "name": "frozen",
                "command": [sys.executable, TRAINER],
                "env": {
                    "FAKE_IDS_DIR": str(self.ids_dir),
                    "FAKE_SIZE": str(size),
                    "FAKE_EPOCHS": str(epochs),
                    "FAKE_BATCH": str(BATCH),
                }
                | env,
                "worker": {"replicas": 2, "max_relaunches": 2},
                "heartbeat_timeout_seconds": timeout_s,
            },
            source="test",
            base_dir=str(tmp_path),
        )
        self.platform = platform
        self.store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
        token_file = write_token(str(run_dir / ".job_token"), TOKEN)
        self.runtime = JobRuntime(str(run_dir), "", token_file)
        self.job = JobMaster(spec, platform, self.store, self.runtime)
        interval_ms = int(heartbeat_interval(2.0, timeout_s) * 1000)
        self.server, port = start_aio_server(self.job, "127.0.0.1", 0, TOKEN, 32, interval_ms)
        self.runtime.master_addr = f"127.0.0.1:{port}"
        if isinstance(platform, CutOffPlatform):
            platform.proxy = LoopbackProxy(self.runtime.master_addr)
        self.state: JobState | None = None
        self._thread = threading.Thread(target=self._run, name="job", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.state = self.job.run()

    def wait(self, probe: Callable[[], T | None], what: str) -> T:
        """The first truthy value of `probe`, within WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while True:
            value = probe()
            if value:
                return value
            if self.job.state.ended and self.state is not None:
                raise AssertionError(f"the job ended ({self.state}) before {what}")
            assert time.monotonic() < deadline, f"no {what} within {WAIT_S:g}s"
            time.sleep(0.02)

    def stepping(self, node_type: str, rank: int, after: Node | None = None) -> Node | None:
        """The current incarnation of (type, rank) once it has reported a step (one newer
        than `after`, if given)."""
        node = self.job.nodes.current(node_type, rank)
        if node is None or node.steps == 0 or (after is not None and node.id == after.id):
            return None
        return node

    def event(self, kind: str, node_id: int) -> JobEvent | None:
        return next((e for e in self.job.events if e.kind == kind and e.node_id == node_id), None)

    def finish(self) -> JobState:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), f"the job did not end within {WAIT_S:g}s"
        assert self.state is not None
        return self.state

    def close(self) -> None:
        if self._thread.is_alive():
            self.job.request_stop("test over")
            self._thread.join(WAIT_S)
        self.server.stop(grace=0).wait()
        if isinstance(self.platform, CutOffPlatform) and self.platform.proxy is not None:
            self.platform.proxy.close()
        self.job.sharding.close()
        self.store.close()

    def trained(self, skip: str = "") -> np.ndarray:
        """How often each record was trained, by every trainer process but the one whose ids
        are in file `skip`."""
        files = [f for f in glob.glob(str(self.ids_dir / "*.ids")) if f != skip]
        return np.bincount(np.concatenate([ids_in(f) for f in files]), minlength=self.size)


@pytest.fixture
def live_jobs():
    jobs: list[LiveJob] = []
    yield jobs
    for job in jobs:
        job.close()


def group_of(job: LiveJob, node: Node) -> int:
    """The node's process group (the local platform starts each node in its own)."""
    return job.platform.handle(node.id)["pid"]


def ids_in(path: str, offset: int = 0) -> np.ndarray:
    """The record ids a fake trainer wrote to `path` (from byte `offset` on)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(), dtype=np.int64)


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_frozen_node_is_found_within_the_timeout_killed_and_relaunched(tmp_path, live_jobs):
    timeout = 3.0
    job = LiveJob(tmp_path, LocalPlatform(), timeout, {"FAKE_STEP_SECONDS": "0.02"})
    live_jobs.append(job)
    victim = job.wait(lambda: job.stepping("worker", 1), "step of worker-1")
    pgid = group_of(job, victim)
    frozen_at = time.time()
    os.killpg(pgid, signal.SIGSTOP)  # every process of the node: a frozen host or container
    lost = job.wait(lambda: job.event("heartbeat_lost", victim.id), "lost heartbeat")
    detected = lost.time - frozen_at
    print(f"frozen worker-1 found {detected:.2f}s after SIGSTOP (timeout {timeout:g}s)")
    assert detected <= timeout + 1.0
    again = job.wait(lambda: job.stepping("worker", 1, after=victim), "step of worker-1 again")
    launched = job.event("node_running", again.id)
    print(f"relaunched {launched.time - lost.time:.2f}s after it was found")
    assert job.finish() == JobState.SUCCEEDED
    assert not group_alive(pgid)  # SIGKILL ended the stopped processes, the platform reaped them
    failed = job.event("node_failed", victim.id)
    assert failed is not None and failed.reason == "heartbeat_lost"
    (stats,) = job.job.sharding.stats()
    assert stats.records_done == SIZE * EPOCHS
    counts = job.trained()
    # Its shards went back to the queue; its position was read back at its end, so at most
    # the batch in flight is trained twice.
    assert counts.min() == EPOCHS and int((counts - EPOCHS).sum()) <= BATCH


def test_a_node_paused_for_half_the_timeout_is_never_killed(tmp_path, live_jobs):
    timeout = 6.0
    job = LiveJob(tmp_path, LocalPlatform(), timeout, {"FAKE_STEP_SECONDS": "0.04"})
    live_jobs.append(job)
    node = job.wait(lambda: job.stepping("worker", 1), "step of worker-1")
    pgid = group_of(job, node)
    os.killpg(pgid, signal.SIGSTOP)  # a GC pause, a swap storm
    paused_at = time.monotonic()
    time.sleep(timeout / 2)
    os.killpg(pgid, signal.SIGCONT)
    # The master must have had the time to misjudge it: a full timeout after the pause began.
    job.wait(lambda: time.monotonic() > paused_at + timeout + 1.0, "the master's chance")
    assert job.finish() == JobState.SUCCEEDED
    assert [e.message for e in job.job.events if e.kind in ("heartbeat_lost", "hang")] == []
    incarnations = [n for n in job.job.nodes.history() if (n.type, n.rank) == ("worker", 1)]
    assert [n.id for n in incarnations] == [node.id]
    counts = job.trained()
    assert counts.min() == EPOCHS and counts.max() == EPOCHS


def test_a_cut_off_node_is_relaunched_then_fenced_when_it_comes_back(tmp_path, live_jobs):
    timeout = 3.0
    platform = CutOffPlatform("worker", 1)
    # One epoch: a record the cut-off node trained after the cut is in no other epoch.
    # Long enough to outlast the detection and the relaunch's start.
    size = 3 * SIZE
    shard = 40 * BATCH  # records per shard: the cut comes in the middle of one
    env = {"FAKE_STEP_SECONDS": "0.02", "FAKE_RECORDS_PER_SHARD": str(shard)}
    job = LiveJob(tmp_path, platform, timeout, env, 1, size)
    live_jobs.append(job)
    victim = job.wait(lambda: job.stepping("worker", 1), "step of worker-1")
    assert platform.behind == victim.id
    pgid = group_of(job, victim)
    (ids_file,) = glob.glob(str(job.ids_dir / "worker.1.*.ids"))
    # Cut while it holds at least 10 batches of its shard still to train on its own.
    job.wait(
        lambda: 5 * BATCH <= (os.path.getsize(ids_file) // 8) % shard <= 30 * BATCH,
        "worker-1 in the middle of a shard",
    )
    cut_at = time.time()
    platform.cut()
    # Written from here on, a batch's report can only go out after the cut: never counted.
    at_cut = os.path.getsize(ids_file)
    lost = job.wait(lambda: job.event("heartbeat_lost", victim.id), "lost heartbeat")
    detected = lost.time - cut_at
    print(f"cut-off worker-1 found {detected:.2f}s after the cut (timeout {timeout:g}s)")
    assert detected <= timeout + 1.0
    assert platform.undelivered == [signal.SIGKILL]
    again = job.wait(lambda: job.stepping("worker", 1, after=victim), "step of worker-1 again")
    launched = job.event("node_running", again.id)
    print(f"relaunched {launched.time - lost.time:.2f}s after it was found")
    assert group_alive(pgid)  # cut off, not dead: it kept running all along
    after_cut = ids_in(ids_file, at_cut - at_cut % 8)
    platform.reconnect()
    # Back: its stale incarnation's calls are refused, and it ends.
    job.wait(lambda: "is an old incarnation" in read(victim.log_path), "its refusal")
    job.wait(lambda: not group_alive(pgid), "its end")
    assert job.finish() == JobState.SUCCEEDED
    (stats,) = job.job.sharding.stats()
    assert stats.records_done == size
    assert job.trained().min() >= 1  # nothing lost
    # What it trained after the cut was not counted: the others trained all of it again, and
    # the master never gave a record it counted to two of them.
    others = job.trained(skip=ids_file)
    print(f"the cut-off node trained {after_cut.size} records after the cut")
    assert after_cut.size > 0 and (others[after_cut] == 1).all()
    assert others.max() <= 1
