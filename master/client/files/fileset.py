"""A dataset's files as one space of records: the files found (a glob or a list), their indexes
built in parallel or loaded from cache, and records [lo, hi) read across file boundaries."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from master.client.files import cache, parquet, text, tfrecord
from master.client.files.cache import FileIndex, FileStat
from master.client.files.errors import DataFileError
from master.client.files.spans import ByteFile, Span, join

log = logging.getLogger(__name__)

BUILDERS = {
    tfrecord.FORMAT: tfrecord.build_index,
    text.FORMAT: text.build_index,
    parquet.FORMAT: parquet.build_index,
}
FORMATS = tuple(BUILDERS)
# Files kept open at once (a shuffled epoch visits them all, in no order).
MAX_OPEN_FILES = 64
_GLOB_CHARS = frozenset("*?[")


def resolve(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The files a glob (sorted, so every node sees one order) or a list (kept in its order)
    names; a DataFileError for an empty glob or a missing file."""
    if isinstance(files, str | os.PathLike):
        pattern = os.fspath(files)
        if not _GLOB_CHARS & set(pattern):
            return [_existing(pattern)]
        found = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
        if not found:
            raise DataFileError(
                f"no file matches {pattern!r} (from {os.getcwd()}): check the pattern, or give "
                "a list of paths"
            )
        return found
    paths = [_existing(os.fspath(p)) for p in files]
    if not paths:
        raise DataFileError("the list of files is empty: give at least one file or a glob")
    return paths


def _existing(path: str) -> str:
    if os.path.isdir(path):
        raise DataFileError(
            f"{path} is a directory: give the files in it, e.g. {os.path.join(path, '*')!r}"
        )
    if not os.path.isfile(path):
        raise DataFileError(
            f"{path}: no such file (from {os.getcwd()}); fix the path or leave it out"
        )
    return path


def index_files(
    paths: Sequence[str], fmt: str, fallback_dirs: Sequence[str], workers: int = 0
) -> list[FileIndex]:
    """Each file's index, from cache when its size and mtime match, else built (in a thread
    pool over the files) and cached."""
    if fmt not in BUILDERS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    workers = workers or min(8, len(paths), (os.cpu_count() or 1) + 2)
    started = time.monotonic()
    built = [0, 0]  # files indexed, their bytes
    lock = threading.Lock()

    def one(path: str) -> FileIndex:
        stat = FileStat.of(path)
        index = cache.load(path, fmt, stat, fallback_dirs)
        if index is None:
            index = BUILDERS[fmt](path)
            cache.save(index, fallback_dirs)
            with lock:
                built[0] += 1
                built[1] += index.stat.size
        index.path = path
        return index

    if workers <= 1 or len(paths) == 1:
        indexes = [one(p) for p in paths]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="index") as pool:
            indexes = list(pool.map(one, paths))
    if built[0]:
        seconds = time.monotonic() - started
        log.info(
            "indexed %d of %d %s files (%.1f MB) in %.2f s",
            built[0],
            len(paths),
            fmt,
            built[1] / 1e6,
            seconds,
        )
    return indexes


class FileSet:
    """Files of one format whose records, file after file, are the records [0, size)."""

    def __init__(self, indexes: list[FileIndex], fmt: str, columns: list[str] | None = None):
        if not indexes:
            raise DataFileError("a dataset needs at least one file")
        self.format = fmt
        self.indexes = indexes
        self.columns = columns
        self.schema: Any = None
        if fmt == parquet.FORMAT:
            self.schema = parquet.check_same_schema(indexes)
            if columns is not None:
                missing = [c for c in columns if c not in self.schema.names]
                if missing:
                    raise DataFileError(
                        f"columns {missing} are not in {indexes[0].path} (its columns: "
                        f"{', '.join(self.schema.names)})"
                    )
        counts = np.array([i.count for i in indexes], dtype=np.int64)
        self.bounds = np.concatenate(([0], np.cumsum(counts)))
        self.size = int(self.bounds[-1])
        if self.size == 0:
            raise DataFileError(
                f"the {len(indexes)} {fmt} files hold no record (first: {indexes[0].path})"
            )
        self._readers: OrderedDict[int, Any] = OrderedDict()  # open files, the last used last
        self._lock = threading.Lock()

    @property
    def paths(self) -> list[str]:
        return [i.path for i in self.indexes]

    def fingerprint(self) -> str:
        """Names, sizes and record counts of the files, hashed: nodes of one dataset must see
        the same files (their folders may differ)."""
        rows = [(os.path.basename(i.path), i.stat.size, i.count) for i in self.indexes]
        text_ = json.dumps([self.format, self.columns, rows])
        return hashlib.sha256(text_.encode()).hexdigest()

    def _pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(file, first, end) local record ranges covering records [lo, hi)."""
        if not 0 <= lo <= hi <= self.size:
            raise ValueError(f"records [{lo}, {hi}) are outside [0, {self.size})")
        pieces = []
        f = int(np.searchsorted(self.bounds, lo, side="right")) - 1
        while lo < hi:
            base, end = int(self.bounds[f]), int(self.bounds[f + 1])
            if end > lo:
                take = min(hi, end)
                pieces.append((f, lo - base, take - base))
                lo = take
            f += 1
        return pieces

    def _reader(self, f: int) -> Any:
        with self._lock:
            reader = self._readers.pop(f, None)
            if reader is None:
                index = self.indexes[f]
                if self.format == parquet.FORMAT:
                    reader = parquet.ParquetReader(index, self.columns)
                else:
                    reader = ByteFile(index)
                while len(self._readers) >= MAX_OPEN_FILES:
                    self._readers.popitem(last=False)[1].close()
            self._readers[f] = reader
            return reader

    def read_span(self, lo: int, hi: int) -> Span:
        """Records [lo, hi) of a TFRecord or text file set, as one span."""
        return join([self._reader(f).read(a, b) for f, a, b in self._pieces(lo, hi)])

    def read_rows(self, lo: int, hi: int) -> Any:
        """Rows [lo, hi) of a Parquet file set, as one pyarrow.Table."""
        import pyarrow as pa

        tables = [self._reader(f).rows(a, b) for f, a, b in self._pieces(lo, hi)]
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    def close(self) -> None:
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()


def open_files(
    files: str | os.PathLike | Sequence[str | os.PathLike],
    fmt: str,
    fallback_dirs: Sequence[str] = (),
    columns: list[str] | None = None,
    workers: int = 0,
) -> FileSet:
    """The files named (a glob or a list) of format `fmt`, indexed, as one FileSet."""
    if fmt not in BUILDERS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    paths = resolve(files)
    return FileSet(index_files(paths, fmt, fallback_dirs, workers), fmt, columns)
