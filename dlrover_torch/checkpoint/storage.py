"""The on-disk layout: step directories, checksummed files, per-rank manifests, the tracker.

::

    <checkpoint_dir>/latest                      tracker: {"step": N}, replaced atomically
    <checkpoint_dir>/step-N/rank-R.flash         one rank's state (header, data, metadata)
    <checkpoint_dir>/step-N/manifest-rank-R.json that file's size and CRC32 per 64 MiB chunk
    <checkpoint_dir>/step-N/__R_0.distcp, .metadata   (sharded format: readable by torch DCP)

Every file is written to a temporary name, fdatasync'ed, renamed, and its directory fsync'ed.
A rank's manifest is its commit; a step is complete when every writer's manifest is present;
the tracker moves to a step only after that, so a crash at any point leaves the previous
checkpoint intact. Torch-free: the persister process uses it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dlrover_torch.checkpoint.errors import CorruptCheckpointError

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
TRACKER = "latest"
_STEP_RE = re.compile(r"^step-(\d+)$")
_MANIFEST_RE = re.compile(r"^manifest-rank-(\d+)\.json$")


def step_dir(root: str, step: int) -> str:
    """Directory of one checkpoint step."""
    return os.path.join(root, f"step-{step}")


def manifest_name(rank: int) -> str:
    """File name of one rank's manifest."""
    return f"manifest-rank-{rank}.json"


def flash_file_name(rank: int) -> str:
    """File name of one rank's flash-format state."""
    return f"rank-{rank}.flash"


@dataclass
class FileDigest:
    """Size and per-chunk CRC32 of a written file."""

    size: int
    crc32: list[int]
    chunk: int = CHUNK_BYTES

    def to_json(self) -> dict[str, Any]:
        """JSON form for manifests."""
        return {"size": self.size, "chunk": self.chunk, "crc32": self.crc32}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FileDigest:
        """Inverse of ``to_json``."""
        return cls(int(raw["size"]), [int(c) for c in raw["crc32"]], int(raw["chunk"]))


def fsync_dir(path: str) -> None:
    """Make a rename or create in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _split(pieces: Iterable[bytes | memoryview], chunk: int) -> Iterator[tuple[int, memoryview]]:
    """Yield (chunk index, sub-piece) so that no sub-piece crosses a chunk boundary."""
    pos = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        start = 0
        while start < len(view):
            room = chunk - pos % chunk
            sub = view[start : start + room]
            yield pos // chunk, sub
            pos += len(sub)
            start += len(sub)


def write_durable(
    path: str,
    pieces: Sequence[bytes | memoryview],
    crc_pool: ThreadPoolExecutor | None = None,
    should_abort: Callable[[], bool] | None = None,
    direct: bool = False,
) -> FileDigest:
    """Write ``pieces`` to ``path`` atomically and durably; return the file's digest.

    The CRC of each piece runs on ``crc_pool`` while the piece is written (both release the
    GIL). ``direct=True`` writes with O_DIRECT when the file system allows it: the data goes
    from memory to disk without a page-cache copy (almost no CPU, no dirty-page throttling);
    every piece must then start on a page boundary and be a whole number of pages.
    """
    tmp = f"{path}.tmp{os.getpid()}"
    if direct:
        try:
            return _write_pieces(path, tmp, pieces, crc_pool, should_abort, os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.info("O_DIRECT refused for %s (%s); writing through the page cache", path, exc)
    return _write_pieces(path, tmp, pieces, crc_pool, should_abort, 0)


def _write_pieces(
    path: str,
    tmp: str,
    pieces: Sequence[bytes | memoryview],
    crc_pool: ThreadPoolExecutor | None,
    should_abort: Callable[[], bool] | None,
    extra_flags: int,
) -> FileDigest:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | extra_flags, 0o644)
    crcs: list[int] = []
    size = 0
    try:
        for index, sub in _split(pieces, CHUNK_BYTES):
            if should_abort is not None and should_abort():
                raise InterruptedError(f"writing {path} was cancelled")
            running = crcs[index] if index < len(crcs) else 0
            fut = crc_pool.submit(zlib.crc32, sub, running) if crc_pool is not None else None
            try:
                _write_all(fd, sub)
            finally:
                crc = fut.result() if fut is not None else zlib.crc32(sub, running)
            if index < len(crcs):
                crcs[index] = crc
            else:
                crcs.append(crc)
            size += len(sub)
        os.fdatasync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
    return FileDigest(size, crcs, CHUNK_BYTES)


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        written = os.write(fd, view)
        view = view[written:]


def write_json_durable(path: str, doc: dict[str, Any]) -> None:
    """Write a small JSON file atomically and durably (including its directory entry)."""
    write_durable(path, [json.dumps(doc, sort_keys=True).encode()])
    fsync_dir(os.path.dirname(path))


def read_json(path: str) -> dict[str, Any] | None:
    """Read a JSON file; None when missing; CorruptCheckpointError when unreadable."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: expected a JSON object")
    return doc


def read_verified(path: str, digest: FileDigest, into: memoryview) -> None:
    """Read ``path`` into ``into`` (its exact size), checking every chunk's CRC.

    The CRC of chunk i runs on a helper thread while chunk i+1 is read (both release the GIL).
    """
    if len(into) != digest.size:
        raise ValueError(f"buffer of {len(into)} bytes for {path} of {digest.size} bytes")
    try:
        actual = os.path.getsize(path)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{path}: listed in its manifest but missing") from exc
    if actual != digest.size:
        raise CorruptCheckpointError(
            f"{path}: {actual} bytes on disk, its manifest says {digest.size}"
        )
    # O_DIRECT (disk to our buffer, no page-cache copy) when everything is page aligned, as
    # files written by the persister are; otherwise, or if refused, buffered reads.
    aligned = digest.size % 4096 == 0 and digest.chunk % 4096 == 0
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if aligned else 0))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fd = os.open(path, os.O_RDONLY)
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc-read") as pool:
        checks = []
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for index in range(len(digest.crc32)):
                view = into[index * digest.chunk : (index + 1) * digest.chunk]
                got = 0
                while got < len(view):
                    try:
                        n = os.readv(fd, [view[got:]])
                    except OSError as exc:
                        if exc.errno != errno.EINVAL or not aligned:
                            raise
                        aligned = False  # O_DIRECT refused here: continue buffered
                        os.close(fd)
                        fd = os.open(path, os.O_RDONLY)
                        os.lseek(fd, index * digest.chunk + got, os.SEEK_SET)
                        continue
                    if not n:
                        raise CorruptCheckpointError(f"{path}: truncated at byte {got}")
                    got += n
                checks.append((index, len(view), pool.submit(zlib.crc32, view)))
        finally:
            os.close(fd)
        for index, length, fut in checks:
            if fut.result() != digest.crc32[index]:
                start = index * digest.chunk
                raise CorruptCheckpointError(
                    f"{path}: checksum mismatch in bytes {start}..{start + length}"
                )


def verify_file(path: str, digest: FileDigest) -> None:
    """Check a file's CRCs without keeping its content."""
    buf = bytearray(min(digest.chunk, max(digest.size, 1)))
    try:
        actual = os.path.getsize(path)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{path}: listed in its manifest but missing") from exc
    if actual != digest.size:
        raise CorruptCheckpointError(
            f"{path}: {actual} bytes on disk, its manifest says {digest.size}"
        )
    with open(path, "rb", buffering=0) as fh:
        for index, expected in enumerate(digest.crc32):
            want = min(digest.chunk, digest.size - index * digest.chunk)
            view = memoryview(buf)[:want]
            got = 0
            while got < want:
                n = fh.readinto(view[got:])
                if not n:
                    raise CorruptCheckpointError(f"{path}: truncated")
                got += n
            if zlib.crc32(view) != expected:
                start = index * digest.chunk
                raise CorruptCheckpointError(
                    f"{path}: checksum mismatch in bytes {start}..{start + want}"
                )


@contextlib.contextmanager
def dir_lock(root: str) -> Iterator[None]:
    """Serialise tracker updates and pruning between persisters on one file system."""
    fd = os.open(os.path.join(root, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_tracker(root: str) -> int | None:
    """The committed latest step, None when there is no tracker or it is unreadable."""
    try:
        doc = read_json(os.path.join(root, TRACKER))
    except CorruptCheckpointError as exc:
        log.error("ignoring the tracker: %s", exc)
        return None
    if doc is None or not isinstance(doc.get("step"), int):
        return None
    return int(doc["step"])


def list_steps(root: str) -> list[int]:
    """Every step directory under ``root``, newest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = [int(m.group(1)) for n in names if (m := _STEP_RE.match(n))]
    return sorted(steps, reverse=True)


def read_manifests(directory: str) -> dict[int, dict[str, Any]]:
    """The rank manifests present in a step directory, by rank."""
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return out
    for name in names:
        m = _MANIFEST_RE.match(name)
        if m:
            doc = read_json(os.path.join(directory, name))
            if doc is not None:
                out[int(m.group(1))] = doc
    return out


def is_complete(directory: str, manifests: dict[int, dict[str, Any]] | None = None) -> bool:
    """True when every writer of the step has committed its manifest."""
    try:
        manifests = read_manifests(directory) if manifests is None else manifests
    except CorruptCheckpointError:
        return False
    if not manifests:
        return False
    writers = set(next(iter(manifests.values())).get("writers", []))
    if not writers or not writers.issubset(manifests):
        return False
    fmt = next(iter(manifests.values())).get("format")
    return fmt != "dcp" or os.path.exists(os.path.join(directory, ".metadata"))


def committed_steps(root: str) -> list[int]:
    """Complete steps not newer than the tracker, newest first (the load candidates)."""
    tracker = read_tracker(root)
    out = []
    for step in list_steps(root):
        if tracker is not None and step > tracker:
            continue  # written but never committed: a persist was cut short
        if is_complete(step_dir(root, step)):
            out.append(step)
    return out


def advance_tracker(root: str, step: int, keep_latest: int | None) -> bool:
    """Move the tracker to ``step`` if it is newer, then prune old steps; True if moved."""
    with dir_lock(root):
        current = read_tracker(root)
        if current is not None and current >= step:
            return False
        write_json_durable(os.path.join(root, TRACKER), {"step": step})
        if keep_latest:
            prune(root, keep_latest)
        return True


def prune(root: str, keep_latest: int) -> None:
    """Delete every step directory older than the ``keep_latest`` newest committed ones."""
    keep = committed_steps(root)[:keep_latest]
    if len(keep) < keep_latest:
        return
    oldest_kept = keep[-1]
    for step in list_steps(root):
        if step < oldest_kept:
            log.info("removing old checkpoint %s", step_dir(root, step))
            shutil.rmtree(step_dir(root, step), ignore_errors=True)
