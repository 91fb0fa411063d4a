"""One rank's memory checkpoints: a few shm slots, written by copy and read back exactly."""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dlrover_torch.checkpoint import shm
from dlrover_torch.checkpoint.errors import CheckpointError
from dlrover_torch.checkpoint.first_save import SlotReservation, writable_by_pwrite, write_slot
from dlrover_torch.checkpoint.layout import (
    Layout,
    TensorExtent,
    decode_meta,
    dtype_from_name,
    rebuild,
    tensor_view,
)
from dlrover_torch.checkpoint.map_behind import WriteProgress

log = logging.getLogger(__name__)

DATA_SLACK_BYTES = 1 << 20  # room for small growth (e.g. a longer string) without remapping
MIN_META_BYTES = 1 << 20


class HostBuffer:
    """Fresh anonymous memory that restored tensors live in.

    Each restored tensor gets its own storage over its part of the mapping (storage offset 0,
    like a tensor torch.load returns: some torch APIs, e.g. ``torch.set_rng_state``, ignore a
    view's offset). Transparent huge pages were tried: 4x faster first touch on an idle
    machine, but 2-10x slower than normal pages under memory pressure here, so they are not
    requested.
    """

    def __init__(self, nbytes: int) -> None:
        self.mm: mmap.mmap | None = None
        if nbytes == 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            return
        self.mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)  # keeps the mapping alive

    def leaf(self, base: int) -> Callable[[int, TensorExtent], torch.Tensor]:
        """A ``rebuild`` leaf factory for extents stored from byte ``base`` of this buffer."""

        def make(_index: int, ext: TensorExtent) -> torch.Tensor:
            dtype = dtype_from_name(ext.dtype)
            numel = math.prod(ext.shape)
            if numel == 0 or self.mm is None:
                return torch.empty(ext.shape, dtype=dtype)
            flat = torch.frombuffer(self.mm, dtype=dtype, count=numel, offset=base + ext.offset)
            return flat.view(ext.shape)

        return make


@dataclass
class MemoryCopy:
    """A committed memory checkpoint of this rank."""

    index: int
    header: shm.SlotHeader
    doc: dict[str, Any]
    layout: Layout


class _Slot:
    """A mapped slot plus a torch view of its data region."""

    def __init__(self, file: shm.SlotFile) -> None:
        self.file = file
        self.full = torch.frombuffer(file.mm, dtype=torch.uint8)
        self.pinned = False

    @property
    def data_capacity(self) -> int:
        header = self.file.header()
        return (header.meta_off - shm.HEADER_BYTES) if header and header.meta_off else 0

    def region(self, data_cap: int) -> torch.Tensor:
        return self.full[shm.HEADER_BYTES : shm.HEADER_BYTES + data_cap]

    def close(self) -> None:
        if self.pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.full.data_ptr())
            except Exception:  # pragma: no cover - GPU only
                log.debug("cudaHostUnregister failed", exc_info=True)
        del self.full
        self.file.close()


class MemoryStore:
    """The shm slots of one rank under ``namespace``; slots are reused across saves."""

    def __init__(
        self, namespace: str, rank: int, world: int, slots: int, directory: str = shm.SHM_DIR
    ) -> None:
        if slots < 1:
            raise ValueError(f"memory_slots={slots}: need at least 1 (2 lets persists overlap)")
        self.namespace = namespace
        self.rank = rank
        self.world = world
        self.directory = directory
        self.paths = [shm.slot_path(namespace, rank, i, directory) for i in range(slots)]
        self._slots: list[_Slot | None] = [None] * slots
        self._data_cap = 0
        self._meta_cap = 0
        self.seq = 0
        self.latest_index: int | None = None
        # "auto": commit in a thread only when device copies must finish; "always": tests.
        self.async_commit = "auto"
        self._commit_thread: threading.Thread | None = None
        self._commit_index: int | None = None
        self._commit_error: BaseException | None = None
        self._reservation: SlotReservation | None = None  # after a first save without prepare

    # ---- attach / allocate -------------------------------------------------------------
    def attach_existing(self) -> None:
        """Map slot files left by a previous incarnation of this rank (a restart)."""
        for i, path in enumerate(self.paths):
            if self._slots[i] is None:
                file = shm.SlotFile.open(path, writable=True)
                if file is not None:
                    self._slots[i] = _Slot(file)
                    header = file.header()
                    if header is not None:
                        self.seq = max(self.seq, header.seq)
                        self._data_cap = max(self._data_cap, header.meta_off - shm.HEADER_BYTES)

    def bytes_needed(self, data_bytes: int, meta_bytes: int) -> int:
        """Shared memory the slots need in total for a state of this size."""
        data_cap, meta_cap = self._caps(data_bytes, meta_bytes)
        return len(self.paths) * (shm.HEADER_BYTES + data_cap + meta_cap)

    def _caps(self, data_bytes: int, meta_bytes: int) -> tuple[int, int]:
        data_cap = shm.page_align(data_bytes + DATA_SLACK_BYTES)
        meta_cap = max(MIN_META_BYTES, shm.page_align(2 * meta_bytes))
        return data_cap, meta_cap

    def ensure_needed(self, data_bytes: int, meta_bytes: int) -> bool:
        """True when the slots must be mapped or grown before a save of this size (waits for a
        background reservation first, raising what it met, e.g. a full /dev/shm)."""
        self._settle_reservation()
        fits = data_bytes <= self._data_cap and meta_bytes <= self._meta_cap
        return not (fits and all(self._slots))

    def reserved_bytes(self) -> int:
        """Bytes this rank's slot files already hold in /dev/shm."""
        total = 0
        for path in self.paths:
            try:
                total += os.stat(path).st_size
            except FileNotFoundError:
                pass
        return total

    def ensure(self, data_bytes: int, meta_bytes: int) -> bool:
        """Make every slot big enough (reserving and pre-touching pages); True if it grew."""
        if not self.ensure_needed(data_bytes, meta_bytes):
            return False
        self.attach_existing()
        data_cap, meta_cap = self._caps(data_bytes, meta_bytes)
        data_cap = max(data_cap, self._data_cap)
        grew = False
        started = time.monotonic()
        for i, path in enumerate(self.paths):
            slot = self._slots[i]
            size = shm.HEADER_BYTES + data_cap + meta_cap
            if slot is not None and slot.file.size >= size and slot.data_capacity >= data_bytes:
                continue
            if slot is not None:
                slot.close()
                self._slots[i] = None
            self._slots[i] = _Slot(shm.SlotFile.create(path, size))
            grew = True
        self._data_cap, self._meta_cap = data_cap, meta_cap
        if grew:
            log.info(
                "reserved %d shm slot(s) of %s for rank %d in %.3f s",
                len(self.paths),
                shm.fmt_bytes(shm.HEADER_BYTES + data_cap + meta_cap),
                self.rank,
                time.monotonic() - started,
            )
        return grew

    def _settle_reservation(self) -> None:
        """Take over the slots a background reservation mapped; raise the error it met."""
        reservation, self._reservation = self._reservation, None
        if reservation is None:
            return
        try:
            files = reservation.result()
        except BaseException:
            written = reservation.mapped(reservation.written)
            slot = self._slots[reservation.written]
            if written is not None and (slot is None or slot.file is not written):
                written.close()
            raise
        for i, file in enumerate(files):
            slot = self._slots[i]
            if slot is not None and slot.file is file:  # adopted by a save meanwhile
                continue
            if slot is not None:
                slot.close()
            self._slots[i] = _Slot(file)

    # ---- first save without prepare() ---------------------------------------------------
    def first_save_possible(self, tensors: list[torch.Tensor]) -> bool:
        """Whether this is the rank's first save (no slot exists) with host tensors only."""
        return (
            self._reservation is None
            and not any(self._slots)
            and not any(os.path.exists(p) for p in self.paths)
            and writable_by_pwrite(tensors)
        )

    def write_first(
        self, layout: Layout, tensors: list[torch.Tensor], meta: bytes, step: int
    ) -> tuple[int, int]:
        """Write and commit slot 0 by ``pwrite`` (reserving only what it writes) while a thread
        maps it behind the writes, then reserves and maps the other slots; returns ``(slot
        index, seq)``."""
        data_cap, meta_cap = self._caps(layout.data_bytes, len(meta))
        size = shm.HEADER_BYTES + data_cap + meta_cap
        header = self._header(layout, step, data_cap)
        header.seq = self.seq + 1
        progress = WriteProgress()
        reservation = SlotReservation(self.paths, size, written=0, progress=progress)
        try:
            write_slot(self.paths[0], size, layout, tensors, header, meta, progress)
        except BaseException:
            progress.finish(ok=False)  # also when the write never began
            reservation.abandon()
            raise
        self.seq += 1
        self._data_cap, self._meta_cap = data_cap, meta_cap
        self.latest_index = 0
        self._reservation = reservation
        return 0, self.seq

    def rewrite_first(
        self,
        layout: Layout,
        tensors: list[torch.Tensor],
        meta: bytes,
        step: int,
        avoid: Iterable[int],
    ) -> tuple[int, int] | None:
        """A save that comes while the background reservation still runs: copy into the first
        save's slot once it is mapped (its pages exist) instead of waiting for fresh memory.

        None (nothing written) when that is not possible: the reservation is done, the state
        grew, a tensor is on a device, a persist of that slot is pending, or a reader holds it.
        """
        reservation = self._reservation
        index = reservation.written if reservation is not None else None
        if (
            reservation is None
            or reservation.done()
            or index is None
            or index in set(avoid)
            or layout.data_bytes > self._data_cap
            or len(meta) > self._meta_cap
            or not writable_by_pwrite(tensors)
        ):
            return None
        with reservation.paused():
            mapped = reservation.written_slot()
            if mapped is None:  # it failed: the caller's ensure raises what it met
                return None
            return self._write_adopted(index, mapped, layout, tensors, meta, step)

    def _write_adopted(
        self,
        index: int,
        file: shm.SlotFile,
        layout: Layout,
        tensors: list[torch.Tensor],
        meta: bytes,
        step: int,
    ) -> tuple[int, int] | None:
        """Save into slot ``index`` mapped by the running reservation (adopted now, kept when
        the reservation is settled); None when a reader holds it."""
        slot = self._slots[index]
        if slot is None or slot.file is not file:
            self._slots[index] = _Slot(file)
        if not file.try_lock(exclusive=True):
            return None
        seq = self.write(index, layout, tensors, meta, step)
        self.flush()  # committed before the caller hands the slot to a persist
        return index, seq

    def _header(self, layout: Layout, step: int, data_cap: int) -> shm.SlotHeader:
        return shm.SlotHeader(
            shm.STATE_COMMITTED,
            self.seq,
            step,
            layout.data_bytes,
            shm.HEADER_BYTES + data_cap,
            0,
            0,
            self.rank,
            self.world,
            time.time_ns(),
        )

    # ---- write -------------------------------------------------------------------------
    def acquire(self, avoid: Iterable[int]) -> int | None:
        """Lock a slot for writing; never the latest committed one if another is free."""
        avoid = set(avoid)
        order = [i for i in range(len(self.paths)) if i not in avoid and i != self.latest_index]
        if self.latest_index is not None and self.latest_index not in avoid:
            order.append(self.latest_index)
        for i in order:
            slot = self._slots[i]
            if slot is not None and slot.file.try_lock(exclusive=True):
                return i
        return None

    def write(
        self,
        index: int,
        layout: Layout,
        tensors: list[torch.Tensor],
        meta: bytes,
        step: int,
        on_commit: Callable[[int], None] | None = None,
    ) -> int:
        """Copy ``tensors`` into locked slot ``index`` and commit it; return the save's seq.

        Host tensors are copied before this returns. Device tensors are copied asynchronously
        into pinned shm on the current CUDA stream (kernels queued after them, e.g. the next
        optimizer step, run after the copies); a thread commits the slot once they are done,
        so the next training step overlaps the device-to-host copy. ``on_commit(seq)`` runs
        after the commit either way; ``flush`` waits for it.
        """
        self.flush()
        slot = self._slots[index]
        assert slot is not None
        handed_off = False
        try:
            slot.file.begin_write()
            region = slot.region(self._data_cap)
            cuda = any(t.is_cuda for t in tensors)
            if cuda:
                self._pin(slot)
            with torch.no_grad():
                for ext, tensor in zip(layout.extents, tensors, strict=True):
                    if ext.nbytes:
                        tensor_view(region, ext).copy_(tensor.detach(), non_blocking=cuda)
            self.seq += 1
            header = self._header(layout, step, self._data_cap)
            done: Any = None
            if cuda:
                done = torch.cuda.Event()
                done.record()
            if cuda or self.async_commit == "always":
                self._commit_thread = threading.Thread(
                    target=self._finish,
                    args=(slot, index, header, meta, done, on_commit),
                    name="ckpt-commit",
                    daemon=True,
                )
                self._commit_index = index
                self._commit_thread.start()
                handed_off = True
                return self.seq
            slot.file.commit(header, meta)
            self.latest_index = index
        finally:
            if not handed_off:
                slot.file.unlock()
        if on_commit is not None:
            on_commit(self.seq)
        return self.seq

    def _finish(
        self,
        slot: _Slot,
        index: int,
        header: shm.SlotHeader,
        meta: bytes,
        done: Any,
        on_commit: Callable[[int], None] | None,
    ) -> None:
        """Commit thread: wait for the device copies, commit, release, report."""
        try:
            if done is not None:
                done.synchronize()
            slot.file.commit(header, meta)
            self.latest_index = index
            slot.file.unlock()
            if on_commit is not None:
                on_commit(header.seq)
        except BaseException as exc:  # surfaced by flush() on the training thread
            self._commit_error = exc
            slot.file.unlock()

    def flush(self) -> None:
        """Wait for an asynchronous commit; raise if it failed."""
        thread, self._commit_thread = self._commit_thread, None
        if thread is not None:
            thread.join()
        self._commit_index = None
        if self._commit_error is not None:
            error, self._commit_error = self._commit_error, None
            raise CheckpointError(f"committing a memory checkpoint failed: {error}") from error

    def _pin(self, slot: _Slot) -> None:
        """Register the slot as pinned host memory so device-to-host copies run async."""
        if slot.pinned or not torch.cuda.is_available():
            return
        err = torch.cuda.cudart().cudaHostRegister(slot.full.data_ptr(), slot.full.numel(), 0)
        slot.pinned = int(err) == 0
        if not slot.pinned:
            log.warning("cudaHostRegister of %s failed (%s); copies stay synchronous", slot, err)

    # ---- read --------------------------------------------------------------------------
    def latest(self) -> MemoryCopy | None:
        """The newest committed memory checkpoint saved by this rank in a world of this size.

        Reads headers without mapping the slots (a restarted process maps only the one slot it
        restores from, so restoring does not pay for populating the others).
        """
        self.flush()
        best: MemoryCopy | None = None
        for i, path in enumerate(self.paths):
            try:
                found = shm.peek(path, timeout=5.0)
            except CheckpointError as exc:
                log.error("memory checkpoint in %s is unreadable: %s", path, exc)
                continue
            if found is None:
                continue
            header, meta = found
            self.seq = max(self.seq, header.seq)  # later saves continue the sequence
            if (
                meta is None
                or header.rank != self.rank
                or header.world != self.world
                or (best is not None and header.seq <= best.header.seq)
            ):
                continue
            try:
                layout, doc = decode_meta(meta)
            except CheckpointError as exc:
                log.error("memory checkpoint in %s is unreadable: %s", path, exc)
                continue
            best = MemoryCopy(i, header, doc, layout)
        if best is not None:
            self.latest_index = best.index
        return best

    def read(self, copy: MemoryCopy) -> Any:
        """Copy a memory checkpoint out of shm and rebuild its state dict."""
        self._settle_reservation()
        slot = self._slots[copy.index]
        if slot is None:
            file = shm.SlotFile.open(self.paths[copy.index], writable=True)
            if file is None:
                raise CheckpointError(f"{self.paths[copy.index]}: vanished while loading")
            slot = self._slots[copy.index] = _Slot(file)
        if not slot.file.lock(exclusive=False, timeout=30.0):
            raise CheckpointError(f"{slot.file.path}: still locked by a writer after 30 s")
        try:
            header = slot.file.header()
            if header is None or header.seq != copy.header.seq:
                raise CheckpointError(f"{slot.file.path}: overwritten while loading; load again")
            buf = HostBuffer(copy.layout.data_bytes)
            start = shm.HEADER_BYTES
            buf.tensor.copy_(slot.full[start : start + copy.layout.data_bytes])
        finally:
            slot.file.unlock()
        tree = rebuild(copy.layout, buf.leaf(0))
        del buf.tensor  # the restored tensors keep the mapping alive, nothing else
        return tree

    def close(self, unlink: bool) -> None:
        """Unmap the slots; ``unlink`` also removes the files (the memory copy is gone)."""
        try:
            self.flush()
        except CheckpointError:
            log.exception("the last memory checkpoint did not commit")
        try:
            self._settle_reservation()
        except CheckpointError as exc:
            log.warning("reserving shared memory in the background failed: %s", exc)
        for i, slot in enumerate(self._slots):
            if slot is not None:
                slot.close()
                self._slots[i] = None
        if unlink:
            for path in self.paths:
                shm.unlink_quietly(path)
