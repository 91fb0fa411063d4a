"""No shared memory left behind: standalone scripts that exit or die; what an agent keeps."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from dlrover_torch.checkpoint import (
    SERVICE_ENV,
    AgentCheckpointKeeper,
    Checkpointer,
    lease,
    shm,
    storage,
)
from dlrover_torch.checkpoint.checkpointer import standalone_namespace
from dlrover_torch.checkpoint.env import ORPHAN_GRACE_ENV
from tests.integration.dlrover_run_helpers import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB64 = 16 * 1024 * 1024  # float32 elements

# Saves 64 MB twice (both slots) to memory, never calls close(); then exits or hangs.
SCRIPT = f"""
import sys, time, torch
from dlrover_torch.checkpoint import Checkpointer
state = {{"w": torch.arange({MIB64}, dtype=torch.float32)}}
ck = Checkpointer(sys.argv[1])
ck.save(1, state, storage="memory")
ck.save(2, state, storage="memory")
ck.prepare(state)  # the second slot's memory is reserved in the background: wait for it
print("saved", flush=True)
if sys.argv[2] == "raise":
    raise RuntimeError("the training loop broke")
sys.stdin.readline() if sys.argv[2] == "exit" else time.sleep(3600)
"""


def _leftovers(namespace: str) -> list[str]:
    """The namespace's segments and lease files."""
    folder = lease.lease_dir(shm.SHM_DIR)
    names = os.listdir(shm.SHM_DIR) + (os.listdir(folder) if os.path.isdir(folder) else [])
    return sorted(n for n in names if n.startswith(namespace))


@pytest.fixture
def ckdir(tmp_path):
    root = str(tmp_path / "ckpt")
    yield root
    for name in _leftovers(standalone_namespace(root)):
        shm.unlink_quietly(os.path.join(shm.SHM_DIR, name))
        shm.unlink_quietly(os.path.join(lease.lease_dir(shm.SHM_DIR), name))


def _start(ckdir: str, mode: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, ckdir, mode],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()
    if line != "saved":
        proc.kill()
        raise AssertionError(f"the script did not save: {proc.communicate(timeout=30)}")
    return proc


def _wait_reaped(namespace: str, ckdir: str, what: str) -> None:
    """Wait until the namespace's memory is gone; on a timeout say what is left and why."""
    try:
        wait_for(lambda: _leftovers(namespace) == [], 90, what)
    except AssertionError as err:
        listing = _shm_clean("ls")
        on_disk = sorted(os.listdir(ckdir)) if os.path.isdir(ckdir) else "no checkpoint dir"
        raise AssertionError(f"{err}; left: {_leftovers(namespace)}; {listing}; {on_disk}") from err


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def test_a_script_that_ends_without_close_leaves_nothing(ckdir):
    ns = standalone_namespace(ckdir)
    proc = _start(ckdir, "exit")
    try:
        names = _leftovers(ns)
        assert f"{ns}-r00000-s0" in names and f"{ns}-r00000-s1" in names, names
        assert os.path.getsize(os.path.join(shm.SHM_DIR, f"{ns}-r00000-s1")) > 64 << 20
    finally:
        out, err = proc.communicate("\n", timeout=120)
    assert proc.returncode == 0, err
    assert _leftovers(ns) == []


def test_a_sigkilled_script_leaves_nothing_once_its_grace_has_passed(ckdir):
    ns = standalone_namespace(ckdir)
    proc = _start(ckdir, "hang", {ORPHAN_GRACE_ENV: "1"})
    try:
        assert len(_leftovers(ns)) == 3  # two slots and the lease
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    _wait_reaped(ns, ckdir, "the killed script's service to reap its memory")


def _kill_with_its_service(ckdir: str) -> None:
    """A script that saved to memory only, SIGKILLed together with its persister."""
    proc = _start(ckdir, "hang")
    try:  # its persister starts off the training thread: wait for it
        pid = proc.pid
        wait_for(lambda: len(_children(pid)) == 1, 60, "the persister to start")
    finally:
        for pid in (*_children(proc.pid), proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def _shm_clean(*args: str) -> str:
    """`dlrover checkpoint ARGS` as a user runs it; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "master.cli", "checkpoint", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_script_dying_of_an_exception_keeps_its_memory_for_the_grace_then_saves_it(ckdir):
    ns = standalone_namespace(ckdir)
    proc = _start(ckdir, "raise", {ORPHAN_GRACE_ENV: "1"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "the training loop broke" in err, err
    assert "stays for a restart" in err, err
    # its service reaps it after the grace: the step held only in memory goes to disk first
    _wait_reaped(ns, ckdir, "the service to reap the memory")
    assert storage.read_tracker(ckdir) == 2


def test_killed_with_its_service_the_next_start_or_the_command_frees_it(tmp_path, ckdir):
    """Nothing left to reap: the segments stay for the grace, ``ls`` names them, and the next
    checkpointer that starts on the machine (or ``gc --now``) writes their step (held in memory
    only) to the checkpoint dir and frees them."""
    ns = standalone_namespace(ckdir)
    for n, remove_with in enumerate(("command", "next start")):
        shutil.rmtree(ckdir, ignore_errors=True)
        _kill_with_its_service(ckdir)
        ls = _shm_clean("ls")
        assert f"orphaned  {ns} rank 0  2 slot(s)" in ls and f"dir {ckdir}" in ls, ls
        assert "step 2 NOT on disk" in ls, ls
        assert len(_leftovers(ns)) == 3
        if remove_with == "command":
            gc = _shm_clean("gc", "--now")
            assert "freed" in gc and "step 2 on disk" in gc, gc
        else:
            os.environ[ORPHAN_GRACE_ENV] = "0"
            try:
                other = Checkpointer(str(tmp_path / f"other{n}"))
            finally:
                del os.environ[ORPHAN_GRACE_ENV]
            other._service_process()  # the sweep runs before the service starts
            other.close()
        assert _leftovers(ns) == []
        assert storage.read_tracker(ckdir) == 2  # rescued, not lost
        reader = Checkpointer(ckdir)
        try:
            restored = reader.load()
        finally:
            reader.close()
        assert restored is not None and restored[0] == 2
        assert restored[1]["w"].equal(torch.arange(MIB64, dtype=torch.float32))


def test_memory_holding_a_step_that_cannot_be_written_is_kept_and_reported(ckdir):
    ns = standalone_namespace(ckdir)
    _kill_with_its_service(ckdir)
    with open(storage.step_dir(ckdir, 2), "w") as fh:  # a file where the step's folder goes
        fh.write("in the way")
    gc = _shm_clean("gc", "--grace", "0")
    assert "freed 0 B (0 group(s)); 1 group(s) kept" in gc, gc
    assert len(_leftovers(ns)) == 3
    assert "step 2 NOT on disk" in _shm_clean("ls")
    gc = _shm_clean("gc", "--now")
    assert "freed" in gc and "(1 group(s))" in gc, gc
    assert _leftovers(ns) == []


def test_under_an_agent_a_killed_workers_memory_stays_until_the_agent_ends(tmp_path):
    keeper = AgentCheckpointKeeper(f"hygiene-{os.getpid()}")
    try:
        env = {**keeper.start(), ORPHAN_GRACE_ENV: "0"}
        proc = _start(str(tmp_path / "ckpt"), "hang", env)
        proc.send_signal(signal.SIGKILL)  # (the script waited for both slots before "saved")
        proc.communicate(timeout=30)
        assert env[SERVICE_ENV]
        subprocess.run(
            [sys.executable, "-m", "dlrover_torch.checkpoint.shm_clean", "gc", "--now"],
            cwd=REPO,
            check=True,
            capture_output=True,
            timeout=60,
        )
        # the agent holds them for the restart
        assert len(shm.slot_paths(keeper.namespace)) == 2
    finally:
        keeper.close()
    assert _leftovers(keeper.namespace) == []
