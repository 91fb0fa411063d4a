"""A first memory save without prepare(): one slot written by pwrite, the rest reserved later."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from dlrover_torch.checkpoint import layout, shm
from dlrover_torch.checkpoint.errors import CapacityError
from dlrover_torch.checkpoint.first_save import SlotReservation, write_slot
from dlrover_torch.checkpoint.map_behind import WriteProgress
from dlrover_torch.checkpoint.memory import MemoryStore
from tests.unit.ckpt_helpers import (
    assert_same,
    assert_usable_like_torch_load,
    mount_small_tmpfs,
    training_state,
)


@pytest.fixture
def small_shm(tmp_path):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if mount_small_tmpfs(str(mnt)) is None:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def odd_state() -> dict:
    """Tensors a plain byte copy could get wrong: strided, conjugated, bool, bf16, 0-d, empty."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = training_state(seed=3)
    state["odd"] = {
        "transposed": base.t(),
        "sliced": base[:, ::2],
        "conj": torch.complex(base, -base).conj(),
        "bool": base > 7,
        "bf16": base.to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }
    return state


def first_save(s: MemoryStore, state: dict, step: int) -> tuple[int, int]:
    lay, tensors = layout.plan(state)
    meta = layout.encode_meta(lay, {"step": step})
    assert s.first_save_possible(tensors)
    return s.write_first(lay, tensors, meta, step)


def test_first_save_reads_back_exactly_and_later_saves_use_the_reserved_slots(store):
    state = odd_state()
    s = store()
    index, seq = first_save(s, state, 5)
    assert (index, seq) == (0, 1)
    restarted = store()  # a new process finds the committed slot, reservation or not
    copy = restarted.latest()
    assert copy is not None and copy.header.step == 5
    restored = restarted.read(copy)
    conj = state["odd"]["conj"]
    assert torch.equal(restored["odd"].pop("conj"), conj.resolve_conj())  # the values, not the bit
    assert_same({**state, "odd": {k: v for k, v in state["odd"].items() if k != "conj"}}, restored)
    assert_usable_like_torch_load(restored)

    lay, tensors = layout.plan(state)
    meta = layout.encode_meta(lay, {"step": 6})
    assert not s.first_save_possible(tensors)
    assert not s.ensure_needed(lay.data_bytes, len(meta))  # the background mapped every slot
    sizes = {os.path.getsize(p) for p in s.paths}
    assert len(sizes) == 1 and sizes.pop() >= lay.data_bytes
    other = s.acquire(())
    assert other == 1  # never the slot holding the latest checkpoint
    s.write(other, lay, tensors, meta, 6)
    assert store().latest().header.step == 6


def test_a_full_shm_fails_the_first_write_and_commits_nothing(store, small_shm):
    s = store(directory=small_shm)
    state = {"w": torch.ones(6 << 20, dtype=torch.uint8)}  # 6 MiB into a 4 MiB tmpfs
    lay, tensors = layout.plan(state)
    meta = layout.encode_meta(lay, {"step": 1})
    header = shm.SlotHeader(shm.STATE_COMMITTED, 1, 1, lay.data_bytes, 8 << 20, 0, 0, 0, 1, 0)
    with pytest.raises(CapacityError, match="filled up during the first checkpoint save"):
        write_slot(s.paths[0], (8 << 20) + (1 << 20), lay, tensors, header, meta)
    assert os.path.getsize(s.paths[0]) == 0  # an empty file: never loaded
    assert store(directory=small_shm).latest() is None


def test_a_failed_background_reservation_is_raised_and_the_first_save_survives(store, small_shm):
    s = store(directory=small_shm)  # two slots of about 3.6 MiB do not fit in 4 MiB
    state = {"w": torch.arange(3 << 18, dtype=torch.int16)}  # 1.5 MiB
    first_save(s, state, 1)
    with pytest.raises(CapacityError):
        s.ensure_needed(3 << 19, 100)
    copy = store(directory=small_shm).latest()
    assert copy is not None and copy.header.step == 1
    assert_same(state, store(directory=small_shm).read(copy))


def test_reservation_maps_every_slot_at_the_size_given(store):
    s = store(slots=3)
    first_save(s, {"x": torch.ones(1000)}, 1)
    assert not s.ensure_needed(4000, 10)  # its own reservation is done and taken over
    size = os.path.getsize(s.paths[0])
    written = WriteProgress()
    written.advance(size)
    written.finish(ok=True)  # slot 0 exists, written in full
    files = SlotReservation(s.paths, size, written=0, progress=written).result()
    try:
        assert [f.size for f in files] == [size] * 3
        assert files[0].header().step == 1 and files[1].header() is None
    finally:
        for f in files:
            f.close()
