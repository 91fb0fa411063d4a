"""Persist one committed shared-memory slot to disk: write, checksum, rename, then commit.

Runs in the node agent (dlrover-run) or in the checkpointer's own background process, never in
the training loop. It holds a shared lock on the slot while reading it, so the worker writes its
next save into another slot. torch is imported only for the DCP (sharded) format.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import mmap
import os
import pickle
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dlrover_torch.checkpoint import shm, storage
from dlrover_torch.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

SLOT_LOCK_TIMEOUT_S = 30.0


@dataclass
class PersistResult:
    """What happened to one persist request."""

    ok: bool
    step: int = -1
    rank: int = -1
    error: str = ""
    skipped: str = ""
    committed: bool = False  # this rank's files landed and the step became the tracker's
    seconds: float = 0.0
    bytes_written: int = 0
    cpu_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """JSON form for the wire."""
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra


def read_slot_config(slot: shm.SlotFile) -> tuple[shm.SlotHeader, dict[str, Any]] | None:
    """Header and metadata document of a committed slot; None if not committed."""
    header = slot.header()
    if header is None or header.state != shm.STATE_COMMITTED:
        return None
    return header, json.loads(slot.meta(header))


def persist_slot(
    slot_path: str,
    expect_seq: int | None = None,
    crc_pool: ThreadPoolExecutor | None = None,
    lock_timeout: float = SLOT_LOCK_TIMEOUT_S,
) -> PersistResult:
    """Persist the slot at ``slot_path`` (if it still holds save ``expect_seq``)."""
    started, cpu0 = time.monotonic(), time.process_time()
    slot = shm.SlotFile.open(slot_path)
    if slot is None:
        return PersistResult(False, error=f"{slot_path}: the shared-memory slot does not exist")
    try:
        if not slot.lock(exclusive=False, timeout=lock_timeout):
            return PersistResult(False, error=f"{slot_path}: slot stayed locked {lock_timeout} s")
        try:
            found = read_slot_config(slot)
            if found is None:
                return PersistResult(False, error=f"{slot_path}: no committed checkpoint in slot")
            header, doc = found
            if expect_seq is not None and header.seq != expect_seq:
                return PersistResult(
                    True,
                    header.step,
                    header.rank,
                    skipped=f"slot now holds a newer save (step {header.step}); "
                    "that save is persisted when requested",
                )
            result = _persist_locked(slot, header, doc, crc_pool)
        finally:
            slot.unlock()
    except Exception as exc:  # reported to the worker, never swallowed
        log.exception("persisting %s failed", slot_path)
        result = PersistResult(False, error=f"{type(exc).__name__}: {exc}")
    finally:
        slot.close()
    result.seconds = time.monotonic() - started
    result.cpu_seconds = time.process_time() - cpu0
    return result


def _persist_locked(
    slot: shm.SlotFile, header: shm.SlotHeader, doc: dict[str, Any], crc_pool: Any
) -> PersistResult:
    cfg = doc["persist"]
    root, step, rank = cfg["dir"], header.step, header.rank
    if rank not in cfg["writers"]:
        return PersistResult(True, step, rank, skipped=f"rank {rank} is not a writer")
    directory = storage.step_dir(root, step)
    manifest_path = os.path.join(directory, storage.manifest_name(rank))
    previous = storage.read_json(manifest_path) if os.path.exists(manifest_path) else None
    if previous is not None and previous.get("seq") == header.seq:
        committed = commit_if_complete(root, step, cfg.get("keep_latest"))
        return PersistResult(True, step, rank, skipped="already persisted", committed=committed)
    os.makedirs(directory, exist_ok=True)
    if cfg.get("format", "flash") == "dcp":
        files, extra = _write_dcp_rank(slot, header, doc, directory, crc_pool)
    else:
        files, extra = _write_flash(slot, header, directory, crc_pool), {}
    storage.fsync_dir(directory)
    manifest = {
        "format": cfg.get("format", "flash"),
        "step": step,
        "rank": rank,
        "world": header.world,
        "writers": cfg["writers"],
        "seq": header.seq,
        "files": {name: d.to_json() for name, d in files.items()},
        **extra,
    }
    storage.write_json_durable(manifest_path, manifest)
    committed = commit_if_complete(root, step, cfg.get("keep_latest"))
    written = sum(d.size for d in files.values())
    return PersistResult(True, step, rank, committed=committed, bytes_written=written)


def _write_flash(
    slot: shm.SlotFile, header: shm.SlotHeader, directory: str, crc_pool: Any
) -> dict[str, storage.FileDigest]:
    """Copy header, data and metadata of the slot into ``rank-R.flash``, page by page.

    Every piece is whole pages at page-aligned addresses (the data straight from the shm
    mapping, header and metadata from an anonymous page-aligned buffer), so the file can be
    written with O_DIRECT.
    """
    meta = slot.meta(header)
    data_pages = shm.page_align(header.data_len)
    meta_off = shm.HEADER_BYTES + data_pages
    file_header = shm.SlotHeader(**{**header.__dict__, "meta_off": meta_off})
    if shm.HEADER_BYTES + data_pages > slot.size:
        raise CheckpointError(f"{slot.path}: data extends past the end of the slot")
    meta_pages = shm.page_align(len(meta))
    aligned = mmap.mmap(-1, shm.HEADER_BYTES + meta_pages)  # page-aligned, zero-filled
    try:
        aligned[: len(file_header.pack())] = file_header.pack()
        aligned[shm.HEADER_BYTES : shm.HEADER_BYTES + len(meta)] = meta
        name = storage.flash_file_name(header.rank)
        with memoryview(slot.mm) as view, memoryview(aligned) as small:
            pieces = [
                small[: shm.HEADER_BYTES],
                view[shm.HEADER_BYTES : shm.HEADER_BYTES + data_pages],
                small[shm.HEADER_BYTES :],
            ]
            try:
                digest = storage.write_durable(
                    os.path.join(directory, name), pieces, crc_pool, direct=True
                )
            finally:
                for piece in pieces:
                    piece.release()
    finally:
        aligned.close()
    return {name: digest}


class _CrcFile(io.RawIOBase):
    """A write-only file that records the CRC32 of each 64 MiB chunk of what passes through."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0
        self.crcs: list[int] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        for index, sub in storage._split([data], storage.CHUNK_BYTES):
            index += self.pos // storage.CHUNK_BYTES
            running = self.crcs[index] if index < len(self.crcs) else 0
            crc = zlib.crc32(sub, running)
            if index < len(self.crcs):
                self.crcs[index] = crc
            else:
                self.crcs.append(crc)
            storage._write_all(self.fd, sub)
            self.pos += len(sub)
        return len(memoryview(data).cast("B"))

    def tell(self) -> int:
        return self.pos

    def finish(self) -> storage.FileDigest:
        os.fdatasync(self.fd)
        os.close(self.fd)
        return storage.FileDigest(self.pos, self.crcs, storage.CHUNK_BYTES)


def _write_dcp_rank(
    slot: shm.SlotFile, header: shm.SlotHeader, doc: dict[str, Any], directory: str, pool: Any
) -> tuple[dict[str, storage.FileDigest], dict[str, Any]]:
    """Write this rank's items as ``__R_0.distcp`` in the layout torch DCP reads."""
    import torch

    name = f"__{header.rank}_0.distcp"
    path = os.path.join(directory, name)
    tmp = f"{path}.tmp{os.getpid()}"
    out = _CrcFile(tmp)
    items: list[dict[str, Any]] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that a read-only mapping is read-only
            for item in doc["dcp"]["tensors"]:
                ext = doc["extents"][item["extent"]]
                dtype = getattr(torch, ext[0])
                nbytes = int(ext[3])
                itemsize = torch.empty((), dtype=dtype).element_size()
                tensor = torch.frombuffer(
                    slot.mm,
                    dtype=dtype,
                    count=nbytes // itemsize,
                    offset=shm.HEADER_BYTES + int(ext[2]),
                ).view(ext[1])
                start = out.tell()
                torch.save(tensor, out)
                del tensor
                items.append({**item, "offset": start, "length": out.tell() - start})
        for item in doc["dcp"]["bytes"]:
            start = out.tell()
            out.write(base64.b64decode(item["data"]))
            items.append({"fqn": item["fqn"], "offset": start, "length": out.tell() - start})
        digest = out.finish()
    except BaseException:
        if not out.closed:
            os.close(out.fd)
        raise
    os.rename(tmp, path)
    extra = {"dcp_items": items, "planner_data": doc["dcp"]["planner_data"], "file": name}
    return {name: digest}, extra


def commit_if_complete(root: str, step: int, keep_latest: int | None) -> bool:
    """When every writer of ``step`` has committed, finish the step and move the tracker."""
    directory = storage.step_dir(root, step)
    manifests = storage.read_manifests(directory)
    if not manifests:
        return False
    writers = set(next(iter(manifests.values()))["writers"])
    if not writers.issubset(manifests):
        log.debug("step %d: %d of %d writers committed", step, len(manifests), len(writers))
        return False
    if next(iter(manifests.values())).get("format") == "dcp":
        _write_dcp_metadata(directory, manifests)
    return storage.advance_tracker(root, step, keep_latest)


def _write_dcp_metadata(directory: str, manifests: dict[int, dict[str, Any]]) -> None:
    """Merge every rank's items into DCP's global ``.metadata`` (written once, atomically)."""
    import torch
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    state: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    for manifest in manifests.values():
        planner.update({k: tuple(v) for k, v in manifest["planner_data"].items()})
        for item in manifest["dcp_items"]:
            fqn = item["fqn"]
            info = _StorageInfo(manifest["file"], item["offset"], item["length"])
            if "global_shape" not in item:
                state[fqn] = md.BytesStorageMetadata()
                storage_data[md.MetadataIndex(fqn)] = info
                continue
            entry = state.setdefault(
                fqn,
                md.TensorStorageMetadata(
                    md.TensorProperties(dtype=getattr(torch, item["dtype"])),
                    torch.Size(item["global_shape"]),
                    [],
                ),
            )
            offsets = torch.Size(item["chunk_offsets"])
            entry.chunks.append(md.ChunkStorageMetadata(offsets, torch.Size(item["shape"])))
            storage_data[md.MetadataIndex(fqn, offsets)] = info
    meta = md.Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage_data)
    path = os.path.join(directory, ".metadata")
    storage.write_durable(path, [pickle.dumps(meta)])
    storage.fsync_dir(directory)
