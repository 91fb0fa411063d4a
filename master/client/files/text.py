"""Text files, one record per line: the index of line starts, and a line's bytes without its
line end ("\\n" or "\\r\\n"; a last line without one counts too)."""

from __future__ import annotations

import numpy as np

from master.client.files.cache import FileIndex, FileStat
from master.client.files.errors import DataFileError

FORMAT = "text"
CHUNK_BYTES = 16 << 20
_NL, _CR = 10, 13


def build_index(path: str) -> FileIndex:
    """Offsets of every line's start plus the file's end (count + 1 values), found with numpy
    over the file's bytes a chunk at a time."""
    starts = [np.zeros(1, dtype=np.int64)]
    with open(path, "rb") as f:
        stat = FileStat.of(f.fileno())
        base = 0
        last = b""
        while True:
            chunk = f.read(CHUNK_BYTES)
            if not chunk:
                break
            ends = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == _NL)
            starts.append(ends.astype(np.int64) + (base + 1))
            base += len(chunk)
            last = chunk[-1:]
    if base != stat.size or FileStat.of(path) != stat:
        raise DataFileError(
            f"{path} changed while it was indexed ({stat.size} bytes at the start, {base} read): "
            "start the job once the file is complete"
        )
    offsets = np.concatenate(starts)
    # Each "\n" starts a line after it; a file's end is the end of its last line, which counts
    # as a line also without a "\n" at its end.
    if base and last != b"\n":
        offsets = np.append(offsets, base)
    return FileIndex(path, FORMAT, stat, len(offsets) - 1, offsets)


def line_lengths(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The lengths of the lines at [starts, ends) of `data` (uint8) without their line ends."""
    lengths = ends - starts
    has = lengths > 0
    newline = np.zeros(len(lengths), dtype=bool)
    newline[has] = data[ends[has] - 1] == _NL
    lengths = lengths - newline
    cr = newline & (lengths > 0)
    cr[cr] = data[starts[cr] + lengths[cr] - 1] == _CR
    return lengths - cr
