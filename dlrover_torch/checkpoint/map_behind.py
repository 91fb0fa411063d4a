"""Map a rank's first memory save while it is being written, a step behind the writer.

The first save writes its slot with ``pwrite``; the save after it copies into a mapping of that
slot, which must first be populated (page tables for every page: ~0.1 s per GiB, more on a busy
machine). A thread populates each range as soon as ``pwrite`` has created its pages, on the
other core, so the mapping is ready about when the first save returns and the second save only
copies.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

from dlrover_torch.checkpoint import shm
from dlrover_torch.checkpoint.errors import CapacityError, CheckpointError

WRITING, WRITTEN, FAILED = "writing", "written", "failed"


class WriteProgress:
    """How far the first save's writes have come (file offset), shared with the mapper."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._end = 0
        self._state = WRITING

    def advance(self, end: int) -> None:
        """Bytes up to ``end`` exist in the file."""
        with self._cond:
            self._end = max(self._end, end)
            self._cond.notify_all()

    def finish(self, ok: bool) -> None:
        """The save was committed (``ok``) or gave up."""
        with self._cond:
            self._state = WRITTEN if ok else FAILED
            self._cond.notify_all()

    def wait_beyond(self, done: int) -> tuple[int, str]:
        """Wait until more than ``done`` bytes exist or the save ended: (end, state)."""
        with self._cond:
            self._cond.wait_for(lambda: self._end > done or self._state != WRITING)
            return self._end, self._state


def map_behind(path: str, size: int, progress: WriteProgress) -> shm.SlotFile:
    """The slot file ``path`` (``size`` bytes once written) mapped with every page present,
    populated range by range behind the writer, its unwritten tail reserved last."""
    end, state = progress.wait_beyond(0)
    if state == FAILED:
        raise CheckpointError(f"{path}: the first save failed; nothing to map")
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    try:
        done = 0
        while True:
            start = done // shm.PAGE_BYTES * shm.PAGE_BYTES
            end = min(end, size)
            if end > done and not shm.populate(mm, start, end - start):
                raise _NoPopulate
            done = end
            if state != WRITING:
                break
            end, state = progress.wait_beyond(done)
        if state == FAILED:
            raise CheckpointError(f"{path}: the first save failed; nothing to map")
        tail = min(done, size) // shm.PAGE_BYTES * shm.PAGE_BYTES
        if tail < size:
            _reserve_tail(fd, path, tail, size)
            if not shm.populate(mm, tail, size - tail):
                raise _NoPopulate
    except _NoPopulate:  # a kernel before 5.14: map it populated once it is written
        mm.close()
        _, state = progress.wait_beyond(size)
        try:
            if state == FAILED:
                raise CheckpointError(f"{path}: the first save failed; nothing to map") from None
            _reserve_tail(fd, path, 0, size)
        finally:
            os.close(fd)
        file = shm.SlotFile.open(path, writable=True)
        if file is None:
            raise CheckpointError(f"{path}: the slot file vanished while it was mapped") from None
        return file
    except BaseException:
        mm.close()
        os.close(fd)
        raise
    return shm.SlotFile(path, fd, mm, size)


class _NoPopulate(Exception):
    """MADV_POPULATE_WRITE is not supported here."""


def _reserve_tail(fd: int, path: str, start: int, size: int) -> None:
    """Reserve the slot's pages past what the save wrote (slack, metadata room)."""
    try:
        os.posix_fallocate(fd, start, size - start)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise CapacityError(
                f"{path}: no room in /dev/shm to reserve the rest of this slot "
                f"({shm.fmt_bytes(shm.shm_free_bytes(os.path.dirname(path)))} free)"
            ) from exc
        raise
