"""The position -> record mapping of file datasets: a bijection of each epoch, a pure function
(any remainder of any shard maps to the records the whole shard would), in window chunks."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from master.client.files.order import Order


@pytest.mark.parametrize("size", [1, 2, 7, 100, 255, 4095, 4096, 4097, 10_000, 3 * 4096])
@pytest.mark.parametrize("block,window", [(1, 1), (3, 2), (64, 64), (64, 17), (4096, 4096)])
def test_each_epoch_is_a_bijection(size, block, window):
    if block < 8 and size > 1000:
        size = size % 1000 + 1  # thousands of tiny windows: slow and no different
    order = Order(size, shuffle=True, block=block, window=window, seed=5)
    for epoch in range(3):
        records = order.records(0, size, epoch)
        assert np.array_equal(np.sort(records), np.arange(size))


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 20_000),
    block=st.integers(64, 3000),
    window_fraction=st.floats(0.1, 1.0),
    seed=st.integers(-(2**40), 2**40),
    epoch=st.integers(0, 50),
    cuts=st.lists(st.floats(0, 1), max_size=6),
)
def test_any_split_into_remainders_reads_the_same_records(
    size, block, window_fraction, seed, epoch, cuts
):
    window = max(1, int(block * window_fraction))
    order = Order(size, shuffle=True, block=block, window=window, seed=seed)
    whole = order.records(0, size, epoch)
    assert np.array_equal(np.sort(whole), np.arange(size))
    bounds = sorted({0, size, *(int(c * size) for c in cuts)})
    # Another Order object (another node) computes the pieces: no state is shared.
    other = Order(size, shuffle=True, block=block, window=window, seed=seed)
    pieces = [other.records(a, b, epoch) for a, b in pairwise(bounds)]
    assert np.array_equal(np.concatenate(pieces), whole)


def test_chunks_are_windows_each_read_as_one_run():
    size, block, window = 50_000, 4096, 1024
    order = Order(size, shuffle=True, block=block, window=window, seed=1)
    chunks = list(order.chunks(1000, 30_000, 2))
    assert chunks[0].first == 1000 and chunks[-1].last == 30_000
    for a, b in pairwise(chunks):
        assert a.last == b.first
    for c in chunks:
        assert c.first // window == (c.last - 1) // window  # one source window each
        assert c.hi - c.lo <= window  # records of one target window: one read
        assert c.lo <= c.records.min() and c.records.max() < c.hi
        assert c.lo % window == 0 or c.first % window != 0  # whole windows start aligned
    assert len(chunks) == -(-30_000 // window) - 1000 // window


def test_without_shuffle_the_order_is_the_identity_in_one_chunk():
    order = Order(10_000, shuffle=False, seed=4)
    assert np.array_equal(order.records(17, 9000, 3), np.arange(17, 9000))
    (chunk,) = order.chunks(17, 9000, 3)
    assert (chunk.lo, chunk.hi, chunk.records) == (17, 9000, None)


def test_blocks_move_across_the_dataset_and_epochs_differ():
    size, block = 64 * 100 + 30, 64
    order = Order(size, shuffle=True, block=block, window=block, seed=9)
    epochs = [order.records(0, size, e) for e in range(4)]
    assert len({e.tobytes() for e in epochs}) == 4
    for records in epochs:
        # Position 0's block is somewhere else, and the short last block stays in place.
        firsts = records[:block] // block
        assert len(set(firsts.tolist())) == 1
        assert np.array_equal(np.sort(records[64 * 100 :]), np.arange(64 * 100, size))
    assert len({int(e[0]) // block for e in epochs}) > 1
    # Inside a block the records are permuted, not in order.
    assert not np.array_equal(epochs[0][:block], np.sort(epochs[0][:block]))


def test_seeds_give_different_orders():
    a = Order(5000, shuffle=True, block=512, window=128, seed=1).records(0, 5000, 0)
    b = Order(5000, shuffle=True, block=512, window=128, seed=2).records(0, 5000, 0)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize(
    "kwargs", [{"size": 0}, {"size": 5, "block": 0}, {"size": 5, "block": 4, "window": 5}]
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        Order(**kwargs)


def test_positions_outside_the_dataset_are_refused():
    with pytest.raises(ValueError, match="outside"):
        list(Order(10).chunks(5, 11, 0))
