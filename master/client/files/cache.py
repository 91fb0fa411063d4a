"""Per-file indexes kept on disk: one int64 array behind a small JSON header saying which file
(path, size, modification time) and which index format it belongs to.

An index is looked for next to its file (`.NAME.dlrover-index`), then in each fallback folder
(the run dir, a user cache dir); it is written to the first place that takes it, atomically, so
nodes indexing the same file at once leave one whole index.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"DLROVER-FILE-INDEX\n"
VERSION = 1
SUFFIX = ".dlrover-index"
_LENGTH = struct.Struct("<I")
_ALIGN = 8


@dataclass(frozen=True)
class FileStat:
    """What identifies a file's content for its index: size and modification time."""

    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path_or_fd: str | int) -> FileStat:
        st = os.stat(path_or_fd) if isinstance(path_or_fd, str) else os.fstat(path_or_fd)
        return cls(st.st_size, st.st_mtime_ns)


@dataclass
class FileIndex:
    """One file's index: `array` (record offsets, or rows per row group) and format details."""

    path: str
    format: str
    stat: FileStat
    count: int
    array: np.ndarray
    extra: dict = field(default_factory=dict)


def default_cache_dirs(env: Mapping[str, str]) -> list[str]:
    """Where indexes go when a file's own folder is read-only: the job's run dir
    (DLROVER_RUN_DIR), then the user's cache dir."""
    dirs = []
    if env.get("DLROVER_RUN_DIR"):
        dirs.append(os.path.join(env["DLROVER_RUN_DIR"], "file-index"))
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    dirs.append(os.path.join(base, "dlrover", "file-index"))
    return dirs


def candidates(path: str, fmt: str, fallback_dirs: Sequence[str]) -> list[str]:
    """Where the index of `path` may be, in the order looked at and written to."""
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    here = os.path.join(folder, f".{name}.{fmt}{SUFFIX}")
    key = hashlib.sha256(path.encode()).hexdigest()[:16]
    return [here, *(os.path.join(d, f"{key}-{name}.{fmt}{SUFFIX}") for d in fallback_dirs)]


def load(path: str, fmt: str, stat: FileStat, fallback_dirs: Sequence[str]) -> FileIndex | None:
    """The cached index of `path` for its current size and mtime, or None (absent, stale,
    unreadable: it is then built again)."""
    for where in candidates(path, fmt, fallback_dirs):
        index = _read(where)
        if index is None:
            continue
        if (
            index.path == os.path.abspath(path)
            and index.format == fmt
            and index.stat == stat
            and len(index.array) >= index.count
        ):
            return index
        log.info("index %s is stale for %s (the file changed): indexing it again", where, path)
    return None


def save(index: FileIndex, fallback_dirs: Sequence[str]) -> str | None:
    """Write the index where it first fits; its location, or None where none was writable."""
    header = {
        "version": VERSION,
        "path": os.path.abspath(index.path),
        "format": index.format,
        "size": index.stat.size,
        "mtime_ns": index.stat.mtime_ns,
        "count": index.count,
        "extra": index.extra,
    }
    head = json.dumps(header, sort_keys=True).encode()
    pad = -(len(MAGIC) + _LENGTH.size + len(head)) % _ALIGN
    head += b" " * pad
    payload = index.array.astype("<i8", copy=False).tobytes()
    for where in candidates(index.path, index.format, fallback_dirs):
        tmp = f"{where}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(where), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + _LENGTH.pack(len(head)) + head + payload)
            os.replace(tmp, where)
            return where
        except OSError as e:
            log.debug("cannot write the index of %s at %s: %s", index.path, where, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
    log.warning("no writable place for the index of %s: each reader builds it again", index.path)
    return None


def _read(where: str) -> FileIndex | None:
    try:
        with open(where, "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("not an index file")
        (length,) = _LENGTH.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _LENGTH.size
        header = json.loads(data[start : start + length])
        if header["version"] != VERSION:
            return None
        array = np.frombuffer(data, dtype="<i8", offset=start + length).astype(np.int64)
        return FileIndex(
            header["path"],
            header["format"],
            FileStat(header["size"], header["mtime_ns"]),
            header["count"],
            array,
            header.get("extra", {}),
        )
    except (ValueError, KeyError, struct.error) as e:
        log.info("ignoring the unreadable index %s: %s", where, e)
        return None
