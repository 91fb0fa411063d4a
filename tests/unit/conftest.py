"""Fixtures shared by the unit tests."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def store():
    """Makes MemoryStores in a namespace of its own, closed and unlinked after the test."""
    from dlrover_torch.checkpoint import shm  # torch only for the tests that use it
    from dlrover_torch.checkpoint.memory import MemoryStore

    ns = f"dlrover-fc-test-{uuid.uuid4().hex[:8]}"
    stores = []

    def make(rank=0, world=1, slots=2, directory=shm.SHM_DIR):
        s = MemoryStore(ns, rank, world, slots, directory)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close(unlink=True)
