"""Checkpoint service socket folders: a folder whose owner died (even SIGKILLed) is swept; a
live owner's folder, or one not yet owned, is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from dlrover_torch.checkpoint import client
from dlrover_torch.checkpoint.env import SERVICE_ENV
from dlrover_torch.checkpoint.socket_dir import LOCK_NAME, SOCKET_NAME, sweep_orphans

OWNER = textwrap.dedent(
    """
    import sys, time
    from dlrover_torch.checkpoint.socket_dir import hold_owner_lock
    lock = hold_owner_lock(sys.argv[1])
    print("owned", flush=True)
    time.sleep(600)
    """
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code, *args):
    """A child Python process running `code`, its stdout readable as text."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


def _owned_folder(root, name):
    """A folder with a socket file, owned by a child process; returns (folder, process)."""
    folder = root / f"dlrover-ckpt-{name}"
    folder.mkdir()
    (folder / SOCKET_NAME).touch()
    proc = _python(OWNER, str(folder / SOCKET_NAME))
    assert proc.stdout.readline().strip() == "owned"
    return folder, proc


def test_only_the_folders_whose_owner_died_are_swept(tmp_path):
    dead, killed = _owned_folder(tmp_path, "dead")
    live, alive = _owned_folder(tmp_path, "live")
    unowned = tmp_path / "dlrover-ckpt-new"  # made, its service not started yet
    unowned.mkdir()
    other = tmp_path / "dlrover-ckpt-bench-x"  # not a service folder
    other.mkdir()
    (other / "data").touch()
    try:
        assert sweep_orphans(str(tmp_path)) == 0
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert sweep_orphans(str(tmp_path)) == 1
        assert not dead.exists()
        assert (live / LOCK_NAME).exists() and unowned.exists() and other.exists()
    finally:
        alive.kill()
        alive.wait()
    assert sweep_orphans(str(tmp_path)) == 1 and not live.exists()
    assert unowned.exists() and other.exists()


AGENT = textwrap.dedent(
    """
    import time
    from dlrover_torch.checkpoint.env import SERVICE_ENV
    from dlrover_torch.checkpoint.keeper import AgentCheckpointKeeper
    keeper = AgentCheckpointKeeper("sweep-test")
    print(keeper.start()[SERVICE_ENV], flush=True)
    time.sleep(600)
    """
)


def test_a_sigkilled_agents_folder_goes_when_the_next_keeper_starts(tmp_path):
    from dlrover_torch.checkpoint.keeper import AgentCheckpointKeeper

    agent = _python(AGENT)
    folder = os.path.dirname(agent.stdout.readline().strip())
    assert os.path.exists(os.path.join(folder, SOCKET_NAME))
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    assert os.path.isdir(folder)  # a killed agent cannot clean up
    keeper = AgentCheckpointKeeper("sweep-test-next", shm_dir=str(tmp_path))
    try:
        assert not os.path.exists(folder)
        socket_path = keeper.start()[SERVICE_ENV]
    finally:
        keeper.close()
    assert not os.path.exists(os.path.dirname(socket_path))  # closed: its own folder goes


def test_a_standalone_service_whose_starter_died_before_it_looked_exits_and_leaves_no_folder(
    tmp_path,
):
    """The training process that starts a service may be killed before the service has asked
    for its parent (CI: the folder stayed the service's 60 s of waiting for a first client)."""
    starter = _python("pass")
    starter.wait()
    service = subprocess.Popen(
        [sys.executable, "-m", "dlrover_torch.checkpoint.service"]
        + ["--namespace", f"test-{os.getpid()}", "--parent-pid", str(starter.pid)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    word, _, path = service.stdout.readline().strip().partition(" ")
    assert word == "ready" and os.path.dirname(path).startswith(str(tmp_path / "dlrover-ckpt-"))
    assert service.wait(timeout=20) == 0  # not the 60 s of a service nobody connects to
    assert list(tmp_path.iterdir()) == []  # the folder it made went with it


def test_a_training_process_killed_before_its_service_started_leaves_no_folder(
    tmp_path, monkeypatch
):
    """The service makes its socket folder itself (CI: a training process SIGKILLed between
    making the folder and starting the service left an empty folder no sweep recognises)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("the training process dies here")

    monkeypatch.setattr(client.subprocess, "Popen", killed)
    with pytest.raises(KeyboardInterrupt):
        client.ServiceClient.spawn(f"test-{os.getpid()}", str(tmp_path), 0.0)
    assert list(tmp_path.iterdir()) == []
