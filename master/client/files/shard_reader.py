"""The records of one shard (positions [start, end) of an epoch), read window by window in
position order and handed out in parts of at most n records."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from master.client.files import parquet
from master.client.files.fileset import FileSet
from master.client.files.order import Chunk, Order


@dataclass(frozen=True)
class Part:
    """Records picked from what one read returned: a Span (TFRecord, text) or a pyarrow.Table
    (Parquet). `picks` is a slice of it, or the indices of the records in emit order."""

    source: Any
    picks: slice | np.ndarray

    def __len__(self) -> int:
        if isinstance(self.picks, slice):
            return self.picks.stop - self.picks.start
        return len(self.picks)


# Records read at once where they are read in order (fewer at a shard's end).
RUN_RECORDS = 4096


class ShardReader:
    """Positions [start, end) of `epoch` in `order`: each shuffled window's records are read
    in one run when first needed (one seek), records in order in runs of RUN_RECORDS."""

    def __init__(self, files: FileSet, order: Order, start: int, end: int, epoch: int) -> None:
        self._files = files
        self._rows = files.format == parquet.FORMAT
        self._chunks: Iterator[Chunk] = order.chunks(start, end, epoch)
        self._chunk: Chunk | None = None
        self._done = 0  # records of the current chunk handed out
        self._loaded: Any = None  # the records read last: a window, or a run in order
        self._loaded_lo = 0  # the first of them
        self._loaded_hi = 0
        self.remaining = end - start

    def take(self, n: int) -> Part:
        """The next records, at most n (fewer at a window's end); never empty while some
        remain."""
        if n <= 0 or self.remaining <= 0:
            raise ValueError(f"take({n}) with {self.remaining} records left")
        chunk = self._chunk
        if chunk is None or self._done == chunk.last - chunk.first:
            chunk = self._chunk = next(self._chunks)
            self._done, self._loaded = 0, None
        k = min(n, chunk.last - chunk.first - self._done)
        if chunk.records is None:
            lo = chunk.lo + self._done
            if self._loaded is None or lo >= self._loaded_hi:
                self._load(lo, min(chunk.hi, lo + RUN_RECORDS))
            k = min(k, self._loaded_hi - lo)
            first = lo - self._loaded_lo
            part = Part(self._loaded, slice(first, first + k))
        else:
            if self._loaded is None:
                self._load(chunk.lo, chunk.hi)
            part = Part(self._loaded, chunk.records[self._done : self._done + k] - chunk.lo)
        self._done += k
        self.remaining -= k
        return part

    def _load(self, lo: int, hi: int) -> None:
        files = self._files
        self._loaded = files.read_rows(lo, hi) if self._rows else files.read_span(lo, hi)
        self._loaded_lo, self._loaded_hi = lo, hi
