"""The first save's slot mapped behind its writes: ready when the save returns, never mapped
for a save that failed."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from dlrover_torch.checkpoint import first_save, layout, map_behind, shm
from dlrover_torch.checkpoint.errors import CapacityError, CheckpointError
from tests.unit.ckpt_helpers import training_state
from tests.unit.test_ckpt_second_save import _rss_kib


@pytest.fixture
def slot_path():
    path = os.path.join(shm.SHM_DIR, f"dlrover-fc-test-behind-{os.getpid()}")
    yield path
    shm.unlink_quietly(path)


def _mapper(path, size, progress):
    out: dict = {}

    def run():
        try:
            out["file"] = map_behind.map_behind(path, size, progress)
        except BaseException as exc:  # the test reads it
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("advice", [shm.MADV_POPULATE_WRITE, 999])  # 999: a kernel without it
def test_every_page_is_mapped_once_the_save_is_written(slot_path, monkeypatch, advice):
    monkeypatch.setattr(shm, "MADV_POPULATE_WRITE", advice)
    monkeypatch.setattr(first_save, "PROGRESS_STEP_BYTES", 1 << 20)  # many ranges
    state = training_state(seed=1)
    state["big"] = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB
    lay, tensors = layout.plan(state)
    meta = layout.encode_meta(lay, {"step": 1})
    size = shm.HEADER_BYTES + shm.page_align(lay.data_bytes + (1 << 20)) + (64 << 10)
    header = shm.SlotHeader(
        shm.STATE_COMMITTED, 1, 1, lay.data_bytes, size - (64 << 10), 0, 0, 0, 1, 0
    )
    progress = map_behind.WriteProgress()
    thread, out = _mapper(slot_path, size, progress)
    first_save.write_slot(slot_path, size, lay, tensors, header, meta, progress)
    thread.join(30)
    assert "error" not in out, out
    file = out["file"]
    try:
        assert file.size == size and _rss_kib(slot_path) == size // 1024
        got = file.header()
        assert got is not None and (got.state, got.step) == (shm.STATE_COMMITTED, 1)
        assert file.meta(got) == meta
        for ext, tensor in zip(lay.extents, tensors, strict=True):
            start = shm.HEADER_BYTES + ext.offset
            want = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert file.mm[start : start + ext.nbytes] == want
    finally:
        file.close()


def test_a_failed_save_is_never_mapped(slot_path, monkeypatch):
    def full(fd, path, buffers, offset, progress=None):
        if progress is not None:
            progress.advance(offset + 4096)
        raise CapacityError(f"{path}: /dev/shm filled up (test)")

    monkeypatch.setattr(first_save, "_pwrite_all", full)
    state = training_state(seed=2)
    lay, tensors = layout.plan(state)
    meta = layout.encode_meta(lay, {"step": 1})
    size = shm.HEADER_BYTES + shm.page_align(lay.data_bytes) + (64 << 10)
    header = shm.SlotHeader(
        shm.STATE_COMMITTED, 1, 1, lay.data_bytes, size - (64 << 10), 0, 0, 0, 1, 0
    )
    progress = map_behind.WriteProgress()
    thread, out = _mapper(slot_path, size, progress)
    with pytest.raises(CapacityError, match="filled up"):
        first_save.write_slot(slot_path, size, lay, tensors, header, meta, progress)
    thread.join(30)
    assert isinstance(out.get("error"), (CheckpointError, OSError)), out
    assert "file" not in out
    assert os.path.getsize(slot_path) == 0  # an empty file is never loaded, nor reserved


def test_a_store_whose_first_save_fails_reserves_nothing(store, monkeypatch):
    def full(fd, path, buffers, offset, progress=None):
        raise CapacityError(f"{path}: /dev/shm filled up (test)")

    monkeypatch.setattr(first_save, "_pwrite_all", full)
    s = store()
    lay, tensors = layout.plan(training_state(seed=3))
    meta = layout.encode_meta(lay, {"step": 1})
    with pytest.raises(CapacityError):
        s.write_first(lay, tensors, meta, 1)
    assert s._reservation is None and s.seq == 0
    assert not os.path.exists(s.paths[1])  # no fresh slot was made for a failed save
    assert [t.name for t in threading.enumerate() if t.name == "ckpt-reserve"] == []
