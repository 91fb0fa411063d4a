"""What both frameworks' `from_files` start from: the files, indexed, and their record order."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from master.client.files.cache import default_cache_dirs
from master.client.files.fileset import FORMATS, FileSet, open_files
from master.client.files.order import Order
from master.client.files.parquet import FORMAT as PARQUET

# The shuffle block when none is given: this many batches, at least MIN_BLOCK records.
BLOCK_BATCHES = 16
MIN_BLOCK = 4096


def open_dataset_files(
    files: str | os.PathLike | Sequence[str | os.PathLike],
    format: str,
    batch_size: int,
    shuffle: bool,
    seed: int,
    *,
    block: int = 0,
    window: int = 0,
    columns: Sequence[str] | None = None,
    cache_dirs: Sequence[str] | None = None,
    index_threads: int = 0,
    environ: Mapping[str, str] | None = None,
) -> tuple[FileSet, Order]:
    """Check the options, index the files (cached where `cache_dirs` say, by default the run
    dir then the user's cache) and lay out their record order: blocks of `block` records
    (default 16 batches, at least 4096) shuffled across the dataset, read in windows."""
    if format not in FORMATS:
        raise ValueError(f"format {format!r} is not one of {', '.join(FORMATS)}")
    if columns is not None and format != PARQUET:
        raise ValueError(f"columns= is for Parquet files, not {format!r}")
    if cache_dirs is None:
        cache_dirs = default_cache_dirs(os.environ if environ is None else environ)
    wanted = list(columns) if columns is not None else None
    fileset = open_files(files, format, cache_dirs, wanted, index_threads)
    block = block or max(MIN_BLOCK, BLOCK_BATCHES * batch_size)
    return fileset, Order(fileset.size, shuffle, block, window or block, seed)
