"""Flash-checkpoint shared memory: commit flag, slot choice, capacity errors, exact copies."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from dlrover_torch.checkpoint import layout, shm
from dlrover_torch.checkpoint.errors import CapacityError, CheckpointError
from dlrover_torch.checkpoint.preflight import check_shm
from tests.unit.ckpt_helpers import (
    assert_same,
    assert_usable_like_torch_load,
    mount_small_tmpfs,
    training_state,
)


def save(s, state, step):
    lay, tensors = layout.plan(state)
    meta = layout.encode_meta(lay, {"step": step})
    s.ensure(lay.data_bytes, len(meta))
    index = s.acquire(())
    assert index is not None
    return index, s.write(index, lay, tensors, meta, step)


def test_save_then_reattach_in_a_new_store_reads_exactly(store):
    state = training_state()
    s = store()
    save(s, state, 3)
    again = store()  # what a restarted process does: same names, fresh mappings
    copy = again.latest()
    assert copy is not None and copy.header.step == 3
    restored = again.read(copy)
    assert_same(state, restored)
    assert_usable_like_torch_load(restored)


def test_newest_committed_slot_wins_and_alternates(store):
    s = store()
    first, seq1 = save(s, {"x": torch.tensor([1.0])}, 1)
    second, seq2 = save(s, {"x": torch.tensor([2.0])}, 2)
    assert first != second and seq2 > seq1
    copy = s.latest()
    assert copy.header.step == 2 and s.read(copy)["x"].item() == 2.0


def test_half_written_slot_is_never_loaded(store):
    s = store()
    save(s, {"x": torch.tensor([1.0])}, 1)
    index = s.acquire(())
    s._slots[index].file.begin_write()  # the process dies here, mid-save: its lock goes away
    s._slots[index].file.unlock()
    assert store().latest().header.step == 1
    s._slots[s.latest_index].file.begin_write()  # and now the committed one is half-rewritten
    assert store().latest() is None


def test_slot_held_by_a_reader_is_not_overwritten(store):
    s = store()
    save(s, {"x": torch.tensor([1.0])}, 1)
    reader = shm.SlotFile.open(s.paths[s.latest_index])
    assert reader.try_lock(exclusive=False)
    other = s.acquire(())
    assert other is not None and other != s.latest_index
    s._slots[other].file.unlock()
    assert s.acquire({other}) is None  # every slot busy: the caller must wait, not skip
    reader.unlock()
    reader.close()


def test_other_rank_or_world_is_not_loaded(store):
    s = store(rank=0, world=2)
    save(s, {"x": torch.tensor([1.0])}, 1)
    assert store(rank=0, world=3).latest() is None


@pytest.fixture
def small_shm(tmp_path):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if mount_small_tmpfs(str(mnt)) is None:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_too_small_shm_fails_with_the_size_needed(store, small_shm):
    s = store(directory=small_shm)
    state = {"w": torch.zeros(3 << 20, dtype=torch.uint8)}  # 3 MiB, 2 slots > 4 MiB
    lay, _ = layout.plan(state)
    needed = s.bytes_needed(lay.data_bytes, 100)
    with pytest.raises(
        CapacityError, match=rf"needs {shm.fmt_bytes(needed)} of shared memory .*--shm-size"
    ):
        check_shm(needed, 0, small_shm)
    # The allocator itself refuses too (fallocate), so a race past the check cannot SIGBUS.
    with pytest.raises(CapacityError, match="only .* is free"):
        s.ensure(lay.data_bytes, 100)
    assert sum(os.path.getsize(p) for p in s.paths if os.path.exists(p)) <= 4 << 20


def test_asynchronous_commit_path_commits_then_reports(store):
    # The path device-to-host copies take (the commit waits in a thread); forced here on CPU.
    s = store()
    s.async_commit = "always"
    seen = []
    lay, tensors = layout.plan({"x": torch.arange(10)})
    meta = layout.encode_meta(lay, {"step": 4})
    s.ensure(lay.data_bytes, len(meta))
    index = s.acquire(())
    seq = s.write(index, lay, tensors, meta, 4, on_commit=seen.append)
    s.flush()
    assert seen == [seq]
    copy = store().latest()
    assert copy.header.step == 4 and torch.equal(s.read(copy)["x"], torch.arange(10))
    other = shm.SlotFile.open(s.paths[index])
    assert other.try_lock(exclusive=True)  # the commit thread released the slot
    other.unlock()
    other.close()

    def boom(seq):
        raise OSError("service gone")

    s.write(s.acquire(()), lay, tensors, meta, 5, on_commit=boom)
    with pytest.raises(CheckpointError, match="service gone"):
        s.flush()
