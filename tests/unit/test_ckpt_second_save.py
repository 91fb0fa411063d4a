"""The save after a first save without prepare(): no wait for the other slot's fresh memory."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest
import torch

from dlrover_torch.checkpoint import first_save, layout, shm
from tests.unit.ckpt_helpers import assert_same, training_state


@pytest.fixture
def held_reservation(monkeypatch):
    """Background reservations wait for the returned event before they start."""
    go = threading.Event()
    run = first_save.SlotReservation._run

    def slow(self):
        assert go.wait(60), "the test never released the reservation"
        run(self)

    monkeypatch.setattr(first_save.SlotReservation, "_run", slow)
    yield go
    go.set()


def plan(state: dict, step: int):
    lay, tensors = layout.plan(state)
    return lay, tensors, layout.encode_meta(lay, {"step": step})


def test_a_save_during_the_reservation_rewrites_the_first_slot_in_place(store, held_reservation):
    s = store()
    lay, tensors, meta = plan(training_state(seed=1), 1)
    assert s.write_first(lay, tensors, meta, 1) == (0, 1)
    second = training_state(seed=2)
    lay, tensors, meta = plan(second, 2)
    assert s.rewrite_first(lay, tensors, meta, 2, avoid=()) == (0, 2)
    assert not os.path.exists(s.paths[1])  # the other slot's memory was not waited for
    other = store()  # another process (a restart, the persister) sees step 2, exactly
    copy = other.latest()
    assert copy is not None and (copy.index, copy.header.step, copy.header.seq) == (0, 2, 2)
    assert_same(second, other.read(copy))
    held_reservation.set()
    third = training_state(seed=3)
    lay, tensors, meta = plan(third, 3)
    assert not s.ensure_needed(lay.data_bytes, len(meta))  # waits for, then takes, the slots
    assert s.rewrite_first(lay, tensors, meta, 3, avoid=()) is None  # reservation done
    index = s.acquire(())
    assert index == 1  # double buffering again: never the slot holding step 2
    s.write(index, lay, tensors, meta, 3)
    copy = store().latest()
    assert (copy.index, copy.header.step, copy.header.seq) == (1, 3, 3)


def test_no_rewrite_over_a_slot_being_persisted_or_read_or_too_small(store, held_reservation):
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
