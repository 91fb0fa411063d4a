"""Flash checkpoint end to end: real processes, real shared memory, real files, real kills."""

from __future__ import annotations

import glob
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from dlrover_torch.checkpoint import (
    SERVICE_ENV,
    AgentCheckpointKeeper,
    CapacityError,
    Checkpointer,
    CheckpointError,
    shm,
    storage,
)
from dlrover_torch.checkpoint.checkpointer import standalone_namespace
from tests.integration.dlrover_run_helpers import wait_for
from tests.unit.ckpt_helpers import (
    assert_same,
    assert_usable_like_torch_load,
    mount_small_tmpfs,
    training_state,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = [sys.executable, "-m", "tests.integration.flash_ckpt_worker"]


@pytest.fixture
def ckdir(tmp_path):
    root = str(tmp_path / "ckpt")
    yield root
    for path in shm.slot_paths(standalone_namespace(root)):
        shm.unlink_quietly(path)


def spawn(args, env=None, **kw):
    return subprocess.Popen(
        WORKER + [str(a) for a in args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    return out, err


def save_and_get_killed(tmp_path, env=None):
    proc = spawn(["save-hang", tmp_path, 5], env)
    try:
        assert proc.stdout.readline().strip() == "saved", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_after_memory_save_restores_from_memory_bit_for_bit(tmp_path, ckdir):
    save_and_get_killed(tmp_path)
    assert storage.list_steps(ckdir) == []  # nothing on disk: the restore can only be memory
    out, err = finish(spawn(["load", tmp_path]))
    assert json.loads(out.splitlines()[-1]) == {"step": 5}
    assert "restored step 5 from shared memory" in err


def test_round_trip_through_memory_then_disk(ckdir):
    state = training_state(seed=1)
    ck = Checkpointer(ckdir, keep_latest=2)
    ck.prepare(state)
    ck.save(7, state, "disk")
    ck.wait()
    step, loaded = ck.load()
    assert step == 7
    assert_same(state, loaded)
    ck.close()  # standalone close removes the memory copy
    assert shm.slot_paths(standalone_namespace(ckdir)) == []
    ck2 = Checkpointer(ckdir)
    step, loaded = ck2.load()  # from disk, checksums verified
    assert step == 7 and ck2.last_load_source == "disk"
    assert_same(state, loaded)
    assert_usable_like_torch_load(loaded)
    ck2.close()
    assert storage.read_tracker(ckdir) == 7


def _service_dirs() -> set[str]:
    """The socket folders of standalone persist services (not of dlrover-run agents)."""
    found = glob.glob(os.path.join(tempfile.gettempdir(), "dlrover-ckpt-*"))
    return {d for d in found if not os.path.basename(d).startswith("dlrover-ckpt-agent-")}


def test_a_standalone_service_leaves_no_socket_folder_behind(tmp_path, ckdir):
    """Closed, or its training process SIGKILLed: the service's socket folder in the temp
    dir goes with the service (one was left per training run before)."""
    before = _service_dirs()
    ck = Checkpointer(ckdir)
    ck.save(1, training_state(seed=2), "memory")
    ck.wait()
    ck._service_process()  # started off the training thread; a memory save does not wait for it
    assert len(_service_dirs() - before) == 1
    ck.close()
    assert _service_dirs() - before == set()
    save_and_get_killed(tmp_path)  # its service persists what it holds, then ends
    wait_for(lambda: not _service_dirs() - before, 60, "the killed run's service folder to go")


def test_keep_latest_prunes_old_steps(ckdir):
    ck = Checkpointer(ckdir, keep_latest=2)
    for step in range(1, 5):
        ck.save(step, {"x": torch.tensor([step])}, "disk")
        ck.wait()
    ck.close()
    assert storage.list_steps(ckdir) == [4, 3]


def big_state(step):
    return {"w": torch.full((12 << 20,), float(step)), "step": step}  # 48 MiB


def test_kill_during_persistence_keeps_the_previous_checkpoint(ckdir):
    ck = Checkpointer(ckdir, keep_latest=5)
    ck.save(1, big_state(1), "disk")
    ck.wait()
    proc = ck._service_process()
    caught = None
    for step in range(2, 12):
        ck.save(step, big_state(step), "disk")
        directory = storage.step_dir(ckdir, step)
        manifest = os.path.join(directory, storage.manifest_name(0))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if glob.glob(os.path.join(directory, "*.tmp*")) and not os.path.exists(manifest):
                proc.send_signal(signal.SIGSTOP)  # frozen mid-write ...
                if not os.path.exists(manifest):
                    caught = step
                break
            if os.path.exists(manifest):
                break
            time.sleep(0.0005)
        if caught:
            break
        proc.send_signal(signal.SIGCONT)
        ck.wait()
    assert caught, "never caught the persister mid-write"
    proc.send_signal(signal.SIGKILL)  # ... and killed there
    with pytest.raises(CheckpointError, match="step"):
        ck.close()  # the lost persist is reported, not skipped silently
    assert storage.read_tracker(ckdir) == caught - 1
    ck2 = Checkpointer(ckdir)
    step, loaded = ck2.load()
    assert step == caught - 1
    assert torch.equal(loaded["w"], big_state(caught - 1)["w"])
    ck2.close()


def test_flipped_byte_is_detected_and_the_previous_checkpoint_loads(ckdir, caplog):
    ck = Checkpointer(ckdir, keep_latest=3)
    for step in (1, 2):
        ck.save(step, training_state(seed=step), "disk")
        ck.wait()
    ck.close()
    path = os.path.join(storage.step_dir(ckdir, 2), storage.flash_file_name(0))
    with open(path, "r+b") as fh:
        fh.seek(shm.HEADER_BYTES + 1000)
        byte = fh.read(1)
        fh.seek(shm.HEADER_BYTES + 1000)
        fh.write(bytes([byte[0] ^ 0x10]))
    ck2 = Checkpointer(ckdir)
    with caplog.at_level(logging.ERROR):
        step, loaded = ck2.load()
    ck2.close()
    assert step == 1
    assert_same(training_state(seed=1), loaded)
    assert "checkpoint step 2 is corrupt" in caplog.text and "checksum mismatch" in caplog.text


def test_too_small_shm_raises_a_clear_error_before_the_first_save(tmp_path, ckdir):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if mount_small_tmpfs(str(mnt)) is None:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        ck = Checkpointer(ckdir, shm_dir=str(mnt))
        with pytest.raises(CapacityError, match=r"needs .* MiB of shared memory in .*shm"):
            ck.prepare({"w": torch.zeros(4 << 20)})
        with pytest.raises(CapacityError, match="memory_slots=1"):
            ck.save(1, {"w": torch.zeros(4 << 20)}, "memory")
        ck.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_agent_keeper_persists_a_killed_workers_memory_checkpoint(tmp_path, ckdir):
    keeper = AgentCheckpointKeeper(f"test-{os.getpid()}")
    env = keeper.start()
    assert set(env) == {SERVICE_ENV}
    try:
        save_and_get_killed(tmp_path, env)
        assert storage.list_steps(ckdir) == []
        results = keeper.persist_latest(timeout=60)  # what the agent's on-stop hook does
        assert [r.ok and r.committed for r in results] == [True]
        assert keeper.persist_latest(timeout=60)[0].skipped == "already persisted"
    finally:
        keeper.close()  # the agent owns the shm: it is gone now
    assert shm.slot_paths(keeper.namespace) == []
    out, err = finish(spawn(["load", tmp_path]))  # a new node: restored from disk
    assert json.loads(out.splitlines()[-1]) == {"step": 5}
    assert "from shared memory" not in err


@pytest.mark.slow
def test_ddp_ranks_agree_on_memory_or_fall_back_to_disk(tmp_path, ckdir):
    procs = [spawn(["ddp", tmp_path, rank]) for rank in (0, 1)]
    for proc in procs:
        out, _ = finish(proc)
        assert json.loads(out.splitlines()[-1])["ok"]


@pytest.mark.slow
def test_fsdp_sharded_checkpoint_is_readable_by_torch_dcp(tmp_path, ckdir):
    procs = [spawn(["fsdp", tmp_path, rank]) for rank in (0, 1)]
    for proc in procs:
        out, _ = finish(proc)
        assert json.loads(out.splitlines()[-1])["ok"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(storage.step_dir(ckdir, 1), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert full["model"]["0.weight"].shape == (16, 8) and full["epoch"] == 3
    assert full["optim"]["state"]["2.weight"]["exp_avg"].shape == (4, 16)
