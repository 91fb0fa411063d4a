"""A rank's first memory save without ``prepare()``: write one slot, reserve the rest later.

Reserving shared memory up front (``posix_fallocate`` of every slot, then mapping it populated)
costs a first touch of every page, twice the state with two slots, on the training thread. The
first save instead writes its slot with ``pwrite``: the kernel reserves exactly the pages written,
and a full /dev/shm fails that write with ENOSPC (a clear error, never a SIGBUS) before anything
is committed. A background thread then reserves and maps every slot at the size this save set,
the written slot first (its pages exist: mapping it is quick); a save that comes meanwhile copies
into that slot once it is mapped (``pwrite`` into existing tmpfs pages is 3x slower than a copy
into a populated mapping) while the fresh slots' first touch pauses. A save waits for the fresh
slots only when the written one is still being persisted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator

import torch

from dlrover_torch.checkpoint import shm
from dlrover_torch.checkpoint.errors import CapacityError
from dlrover_torch.checkpoint.layout import Layout
from dlrover_torch.checkpoint.map_behind import WriteProgress, map_behind

log = logging.getLogger(__name__)

MAX_IOV = 512  # buffers per pwritev call (the kernel's IOV_MAX is 1024)
PROGRESS_STEP_BYTES = 64 << 20  # written between two reports to the mapping thread


def _batch(pending: list[memoryview], limit: int | None) -> list[memoryview]:
    """The buffers of one pwritev call: at most MAX_IOV, and ``limit`` bytes when given."""
    if limit is None:
        return pending[:MAX_IOV]
    out: list[memoryview] = []
    room = limit
    for buf in pending[:MAX_IOV]:
        if len(buf) >= room:
            out.append(buf[:room])
            break
        out.append(buf)
        room -= len(buf)
    return out


def writable_by_pwrite(tensors: list[torch.Tensor]) -> bool:
    """Whether these tensors can be written straight from host memory (no device copies)."""
    return all(t.device.type == "cpu" and not t.is_sparse for t in tensors)


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order (a contiguous copy only when it is strided)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _pwrite_all(
    fd: int,
    path: str,
    buffers: list[memoryview],
    offset: int,
    progress: WriteProgress | None = None,
) -> None:
    """Write ``buffers`` back to back at ``offset``, telling ``progress`` after each
    ``PROGRESS_STEP_BYTES``; ENOSPC becomes a CapacityError."""
    pending = [b for b in buffers if len(b)]
    limit = PROGRESS_STEP_BYTES if progress is not None else None
    try:
        while pending:
            done = os.pwritev(fd, _batch(pending, limit), offset)
            if done <= 0:
                raise OSError(errno.ENOSPC, "pwritev wrote nothing")
            offset += done
            if progress is not None:
                progress.advance(offset)
            while done:  # drop what was written; a short write resumes mid-buffer
                head = pending[0]
                if done >= len(head):
                    done -= len(head)
                    pending.pop(0)
                else:
                    pending[0], done = head[done:], 0
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise CapacityError(
                f"{path}: /dev/shm filled up during the first checkpoint save "
                f"({shm.fmt_bytes(shm.shm_free_bytes(os.path.dirname(path)))} free now); nothing "
                "was committed. Enlarge it (docker run --shm-size, a Kubernetes emptyDir with "
                "medium: Memory and a sizeLimit) or use memory_slots=1"
            ) from exc
        raise


def write_slot(
    path: str,
    size: int,
    layout: Layout,
    tensors: list[torch.Tensor],
    header: shm.SlotHeader,
    meta: bytes,
    progress: WriteProgress | None = None,
) -> None:
    """Create slot file ``path`` of ``size`` bytes (sparse) and commit one save into it,
    telling ``progress`` how far the written bytes go (and, at the end, whether it worked)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # readers (the agent's persister) wait for the commit
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, size)
        writing = shm.SlotHeader(shm.STATE_WRITING, 0, -1, 0, 0, 0, 0, 0, 0, 0)
        os.pwrite(fd, writing.pack(), 0)
        if progress is not None:
            progress.advance(shm.HEADER_BYTES)
        runs: list[tuple[int, list[memoryview]]] = []  # contiguous extents, written together
        for ext, tensor in zip(layout.extents, tensors, strict=True):
            if not ext.nbytes:
                continue
            offset = shm.HEADER_BYTES + ext.offset
            buf = _host_bytes(tensor)
            last = runs[-1] if runs else None
            if last is not None and last[0] + sum(len(b) for b in last[1]) == offset:
                last[1].append(buf)
            else:
                runs.append((offset, [buf]))
        for offset, buffers in runs:
            _pwrite_all(fd, path, buffers, offset, progress)
        _pwrite_all(fd, path, [memoryview(meta)], header.meta_off, progress)
        header.meta_len = len(meta)
        header.meta_crc = zlib.crc32(meta)
        committed = header.state
        header.state = shm.STATE_WRITING
        os.pwrite(fd, header.pack(), 0)
        os.pwrite(fd, struct.pack("<I", committed), 8)  # the state flips last
    except BaseException:
        os.ftruncate(fd, 0)  # an empty file is never loaded
        if progress is not None:
            progress.finish(ok=False)
        raise
    finally:
        os.close(fd)  # also releases the lock
    if progress is not None:
        progress.finish(ok=True)


class SlotReservation:
    """Reserves and maps every slot of a rank in a background thread, the written slot first;
    a save may copy into a slot already mapped, and pauses the rest meanwhile."""

    def __init__(self, paths: list[str], size: int, written: int, progress: WriteProgress) -> None:
        self.paths = paths
        self.size = size
        self.written = written  # the slot the first save writes (its pages partly exist)
        self.progress = progress  # that save's writes
        self._mapped: dict[int, shm.SlotFile] = {}
        self._files: list[shm.SlotFile] | None = None
        self._error: BaseException | None = None
        self._may_touch = threading.Event()  # cleared while a save copies
        self._may_touch.set()
        self._written_mapped = threading.Event()  # set once the written slot is (or failed)
        self._thread = threading.Thread(target=self._run, name="ckpt-reserve", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        order = [self.written] + [i for i in range(len(self.paths)) if i != self.written]
        try:
            for i in order:
                if i == self.written:
                    file = map_behind(self.paths[i], self.size, self.progress)
                else:
                    file = shm.SlotFile.create(self.paths[i], self.size, gate=self._may_touch)
                self._mapped[i] = file
                if i == self.written:
                    self._written_mapped.set()
        except BaseException as exc:
            # The written slot may be in use by a save already: its owner closes it.
            for i, f in self._mapped.items():
                if i != self.written:
                    f.close()
            self._mapped = {i: f for i, f in self._mapped.items() if i == self.written}
            self._error = exc
            self._written_mapped.set()
            return
        self._files = [self._mapped[i] for i in range(len(self.paths))]
        log.info(
            "reserved %d shm slot(s) of %s in the background in %.3f s",
            len(self._files),
            shm.fmt_bytes(self.size),
            time.monotonic() - started,
        )

    def done(self) -> bool:
        """Whether the thread finished (successfully or not)."""
        return not self._thread.is_alive()

    def mapped(self, index: int) -> shm.SlotFile | None:
        """Slot ``index`` if it is already reserved and mapped (the thread keeps it)."""
        return self._mapped.get(index)

    def written_slot(self) -> shm.SlotFile | None:
        """Wait until the written slot is mapped (a fraction of a second: its pages exist);
        None if the reservation failed before."""
        self._written_mapped.wait()
        return self._mapped.get(self.written)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stop touching fresh memory while the caller copies a save (shared bandwidth)."""
        self._may_touch.clear()
        try:
            yield
        finally:
            self._may_touch.set()

    def abandon(self) -> None:
        """The first save failed: let the thread end (it maps nothing, creates no slot)."""
        self._may_touch.set()
        self._thread.join()
        written = self._mapped.pop(self.written, None)
        if written is not None:
            written.close()

    def result(self) -> list[shm.SlotFile]:
        """Wait for the thread; the mapped slot files, or the error it met."""
        self._may_touch.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._files is not None
        return self._files
