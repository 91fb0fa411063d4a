"""Runs of records of a TFRecord or text file read in one `pread`: the bytes, and each record's
start and length in them (a reader then cuts the records out with no Python object each)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from master.client.files import text, tfrecord
from master.client.files.cache import FileIndex, FileStat
from master.client.files.errors import FileChangedError


@dataclass(frozen=True)
class Span:
    """Bytes holding consecutive records, and where each record's own bytes are in them."""

    data: bytes
    starts: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)


def join(spans: list[Span]) -> Span:
    """One span of several, in order (their bytes copied once)."""
    if len(spans) == 1:
        return spans[0]
    shift = np.cumsum([0] + [len(s.data) for s in spans[:-1]])
    return Span(
        b"".join(s.data for s in spans),
        np.concatenate([s.starts + d for s, d in zip(spans, shift, strict=True)]),
        np.concatenate([s.lengths for s in spans]),
    )


class ByteFile:
    """A TFRecord or text file open for reading runs of its records."""

    def __init__(self, index: FileIndex) -> None:
        self.index = index
        self._fd = os.open(index.path, os.O_RDONLY)
        self._check()

    def _check(self) -> None:
        if FileStat.of(self._fd) != self.index.stat:
            raise self._changed()

    def _changed(self) -> FileChangedError:
        stat = self.index.stat
        return FileChangedError.of(self.index.path, stat.size, stat.mtime_ns)

    def read(self, lo: int, hi: int) -> Span:
        """Records [lo, hi) of this file, read in one call after checking the file is the one
        indexed."""
        offsets = self.index.array[lo : hi + 1]
        first = int(offsets[0])
        size = int(offsets[-1]) - first
        self._check()
        data = os.pread(self._fd, size, first)
        if len(data) != size:
            raise self._changed()
        relative = offsets - first
        if self.index.format == tfrecord.FORMAT:
            starts = relative[:-1] + tfrecord.HEADER
            lengths = np.diff(relative) - (tfrecord.HEADER + tfrecord.FOOTER)
        else:
            starts = relative[:-1]
            lengths = text.line_lengths(np.frombuffer(data, np.uint8), starts, relative[1:])
        return Span(data, starts, lengths)

    def close(self) -> None:
        os.close(self._fd)
