"""Shared-memory slot files under /dev/shm: a header with a commit flag, a data region, metadata.

A slot is a plain file in /dev/shm named from a stable key, so a restarted worker re-attaches to
it. Its pages are reserved with ``posix_fallocate`` (a full /dev/shm fails here with a clear
error instead of a SIGBUS later) and mapped with ``MAP_POPULATE`` (no page faults during a save).
Writers hold an exclusive ``flock`` while writing and readers a shared one; the header's ``state``
is set to COMMITTED only after data and metadata are complete, so a half-written slot is never
loaded. This module does not import torch: the persister uses it too.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass

from dlrover_torch.checkpoint.errors import CapacityError, CheckpointError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MAGIC = b"DLRFCKP1"
HEADER_BYTES = 4096
PAGE_BYTES = 4096
STATE_EMPTY = 0
STATE_WRITING = 1
STATE_COMMITTED = 2

# magic, state, reserved, seq, step, data_len, meta_off, meta_len, meta_crc, rank, world, saved_ns
POPULATE_STEP_BYTES = 16 << 20
RESERVE_STEP_BYTES = 256 << 20  # a background reservation's fallocate, between pauses
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14

_HEADER = struct.Struct("<8sIIQqQQQIiiq")
_STATE_OFFSET = 8


def page_align(value: int) -> int:
    """Round up to a whole page."""
    return (value + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


@dataclass
class SlotHeader:
    """The fixed header of a slot (and of a persisted flash file)."""

    state: int
    seq: int
    step: int
    data_len: int
    meta_off: int
    meta_len: int
    meta_crc: int
    rank: int
    world: int
    saved_ns: int

    def pack(self) -> bytes:
        """Binary form (``_HEADER.size`` bytes)."""
        return _HEADER.pack(
            MAGIC,
            self.state,
            0,
            self.seq,
            self.step,
            self.data_len,
            self.meta_off,
            self.meta_len,
            self.meta_crc,
            self.rank,
            self.world,
            self.saved_ns,
        )

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> SlotHeader | None:
        """Parse a header; None when the magic is missing (an empty or foreign file)."""
        if len(raw) < _HEADER.size:
            return None
        fields = _HEADER.unpack_from(raw, 0)
        if fields[0] != MAGIC:
            return None
        return cls(fields[1], *fields[3:])


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class SlotFile:
    """One mapped slot file; use ``create`` (writer) or ``open`` (reader)."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, size: int) -> None:
        self.path = path
        self.fd = fd
        self.mm = mm
        self.size = size

    @classmethod
    def create(cls, path: str, size: int, gate: threading.Event | None = None) -> SlotFile:
        """Open or create ``path`` with at least ``size`` bytes reserved and mapped; the first
        touch of fresh pages waits for ``gate`` to be set between steps (a background
        reservation pauses while a save copies)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            current = os.fstat(fd).st_size
            size = max(size, current)
            if size > current:
                _reserve(fd, path, current, size, gate)
                _first_touch(fd, current, size, gate)
            mm = _map_populated(fd, size, writable=True)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, size)

    @classmethod
    def open(cls, path: str, writable: bool = False) -> SlotFile | None:
        """Map an existing slot file; None when it does not exist or is empty."""
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            return None
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            os.close(fd)
            return None
        try:
            mm = _map_populated(fd, size, writable)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, size)

    # Locks: flock is released by the kernel when a process dies, so a crash never wedges a slot.
    def try_lock(self, exclusive: bool) -> bool:
        """Take the slot's lock without waiting; False when another process holds it."""
        return _try_lock_fd(self.fd, exclusive)

    def lock(self, exclusive: bool, timeout: float | None = None) -> bool:
        """Take the slot's lock, waiting up to ``timeout`` seconds (None: forever)."""
        return _lock_fd(self.fd, exclusive, timeout)

    def unlock(self) -> None:
        """Release the lock."""
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def header(self) -> SlotHeader | None:
        """The current header, or None for an uninitialised slot."""
        return SlotHeader.unpack(self.mm[: _HEADER.size])

    def begin_write(self) -> None:
        """Mark the slot as being written: from now on it is not loadable."""
        if self.header() is None:
            self.mm[: _HEADER.size] = SlotHeader(STATE_WRITING, 0, -1, 0, 0, 0, 0, 0, 0, 0).pack()
        struct.pack_into("<I", self.mm, _STATE_OFFSET, STATE_WRITING)

    def commit(self, header: SlotHeader, meta: bytes) -> None:
        """Write metadata and header, then flip the state to COMMITTED last."""
        end = header.meta_off + len(meta)
        if end > self.size:
            raise CheckpointError(f"{self.path}: metadata does not fit ({end} > {self.size})")
        self.mm[header.meta_off : end] = meta
        header.meta_len = len(meta)
        header.meta_crc = zlib.crc32(meta)
        header.state = STATE_WRITING
        self.mm[: _HEADER.size] = header.pack()
        struct.pack_into("<I", self.mm, _STATE_OFFSET, STATE_COMMITTED)

    def meta(self, header: SlotHeader) -> bytes:
        """The metadata bytes of a committed slot, checked against their CRC."""
        end = header.meta_off + header.meta_len
        if end > self.size:
            raise CheckpointError(f"{self.path}: metadata extends past the end of the slot")
        raw = bytes(self.mm[header.meta_off : end])
        if zlib.crc32(raw) != header.meta_crc:
            raise CheckpointError(f"{self.path}: metadata checksum mismatch")
        return raw

    def close(self) -> None:
        """Unmap and close; callers must have dropped their views of ``mm`` first."""
        try:
            self.mm.close()
        except BufferError:
            log.debug("%s: views still exported; leaving the mapping to the GC", self.path)
        os.close(self.fd)


def _map_populated(fd: int, size: int, writable: bool) -> mmap.mmap:
    """Map ``fd`` with every page present (no faults during a save)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)


def populate(mm: mmap.mmap, start: int, length: int) -> bool:
    """Fault in pages ``[start, start + length)`` of ``mm`` for writing (``start`` page-aligned);
    False on a kernel without MADV_POPULATE_WRITE (before Linux 5.14)."""
    try:
        mm.madvise(MADV_POPULATE_WRITE, start, length)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    return True


def _first_touch(fd: int, start: int, end: int, gate: threading.Event | None = None) -> None:
    """Write zeros over fresh pages in 16 MiB steps, before they are mapped.

    The first touch of fresh shm takes seconds per GiB on a VM; done by ``MAP_POPULATE`` it holds
    the process's mmap lock all that time, stalling the training thread's allocations (and a
    save running beside a background reservation). ``pwrite`` takes no mmap lock, so the
    ``MAP_POPULATE`` that follows only maps pages that exist.
    """
    zeros = bytes(POPULATE_STEP_BYTES)
    offset = start
    while offset < end:
        if gate is not None:
            gate.wait()
        offset += os.pwrite(fd, memoryview(zeros)[: min(POPULATE_STEP_BYTES, end - offset)], offset)


def _try_lock_fd(fd: int, exclusive: bool) -> bool:
    op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    try:
        fcntl.flock(fd, op)
        return True
    except BlockingIOError:
        return False


def _lock_fd(fd: int, exclusive: bool, timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while not _try_lock_fd(fd, exclusive):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay)  # flock has no timed wait; back off up to 50 ms
        delay = min(delay * 2, 0.05)
    return True


def peek(path: str, timeout: float) -> tuple[SlotHeader, bytes | None] | None:
    """Header (and metadata, if committed) of a slot file without mapping its data.

    None when the file is missing, uninitialised, or stays write-locked for ``timeout``.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if not _lock_fd(fd, False, timeout):
            return None
        header = SlotHeader.unpack(os.pread(fd, _HEADER.size, 0))
        if header is None or header.state != STATE_COMMITTED:
            return (header, None) if header is not None else None
        meta = os.pread(fd, header.meta_len, header.meta_off)
        if len(meta) != header.meta_len or zlib.crc32(meta) != header.meta_crc:
            raise CheckpointError(f"{path}: metadata checksum mismatch")
        return header, meta
    finally:
        os.close(fd)  # also drops the lock


def _reserve(
    fd: int, path: str, current: int, size: int, gate: threading.Event | None = None
) -> None:
    """Grow ``fd`` to ``size`` with real pages, or fail with a message naming the shortfall;
    with a ``gate``, in steps that wait for it."""
    needed = size - current
    free = shm_free_bytes(os.path.dirname(path))
    if needed > free:
        raise CapacityError(_capacity_message(path, needed, free))
    step = needed if gate is None else RESERVE_STEP_BYTES
    try:
        offset = current
        while offset < size:
            if gate is not None:
                gate.wait()
            length = min(step, size - offset)
            os.posix_fallocate(fd, offset, length)
            offset += length
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            os.ftruncate(fd, current)
            raise CapacityError(_capacity_message(path, needed, shm_free_bytes())) from exc
        raise


def _capacity_message(path: str, needed: int, free: int) -> str:
    return (
        f"flash checkpoint needs {fmt_bytes(needed)} more in {os.path.dirname(path)} for "
        f"{os.path.basename(path)} but only {fmt_bytes(free)} is free; enlarge it (docker run "
        "--shm-size, a Kubernetes emptyDir with medium: Memory and a sizeLimit, or "
        "mount -o remount,size=... /dev/shm), or use memory_slots=1, or save to disk only"
    )


def fmt_bytes(n: int) -> str:
    """Human-readable size, e.g. ``1.50 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} GiB"  # pragma: no cover


def unlink_quietly(path: str) -> None:
    """Remove a slot file if it exists."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def slot_paths(namespace: str, directory: str = SHM_DIR) -> list[str]:
    """Every slot file of ``namespace`` (all ranks, all slots)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    prefix = namespace + "-r"
    return sorted(
        os.path.join(directory, n)
        for n in names
        if n.startswith(prefix) and not n.endswith(".lease")  # the owner's lease, not a slot
    )


def slot_path(namespace: str, rank: int, slot: int, directory: str = SHM_DIR) -> str:
    """The file of one slot of one rank."""
    return os.path.join(directory, f"{namespace}-r{rank:05d}-s{slot}")
