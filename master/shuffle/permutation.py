"""Shuffled epoch order computed per position, with no table of the whole order.

A keyed Feistel network permutes a power-of-two domain; cycle-walking restricts it to [0, size).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable

import numpy as np

__all__ = ["permute", "permute_array", "permute_range", "record_indices"]

# The domain is the smallest power of two >= max(size, 2**_MIN_BITS), split into a high and a low
# half that differ by one bit when the bit count is odd. Even rounds XOR the high half with a keyed
# function of the low half, odd rounds the reverse, so every round (and the network) is a
# bijection whatever the widths. Since the domain is < 2 * size, cycle-walking (re-applying the
# network until the value is < size) takes under two passes per index on average.
_ROUNDS = 4
_M32 = (1 << 32) - 1
_C1 = 0x85EBCA6B  # murmur3 fmix32 multipliers
_C2 = 0xC2B2AE35
# A 4-round Feistel on a tiny domain is visibly non-uniform across seeds; a 256-value floor fixes
# that, and walking a whole tiny dataset through it costs at most 256 passes.
_MIN_BITS = 8
# Positions still walking below this many go through the network one by one, in Python.
_SCALAR_TAIL = 16
# Blocks of the order computed at once for short ranges of large datasets (512 KiB each).
_BLOCK = 1 << 16
_BLOCKS_CACHED = 8
_blocks: dict[tuple[int, int, int, int], np.ndarray] = {}
_blocks_lock = threading.Lock()


@functools.lru_cache(maxsize=64)
def _params(size: int, seed: int, epoch: int) -> tuple[int, int, int, tuple[int, ...]]:
    """(low bits, low mask, high bits, round keys) for one (size, seed, epoch)."""
    bits = max(_MIN_BITS, (size - 1).bit_length())
    lo_bits = bits // 2
    hi_bits = bits - lo_bits
    digest = hashlib.blake2b(
        f"{seed}:{epoch}:{bits}".encode(), digest_size=4 * _ROUNDS, person=b"dlrover-perm"
    ).digest()
    keys = tuple(int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(_ROUNDS))
    return lo_bits, (1 << lo_bits) - 1, hi_bits, keys


def _round(value: int, key: int, out_bits: int) -> int:
    """Keyed round function: the top `out_bits` bits of a 32-bit murmur-style mix."""
    z = ((value ^ key) * _C1) & _M32
    z ^= z >> 16
    return ((z * _C2) & _M32) >> (32 - out_bits)


def _check(position: int, size: int) -> None:
    if size < 1:
        raise ValueError(f"permutation size must be >= 1, got {size}")
    if not 0 <= position < size:
        raise ValueError(f"position {position} is outside [0, {size})")


def permute(position: int, size: int, seed: int, epoch: int) -> int:
    """The record index at `position` in the shuffled order of [0, size) for (seed, epoch)."""
    _check(position, size)
    if size == 1:
        return 0
    return _walk(position, size, *_params(size, seed, epoch))


def _walk(x: int, size: int, lo_bits: int, lo_mask: int, hi_bits: int, keys: tuple) -> int:
    """The network applied to one position until the value is inside [0, size)."""
    while True:
        hi = x >> lo_bits
        lo = x & lo_mask
        for i, key in enumerate(keys):
            if i % 2 == 0:
                hi ^= _round(lo, key, hi_bits)
            else:
                lo ^= _round(hi, key, lo_bits)
        x = (hi << lo_bits) | lo
        if x < size:
            return x


def permute_range(start: int, end: int, size: int, seed: int, epoch: int) -> list[int]:
    """`[permute(p, size, seed, epoch) for p in range(start, end)]` as a list."""
    return permute_array(start, end, size, seed, epoch).tolist()


def record_indices(
    start: int, end: int, size: int, shuffle: bool, seed: int, epoch: int, cached: bool = True
) -> np.ndarray:
    """The record indices at positions [start, end) of an epoch's order of [0, size), as an
    int64 array: shuffled per (seed, epoch), or in order."""
    if not shuffle:
        return np.arange(start, end, dtype=np.int64)
    return permute_array(start, end, size, seed, epoch, cached)


def permute_array(
    start: int, end: int, size: int, seed: int, epoch: int, cached: bool = True
) -> np.ndarray:
    """The shuffled record indices at positions [start, end), as an int64 array.

    `cached`: a short range of a large dataset is cut from its block of _BLOCK positions,
    computed once: the master deals shards in position order, so one block serves its next
    ~64 shards of 1,024 records. A node computing only its own shards asks without."""
    if end < start:
        raise ValueError(f"range end {end} is before its start {start}")
    if start == end:
        return np.empty(0, dtype=np.int64)
    _check(start, size)
    _check(end - 1, size)
    if size == 1:
        return np.zeros(1, dtype=np.int64)
    first, last = start // _BLOCK, (end - 1) // _BLOCK
    if cached and size >= 2 * _BLOCK and end - start <= _BLOCK // 4 and last - first <= 1:
        base = first * _BLOCK
        block = _block(size, seed, epoch, first)
        if last == first:
            return block[start - base : end - base]
        following = _block(size, seed, epoch, last)
        return np.concatenate((block[start - base :], following[: end - base - _BLOCK]))
    return _compute(start, end, size, seed, epoch)


def _block(size: int, seed: int, epoch: int, index: int) -> np.ndarray:
    """Positions [index * _BLOCK, (index + 1) * _BLOCK) of the order (fewer in the last
    block), from a small cache of recent blocks (two threads may both compute a missing one)."""
    key = (size, seed, epoch, index)
    with _blocks_lock:
        block = _blocks.pop(key, None)
        if block is not None:
            _blocks[key] = block  # the most recently used
            return block
    block = _compute(index * _BLOCK, min(size, (index + 1) * _BLOCK), size, seed, epoch)
    block.flags.writeable = False  # slices of it are handed out
    with _blocks_lock:
        while len(_blocks) >= _BLOCKS_CACHED:
            del _blocks[next(iter(_blocks))]
        _blocks[key] = block
    return block


def _compute(start: int, end: int, size: int, seed: int, epoch: int) -> np.ndarray:
    """permute_array's positions [start, end), computed."""
    network = _network(size, seed, epoch)
    out = np.empty(end - start, dtype=np.int64)
    slots = np.arange(end - start)  # output slots whose value is not < size yet
    x = np.arange(start, end, dtype=np.uint64)
    while len(x) > _SCALAR_TAIL:
        x = network(x)
        inside = x < size
        if inside.all():
            out[slots] = x
            return out
        out[slots[inside]] = x[inside]
        outside = ~inside
        slots, x = slots[outside], x[outside]
    # The few values still to walk, one by one: a numpy pass costs ~20 us however short.
    params = _params(size, seed, epoch)
    for slot, value in zip(slots.tolist(), x.tolist(), strict=True):
        out[slot] = _walk(value, size, *params)
    return out


@functools.lru_cache(maxsize=64)
def _network(size: int, seed: int, epoch: int) -> Callable[[np.ndarray], np.ndarray]:
    """One pass of the Feistel network over a uint64 array. Each half fits 32 bits, so the
    rounds run on uint32 arrays, whose products wrap modulo 2**32 as the 32-bit mix needs."""
    lo_bits, lo_mask, hi_bits, keys = _params(size, seed, epoch)
    u32 = np.uint32
    k0, k1, k2, k3 = (u32(k) for k in keys)
    c1, c2, s16 = u32(_C1), u32(_C2), u32(16)
    to_hi, to_lo = u32(32 - hi_bits), u32(32 - lo_bits)  # keep the top out_bits of the mix
    shift, mask = np.uint64(lo_bits), np.uint64(lo_mask)

    def mix(value: np.ndarray, key: np.uint32, keep: np.uint32) -> np.ndarray:
        z = value ^ key
        z *= c1
        z ^= z >> s16
        z *= c2
        z >>= keep
        return z

    def network(x: np.ndarray) -> np.ndarray:
        lo = (x & mask).astype(u32)
        hi = (x >> shift).astype(u32)
        hi ^= mix(lo, k0, to_hi)
        lo ^= mix(hi, k1, to_lo)
        hi ^= mix(lo, k2, to_hi)
        lo ^= mix(hi, k3, to_lo)
        return (hi.astype(np.uint64) << shift) | lo

    return network
