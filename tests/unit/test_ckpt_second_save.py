"""The save after a first save without prepare(): no wait for the other slot's fresh memory."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest
import torch

from dlrover_torch.checkpoint import first_save, layout, shm
from tests.unit.ckpt_helpers import assert_same, training_state


def plan(state: dict, step: int):
    lay, tensors = layout.plan(state)
    return lay, tensors, layout.encode_meta(lay, {"step": step})


def _rss_kib(path: str) -> int:
    """Resident KiB of this process's mapping of ``path``."""
    with open("/proc/self/smaps") as fh:
        lines = fh.read().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(path):
            for detail in lines[i + 1 :]:
                if detail.startswith("Rss:"):
                    return int(detail.split()[1])
    raise AssertionError(f"{path} is not mapped")


def test_a_created_slot_is_mapped_with_every_page_present(tmp_path):
    path = os.path.join(shm.SHM_DIR, f"dlrover-fc-test-populate-{os.getpid()}")
    size = 40 << 20  # not a multiple of the populate step
    try:
        slot = shm.SlotFile.create(path, size + 4096)
        try:
            assert _rss_kib(path) == (size + 4096) // 1024
        finally:
            slot.close()
    finally:
        shm.unlink_quietly(path)


@pytest.fixture
def held_fresh_slot(monkeypatch):
    """The reservation maps the written slot, then waits for the returned event before it
    creates the fresh one; the gate each fresh slot's first touch was given is recorded."""
    go = threading.Event()
    gates: list[threading.Event | None] = []
    create = shm.SlotFile.create

    def held(path, size, gate=None):
        gates.append(gate)
        assert go.wait(60), "the test never released the fresh slot"
        return create(path, size, gate)

    monkeypatch.setattr(shm.SlotFile, "create", staticmethod(held))
    yield go, gates
    go.set()


def _wait_mapped(s, index: int) -> None:
    deadline = threading.Event()
    for _ in range(600):
        if s._reservation.mapped(index) is not None:
            return
        deadline.wait(0.05)
    raise AssertionError(f"slot {index} was never mapped by the reservation")


def test_a_save_copies_into_the_mapped_first_slot_while_the_fresh_one_pauses(
    store, held_fresh_slot, monkeypatch
):
    go, gates = held_fresh_slot
    s = store()
    lay, tensors, meta = plan(training_state(seed=1), 1)
    s.write_first(lay, tensors, meta, 1)
    _wait_mapped(s, 0)
    touching_during_copy = []
    write = type(s).write

    def spy(self, *args, **kwargs):
        touching_during_copy.append(gates[0].is_set())
        return write(self, *args, **kwargs)

    monkeypatch.setattr(type(s), "write", spy)
    second = training_state(seed=2)
    lay, tensors, meta = plan(second, 2)
    assert s.rewrite_first(lay, tensors, meta, 2, avoid=()) == (0, 2)
    assert touching_during_copy == [False]  # the mapped copy ran, the fresh slot paused
    assert not os.path.exists(s.paths[1])  # the fresh slot's memory was not waited for
    assert gates[0].is_set()  # and resumes after it
    adopted = s._slots[0]
    assert adopted is not None and adopted.file is s._reservation.mapped(0)
    copy = store().latest()
    assert (copy.index, copy.header.step, copy.header.seq) == (0, 2, 2)
    assert_same(second, store().read(copy))
    go.set()
    third = training_state(seed=3)
    lay, tensors, meta = plan(third, 3)
    assert not s.ensure_needed(lay.data_bytes, len(meta))
    assert s._slots[0] is adopted  # kept, not remapped, when the reservation settles
    index = s.acquire(())
    assert index == 1
    s.write(index, lay, tensors, meta, 3)
    copy = store().latest()
    assert (copy.index, copy.header.step) == (1, 3)
    assert_same(third, store().read(copy))


def test_a_failed_fresh_slot_leaves_the_adopted_slot_usable(store, monkeypatch):
    go = threading.Event()

    def no_room(path, size, gate=None):
        assert go.wait(60)
        raise first_save.CapacityError(f"{path}: no room (test)")

    monkeypatch.setattr(shm.SlotFile, "create", staticmethod(no_room))
    s = store()
    lay, tensors, meta = plan(training_state(seed=5), 1)
    s.write_first(lay, tensors, meta, 1)
    _wait_mapped(s, 0)
    second = training_state(seed=6)
    lay, tensors, meta = plan(second, 2)
    assert s.rewrite_first(lay, tensors, meta, 2, avoid=()) == (0, 2)  # adopted
    go.set()
    with pytest.raises(first_save.CapacityError, match="no room"):
        s.ensure_needed(lay.data_bytes, len(meta))
    third = training_state(seed=7)
    lay, tensors, meta = plan(third, 3)
    assert s.acquire(()) == 0  # the adopted mapping is still open and writable
    s.write(0, lay, tensors, meta, 3)
    copy = store().latest()
    assert (copy.index, copy.header.step) == (0, 3)
    assert_same(third, store().read(copy))


def test_no_rewrite_over_a_slot_being_persisted_or_read_or_too_small(store, held_fresh_slot):
    s = store()
    state = training_state(seed=4)
    lay, tensors, meta = plan(state, 1)
    s.write_first(lay, tensors, meta, 1)
    assert s.rewrite_first(lay, tensors, meta, 2, avoid={0}) is None  # its persist is pending
    fd = os.open(s.paths[0], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a persister reading it
        assert s.rewrite_first(lay, tensors, meta, 2, avoid=()) is None
    finally:
        os.close(fd)
    bigger = {**state, "extra": torch.zeros(1 << 20)}  # past the slack
    lay2, tensors2, meta2 = plan(bigger, 2)
    assert s.rewrite_first(lay2, tensors2, meta2, 2, avoid=()) is None
    copy = store().latest()
    assert copy.header.step == 1  # none of the refusals touched the committed copy
    assert_same(state, store().read(copy))
