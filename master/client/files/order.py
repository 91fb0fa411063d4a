"""The record each position of an epoch holds: a pure bijection of (position, size, block,
window, seed, epoch), so any node reading any remainder of any shard finds the same records.

Positions are cut into blocks of `block` records; full blocks are permuted per (seed, epoch)
(the short last block stays in place). Inside a block, windows of `window` records are each
permuted too. A shard's positions thus land on a few windows that are each read in one run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from master.shuffle.permutation import permute, permute_array

# Sub-seeds of the user's seed: one for the order of the blocks, one per window.
_BLOCKS = -1


@dataclass(frozen=True)
class Chunk:
    """Positions [first, last) of one window and their records, all in [lo, hi).

    `records` is None where they are lo, lo + 1, ... (no shuffle): read them in order."""

    first: int
    last: int
    lo: int
    hi: int
    records: np.ndarray | None


@dataclass(frozen=True)
class Order:
    """An epoch order of `size` records: the identity, or blocks and windows shuffled."""

    size: int
    shuffle: bool = False
    block: int = 4096
    window: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"an order needs at least one record, got size {self.size}")
        if self.block < 1 or not 1 <= self.window <= self.block:
            raise ValueError(
                f"need block >= 1 and 1 <= window <= block, got block {self.block}, "
                f"window {self.window}"
            )

    def chunks(self, start: int, end: int, epoch: int) -> Iterator[Chunk]:
        """Positions [start, end) cut at window boundaries, each with its records."""
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"positions [{start}, {end}) are outside [0, {self.size})")
        if not self.shuffle:
            if start < end:
                yield Chunk(start, end, start, end, None)
            return
        p = start
        while p < end:
            b, offset = divmod(p, self.block)
            w = offset // self.window
            block_len = min(self.block, self.size - b * self.block)
            window_len = min(self.window, block_len - w * self.window)
            window_start = b * self.block + w * self.window
            last = min(end, window_start + window_len)
            target = self._block_of(b, epoch) * self.block + w * self.window
            q0, q1 = p - window_start, last - window_start
            inside = permute_array(
                q0, q1, window_len, _subseed(self.seed, target // self.block, w), epoch, False
            )
            lo, hi = target + int(inside.min()), target + int(inside.max()) + 1
            yield Chunk(p, last, lo, hi, target + inside)
            p = last

    def records(self, start: int, end: int, epoch: int) -> np.ndarray:
        """The records at positions [start, end), as an int64 array."""
        parts = [
            np.arange(c.lo, c.hi, dtype=np.int64) if c.records is None else c.records
            for c in self.chunks(start, end, epoch)
        ]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _block_of(self, b: int, epoch: int) -> int:
        """Where block b goes: full blocks are permuted among themselves, the short last one
        stays."""
        full = self.size // self.block
        if b >= full or full < 2:
            return b
        return permute(b, full, _subseed(self.seed, _BLOCKS, 0), epoch)


def _subseed(seed: int, block: int, window: int) -> int:
    """A seed of its own for each window (and for the block order), from the user's seed."""
    digest = hashlib.blake2b(
        f"{seed}:{block}:{window}".encode(), digest_size=8, person=b"dlrover-files"
    ).digest()
    return int.from_bytes(digest, "little") >> 1
