"""Shuffled epoch order computed per index with O(1) memory.

A keyed Feistel network permutes a power-of-two domain; cycle-walking restricts it to [0, size).
"""

from __future__ import annotations

import functools
import hashlib

__all__ = ["permute", "permute_range"]

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
# Round functions with at most this many inputs are tabulated (same values as `_round`); building
# costs about as much as permuting that many indices and makes each index ~5x cheaper.
_TABLE_MAX_ENTRIES = 1 << 14
_TABLE_CACHE_SIZE = 4
_table_cache: dict[tuple[int, int, int], tuple[list[int], ...]] = {}


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


def _tables(size: int, seed: int, epoch: int) -> tuple[list[int], ...]:
    """The round functions tabulated over their whole input range, kept in a small LRU cache."""
    cache_key = (size, seed, epoch)
    tables = _table_cache.pop(cache_key, None)
    if tables is None:
        lo_bits, _, hi_bits, keys = _params(size, seed, epoch)
        built = []
        for i, key in enumerate(keys):
            in_bits, out_bits = (lo_bits, hi_bits) if i % 2 == 0 else (hi_bits, lo_bits)
            built.append([_round(v, key, out_bits) for v in range(1 << in_bits)])
        tables = tuple(built)
        while len(_table_cache) >= _TABLE_CACHE_SIZE:
            del _table_cache[next(iter(_table_cache))]
    _table_cache[cache_key] = tables  # (re)inserted as the most recently used
    return tables


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
    if (size, seed, epoch) in _table_cache:
        return permute_range(position, position + 1, size, seed, epoch)[0]
    lo_bits, lo_mask, hi_bits, keys = _params(size, seed, epoch)
    x = position
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
    """`[permute(p, size, seed, epoch) for p in range(start, end)]`, computed fast."""
    if end < start:
        raise ValueError(f"range end {end} is before its start {start}")
    if start == end:
        return []
    _check(start, size)
    _check(end - 1, size)
    if size == 1:
        return [0]
    lo_bits, lo_mask, hi_bits, keys = _params(size, seed, epoch)
    # Expected passes through the network: (end - start) * domain / size.
    passes = ((end - start) << (lo_bits + hi_bits)) // size
    if 1 << hi_bits <= _TABLE_MAX_ENTRIES and (
        passes >= 1 << hi_bits or (size, seed, epoch) in _table_cache
    ):
        return _permute_range_tables(start, end, size, seed, epoch, lo_bits, lo_mask)
    return _permute_range_mix(start, end, size, lo_bits, lo_mask, hi_bits, keys)


def _permute_range_tables(
    start: int, end: int, size: int, seed: int, epoch: int, lo_bits: int, lo_mask: int
) -> list[int]:
    t0, t1, t2, t3 = _tables(size, seed, epoch)
    out = []
    append = out.append
    for x in range(start, end):
        while True:
            lo = x & lo_mask
            hi = (x >> lo_bits) ^ t0[lo]
            lo ^= t1[hi]
            hi ^= t2[lo]
            x = (hi << lo_bits) | (lo ^ t3[hi])
            if x < size:
                break
        append(x)
    return out


def _permute_range_mix(
    start: int,
    end: int,
    size: int,
    lo_bits: int,
    lo_mask: int,
    hi_bits: int,
    keys: tuple[int, ...],
) -> list[int]:
    # `_round` inlined for the four rounds (the unrolled loops assume _ROUNDS == 4).
    k0, k1, k2, k3 = keys
    s_hi = 32 - hi_bits
    s_lo = 32 - lo_bits
    m32, c1, c2 = _M32, _C1, _C2
    out = []
    append = out.append
    for x in range(start, end):
        while True:
            lo = x & lo_mask
            z = ((lo ^ k0) * c1) & m32
            z ^= z >> 16
            hi = (x >> lo_bits) ^ (((z * c2) & m32) >> s_hi)
            z = ((hi ^ k1) * c1) & m32
            z ^= z >> 16
            lo ^= ((z * c2) & m32) >> s_lo
            z = ((lo ^ k2) * c1) & m32
            z ^= z >> 16
            hi ^= ((z * c2) & m32) >> s_hi
            z = ((hi ^ k3) * c1) & m32
            z ^= z >> 16
            x = (hi << lo_bits) | (lo ^ (((z * c2) & m32) >> s_lo))
            if x < size:
                break
        append(x)
    return out
