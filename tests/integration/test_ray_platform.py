"""The Ray platform on a real local Ray cluster (loopback, 2 CPUs) with real processes."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import time

import psutil
import pytest

from master.cli.exit_codes import EXIT_STOPPED
from master.client.position import decode_positions
from master.platform.api import POSITIONS_DETAIL, NodeEvent, NodeLaunchSpec
from master.platform.ray.connect import AUTH_MODE_ENV, LOOPBACK_ENV, start_local_cluster
from master.platform.ray.platform import RayPlatform
from tests.integration.test_local_job import (
    DLROVER,
    HERE,
    _wait_for_node_process,
    submit,
    trained_counts,
    write_job,
)
from tests.integration.test_ps_standby import standby_story

# Not importorskip: ray must not be imported before the cluster fixture asks for loopback.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")

MARKER = "DLROVER_RAY_TEST_MARKER"
READY = "print('node', 'ready', flush=True);"  # the log's header shows the command
SLEEPER = READY + "import time; time.sleep(120)"
# Starts a grandchild in the same process group, then sleeps: killing the actor must take both.
FORKER = (
    "import subprocess, sys, time;"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
    + READY
    + "time.sleep(120)"
)
IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);" + SLEEPER


@pytest.fixture(scope="module")
def ray_address():
    saved = {k: os.environ.get(k) for k in (AUTH_MODE_ENV, LOOPBACK_ENV)}
    address = start_local_cluster(num_cpus=2)
    yield address
    import ray

    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def platform(ray_address):
    p = RayPlatform(host="127.0.0.1")
    yield p
    p.shutdown(1.0)


class Launcher:
    """Builds launch specs whose processes carry a marker this test can find them by."""

    def __init__(self, platform: RayPlatform, tmp_path) -> None:
        self.platform = platform
        self.tmp_path = tmp_path
        self.marker = str(tmp_path)
        self.next_id = 1

    def launch(self, code: str, rank: int = 0, node_type: str = "worker") -> NodeLaunchSpec:
        node_id, self.next_id = self.next_id, self.next_id + 1
        spec = NodeLaunchSpec(
            type=node_type,
            rank=rank,
            id=node_id,
            command=(sys.executable, "-c", code),
            env=dict(os.environ, **{MARKER: self.marker}),
            workdir=str(self.tmp_path),
            log_path=str(self.tmp_path / "logs" / f"{node_type}-{rank}.{node_id}.log"),
        )
        self.platform.launch(spec)
        return spec

    def processes(self) -> list[psutil.Process]:
        return marked_processes(self.marker)

    def wait_ready(self, *specs: NodeLaunchSpec, timeout: float = 60.0) -> None:
        """Until every node has printed that it is ready (its signal handlers are set)."""
        deadline = time.monotonic() + timeout
        for spec in specs:
            while "node ready" not in _read(spec.log_path):
                assert time.monotonic() < deadline, f"{spec.id} not ready: {_read(spec.log_path)}"
                time.sleep(0.05)

    def wait_gone(self, timeout: float = 15.0) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.processes()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def marked_processes(marker: str, var: str = MARKER) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(var) == marker and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def next_event(platform: RayPlatform, timeout: float = 60.0) -> NodeEvent:
    try:
        return platform.events.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no node event within {timeout}s") from None


def test_exit_codes_log_tail_and_a_command_that_cannot_start(platform, tmp_path):
    nodes = Launcher(platform, tmp_path)
    spec = nodes.launch("import sys; print('boom from the node'); sys.exit(3)")
    event = next_event(platform)
    assert (event.type, event.rank, event.id, event.exit_code) == ("worker", 0, spec.id, 3)
    assert "boom from the node" in event.message
    log = open(spec.log_path).read()
    assert log.startswith(f"# worker-0 id={spec.id} on Ray node 127.0.0.1")
    assert "boom from the node" in log

    ok = nodes.launch("print('fine')", rank=1)
    event = next_event(platform)
    assert (event.id, event.exit_code, event.message) == (ok.id, 0, "")

    bad_log = str(tmp_path / "logs" / "bad.log")
    bad = NodeLaunchSpec("worker", 2, 99, ("/no/such/binary",), {}, str(tmp_path), bad_log)
    platform.launch(bad)
    event = next_event(platform)
    assert event.id == 99 and event.exit_code == 127
    assert "cannot run '/no/such/binary'" in event.message
    assert platform.running_ids() == []


def test_node_env_is_the_ray_nodes_env_plus_the_jobs(platform, tmp_path):
    # Like a pod, a node does not inherit the master's env: it gets its Ray node's (what Ray
    # gives its workers there, minus Ray's own RAY_* plumbing) and the job's on top.
    show = "import json, os; print('ENV=' + json.dumps(dict(os.environ)))"
    spec = NodeLaunchSpec(
        "worker",
        0,
        7,
        (sys.executable, "-c", show),
        {"JOB_VAR": "from-job", "HOME": "/job/home"},
        str(tmp_path),
        str(tmp_path / "logs" / "env.log"),
    )
    platform.launch(spec)
    assert next_event(platform).exit_code == 0
    line = next(ln for ln in _read(spec.log_path).splitlines() if ln.startswith("ENV="))
    env = json.loads(line[len("ENV=") :])
    assert env["JOB_VAR"] == "from-job" and env["HOME"] == "/job/home"
    assert env["PATH"] == os.environ["PATH"]  # from the Ray node (here: this machine)
    assert not [k for k in env if k.startswith("RAY_")]
    assert "OMP_NUM_THREADS" not in env or "OMP_NUM_THREADS" in os.environ


def test_a_killed_trainers_last_position_is_read_back_on_its_ray_node(platform, tmp_path):
    # As a coalescing progress stream does: every step's position in the file the platform
    # names, then a death between two reports to the master.
    write = (
        "import os, time;"
        "from master.client.position import PositionFile, stream_position_path;"
        "f = PositionFile(stream_position_path(os.environ['DLROVER_POSITION_FILE']));"
        "f.write({'train': {3: 64, 4: 128}}); print('written', flush=True); time.sleep(120)"
    )
    spec = NodeLaunchSpec(
        "worker",
        0,
        8,
        (sys.executable, "-c", write),
        {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__)))},
        str(tmp_path),
        str(tmp_path / "logs" / "pos.log"),
    )
    platform.launch(spec)
    deadline = time.monotonic() + 60
    while "written" not in _read(spec.log_path).splitlines():  # a line (the header quotes it)
        assert time.monotonic() < deadline, _read(spec.log_path)
        time.sleep(0.05)
    assert platform.read_positions(spec.id) == {"train": [(3, 64), (4, 128)]}
    assert platform.signal_node(spec.id, signal.SIGKILL)
    event = next_event(platform)
    assert event.exit_code == -signal.SIGKILL
    assert decode_positions(event.details[POSITIONS_DETAIL]) == {"train": [(3, 64), (4, 128)]}
    assert platform.read_positions(spec.id) == {}  # ended: nothing more to read


def test_cpu_of_a_busy_and_an_idle_node_is_measured_on_their_ray_node(platform, tmp_path):
    nodes = Launcher(platform, tmp_path)
    busy = nodes.launch(READY + "import itertools; any(False for _ in itertools.count())", rank=0)
    idle = nodes.launch(SLEEPER, rank=1)
    nodes.wait_ready(busy, idle)
    first, deadline = {}, time.monotonic() + 30
    while set(first) != {busy.id, idle.id}:  # the first call only asks
        assert time.monotonic() < deadline, first
        first = platform.cpu_seconds([busy.id, idle.id])
        time.sleep(0.1)
    started = time.monotonic()
    later = first
    while later[busy.id] - first[busy.id] < 0.5:  # half a core-second spent spinning
        assert time.monotonic() - started < 30, later
        time.sleep(0.2)
        later = {**later, **platform.cpu_seconds([busy.id, idle.id])}
    assert later[idle.id] - first[idle.id] < 0.2
    platform.signal_node(busy.id, signal.SIGKILL)
    assert next_event(platform).id == busy.id
    deadline = time.monotonic() + 10
    while busy.id in platform.cpu_seconds([busy.id, idle.id]):  # an ended node is left out
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_signal_node_sigkill_gives_exit_minus_9(platform, tmp_path):
    nodes = Launcher(platform, tmp_path)
    spec = nodes.launch(SLEEPER)
    nodes.wait_ready(spec)
    assert platform.signal_node(spec.id, signal.SIGKILL)
    event = next_event(platform)
    assert (event.id, event.exit_code) == (spec.id, -signal.SIGKILL)
    assert not platform.signal_node(spec.id, signal.SIGKILL)  # no longer running
    assert nodes.wait_gone() == []


def test_a_signal_whose_node_ended_meanwhile_still_counts_as_delivered(platform, tmp_path):
    """A SIGKILL ends the node; the watcher, seeing the end before the signal's reply, releases
    the actor, and the reply is lost with it (seen under load). The node was running and its
    end comes from the watcher, so the signal counts: a False would make the master report a
    second end of its own, without the node's last positions."""
    import ray

    nodes = Launcher(platform, tmp_path)
    spec = nodes.launch(SLEEPER)
    nodes.wait_ready(spec)
    run = platform._running[spec.id]
    ray.kill(run.actor, no_restart=True)  # as the watcher releases an ended node's actor
    ready, _ = ray.wait([run.ref], timeout=60)  # the actor is gone once its wait() fails
    assert ready
    assert platform._signal(run, signal.SIGKILL)
    event = next_event(platform)
    assert event.id == spec.id
    assert nodes.wait_gone() == []


def test_stop_node_sigterm_then_sigkill_after_grace(platform, tmp_path):
    nodes = Launcher(platform, tmp_path)
    polite = nodes.launch(SLEEPER, rank=0)
    stubborn = nodes.launch(IGNORES_TERM, rank=1)
    nodes.wait_ready(polite, stubborn)
    started = time.monotonic()
    platform.stop_node(polite.id, 5.0)
    platform.stop_node(stubborn.id, 1.0)
    codes = {}
    for _ in range(2):
        event = next_event(platform, timeout=30)
        codes[event.id] = (event.exit_code, time.monotonic() - started)
    assert codes[polite.id][0] == -signal.SIGTERM
    assert codes[stubborn.id][0] == -signal.SIGKILL
    assert codes[stubborn.id][1] >= 1.0  # only after the grace period
    assert nodes.wait_gone() == []


def test_killed_actor_is_reported_and_takes_its_process_group(platform, tmp_path):
    import ray

    nodes = Launcher(platform, tmp_path)
    spec = nodes.launch(FORKER)
    nodes.wait_ready(spec)
    assert len(nodes.processes()) == 4  # guard, sentinel, node, and the node's child
    ray.kill(platform._running[spec.id].actor)
    event = next_event(platform)
    assert (event.id, event.exit_code) == (spec.id, -signal.SIGKILL)
    assert "Ray actor died" in event.message and "ray.kill" in event.message
    assert event.details["ray_error"] == "ActorDiedError"
    assert nodes.wait_gone() == []


def test_shutdown_stops_every_node_and_leaves_no_process(platform, tmp_path):
    nodes = Launcher(platform, tmp_path)
    specs = [nodes.launch(SLEEPER, rank=0), nodes.launch(IGNORES_TERM, rank=1)]
    specs.append(nodes.launch(FORKER, rank=2))
    nodes.wait_ready(*specs)
    platform.shutdown(1.0)
    events = {}
    while not platform.events.empty():
        event = platform.events.get_nowait()
        events[event.id] = event.exit_code
    assert events == {
        specs[0].id: -signal.SIGTERM,
        specs[1].id: -signal.SIGKILL,
        specs[2].id: -signal.SIGTERM,
    }
    assert nodes.wait_gone(timeout=5) == []
    with pytest.raises(RuntimeError):
        nodes.launch(SLEEPER)


def test_a_request_no_ray_node_can_hold_fails_fast_with_the_reason(platform, tmp_path):
    spec = NodeLaunchSpec(
        "ps", 0, 5, (sys.executable, "-c", "pass"), {}, str(tmp_path), str(tmp_path / "ps.log"), 64
    )
    platform.launch(spec)
    event = next_event(platform, timeout=30)
    assert (event.id, event.exit_code) == (5, -signal.SIGKILL)
    assert "cannot run on Ray node 127.0.0.1" in event.message and "64 CPU" in event.message


def test_address_for_is_stable_and_distinct(platform):
    first = {(t, r): platform.address_for(t, r) for t in ("ps", "worker") for r in range(3)}
    again = {(t, r): platform.address_for(t, r) for t in ("ps", "worker") for r in range(3)}
    assert first == again
    assert len(set(first.values())) == len(first)
    assert all(a.startswith("127.0.0.1:") for a in first.values())


def test_fake_job_on_ray_survives_a_worker_kill(ray_address, tmp_path):
    # Progress reaches the master coalesced, once a second (the node actors read a dead
    # trainer's position back): the job outlasts that lag, so the kill finds worker 1 training.
    proc, summary = submit(
        write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.04"}),
        tmp_path,
        "--platform",
        "ray",
        "--ray-address",
        ray_address,
        "--kill",
        "worker:1@40%",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fault injection: SIGKILL to worker-1" in proc.stdout
    assert summary["status"] == "succeeded"
    d = summary["datasets"]["train"]
    assert d["records_done"] == d["size"] * d["epochs"] == 6000
    w1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    # The relaunch succeeds, or is stopped with the job when the others finished the data first.
    assert [n["exit_reason"] for n in w1] in (["killed", "succeeded"], ["killed", "stopped"])
    counts = trained_counts(tmp_path)
    assert counts.min() == 2
    assert int((counts - 2).sum()) <= 16  # at most the one batch in flight at the kill
    logs = sorted(os.listdir(os.path.join(summary["run_dir"], "logs")))
    assert len([f for f in logs if f.startswith("worker-1.")]) == 2, logs


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_no_orphans_when_a_ray_master_is_interrupted_or_killed(ray_address, tmp_path, how):
    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.05", "FAKE_SIZE": "100000"})
    p = subprocess.Popen(
        [*DLROVER, "submit", job, "--platform", "ray", "--ray-address", ray_address],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=os.path.dirname(HERE),
    )
    try:
        # Under `dlrover submit` the supervisor first starts the job anchor actor: allow time.
        _wait_for_node_process(tmp_path, "worker.0", timeout=90)
        _wait_for_node_process(tmp_path, "worker.1", timeout=90)
        # Per worker: the guard, its sentinel and the trainer.
        assert len(marked_processes(str(tmp_path / "ids"), "FAKE_IDS_DIR")) == 6
        # SIGINT: the master stops its nodes; SIGKILL: none of its cleanup code runs.
        p.send_signal(signal.SIGINT if how == "sigint" else signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
        if how == "sigint":
            assert p.returncode == EXIT_STOPPED and "interrupted by SIGINT" in out, out
    finally:
        if p.poll() is None:
            p.kill()
    deadline = time.monotonic() + 30
    while marked_processes(str(tmp_path / "ids"), "FAKE_IDS_DIR") and time.monotonic() < deadline:
        time.sleep(0.2)
    left = marked_processes(str(tmp_path / "ids"), "FAKE_IDS_DIR")
    assert left == [], [(p.pid, p.ppid(), p.cmdline()) for p in left]


def test_unreachable_ray_address_is_one_clear_error(tmp_path):
    proc = subprocess.run(
        [
            *DLROVER,
            "submit",
            write_job(tmp_path),
            "--platform",
            "ray",
            "--ray-address",
            "127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(HERE),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot connect to the Ray cluster at '127.0.0.1:1'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # a whole job with a master restart: ~17 s idle, more when loaded
def test_killed_ray_master_is_restarted_and_adopts_every_node_actor(ray_address, tmp_path):
    """`dlrover submit --platform ray --ray-address`: the master SIGKILLs itself mid-job, the
    supervisor restarts it, and the new master finds the node actors by name and watches them."""
    from tests.integration.test_master_restart import _submit_streaming, _summary

    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.01"})
    rc, out = _submit_streaming(
        job,
        tmp_path,
        "--platform",
        "ray",
        "--ray-address",
        ray_address,
        "--kill",
        "master:0@40%",
        timeout=240,
    )
    assert rc == 0, out
    assert "master died (killed by SIGKILL); restarting it (1/5)" in out
    summary = _summary(tmp_path)
    assert summary["status"] == "succeeded"
    nodes = [(n["type"], n["rank"], n["relaunches"], n["exit_reason"]) for n in summary["nodes"]]
    assert nodes == [("worker", 0, 0, "succeeded"), ("worker", 1, 0, "succeeded")]
    assert len(glob.glob(str(tmp_path / "ids" / "*.ids"))) == 2  # one process per worker
    restarted = [e for e in summary["events"] if e["kind"] == "master_restarted"]
    assert len(restarted) == 1 and "adopted 2 running nodes" in restarted[0]["message"]
    counts = trained_counts(tmp_path)
    assert counts.min() == 2 and counts.max() == 2  # nothing lost, nothing trained twice


@pytest.mark.slow  # a whole job with a master restart by Ray
def test_master_actor_killed_mid_job_is_restarted_by_ray(ray_address, tmp_path):
    """`submit --master-actor`: the master runs in a detached actor with max_restarts; the
    master SIGKILLs itself at 40%, its actor exits, Ray restarts it, and the new master
    resumes: the same node actors, none relaunched."""
    from tests.integration.test_master_restart import _submit_streaming, _summary

    job = write_job(tmp_path, env={"FAKE_STEP_SECONDS": "0.01"})
    rc, out = _submit_streaming(
        job,
        tmp_path,
        "--platform",
        "ray",
        "--ray-address",
        ray_address,
        "--master-actor",
        "--kill",
        "master:0@40%",
        timeout=300,
    )
    log = (tmp_path / "run" / "master.log").read_text()
    assert rc == 0, out + log[-3000:]
    assert "restarted=True" in log  # the second master ran in Ray's restart of the actor
    summary = _summary(tmp_path)
    assert summary["status"] == "succeeded"
    nodes = [(n["type"], n["rank"], n["relaunches"], n["exit_reason"]) for n in summary["nodes"]]
    assert nodes == [("worker", 0, 0, "succeeded"), ("worker", 1, 0, "succeeded")]
    restarted = [e for e in summary["events"] if e["kind"] == "master_restarted"]
    assert len(restarted) == 1 and "adopted 2 running nodes" in restarted[0]["message"]
    counts = trained_counts(tmp_path)
    assert counts.min() == 2 and counts.max() == 2
    import ray

    # The job's detached actors are gone with it.
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not {"dlrover-job-anchor", "dlrover-master"} & names, names
    assert "master actor died; Ray restarts it" in out or "restarted=True" in log


@pytest.mark.slow  # a real TF PS and its standby
def test_a_killed_ps_is_replaced_by_a_standby_actor_at_its_address(ray_address, tmp_path):
    standby_story(tmp_path, "--platform", "ray", "--ray-address", ray_address)
