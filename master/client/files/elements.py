"""Batches of parts turned into what a tf.data pipeline takes in, several batches at a time
(a generator element costs tf.data about 0.1 ms per component, whatever its size): for
TFRecord and text, one blob of bytes plus each record's start and length (TF cuts the records
out, no Python object per record); for Parquet, numpy columns."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from master.client.files.errors import DataFileError
from master.client.files.shard_reader import Part
from master.client.files.spans import Span


def byte_element(parts: list[Part]) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A run of TFRecord or text records as (blob, starts, lengths): the bytes of the spans
    the parts pick from, joined in order, and where each record is in them."""
    spans: list[Span] = []
    shifts: list[int] = []
    starts: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    size = 0
    for part in parts:
        span = part.source
        if not spans or spans[-1] is not span:
            spans.append(span)
            shifts.append(size)
            size += len(span.data)
        starts.append(span.starts[part.picks] + shifts[-1])
        lengths.append(span.lengths[part.picks])
    blob = spans[0].data if len(spans) == 1 else b"".join(s.data for s in spans)
    return blob, _cat(starts), _cat(lengths)


def grouped(batches: Iterable[Any], flush: Any, most: int) -> Iterator[tuple[list, list[int]]]:
    """Runs of up to `most` batches (lists of parts) as (all their parts, each batch's size);
    a run ends early where `batches` yields `flush` (it is about to wait)."""
    parts: list[Any] = []
    sizes: list[int] = []
    for batch in batches:
        if batch is flush:
            if sizes:
                yield parts, sizes
                parts, sizes = [], []
            continue
        parts.extend(batch)
        sizes.append(sum(len(p) for p in batch))
        if len(sizes) == most:
            yield parts, sizes
            parts, sizes = [], []
    if sizes:
        yield parts, sizes


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return np.empty(0, dtype=np.int64)
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def columns(parts: list[Part], names: list[str]) -> dict[str, np.ndarray]:
    """A Parquet batch as numpy columns: numbers and booleans as their dtype, strings and
    binaries as object arrays, fixed-size lists as 2-D arrays."""
    import pyarrow as pa

    tables = []
    for part in parts:
        table = part.source
        if isinstance(part.picks, slice):
            tables.append(table.slice(part.picks.start, part.picks.stop - part.picks.start))
        else:
            tables.append(table.take(pa.array(part.picks)))
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    return {name: column_array(table.column(name), name) for name in names}


def column_array(column: Any, name: str) -> np.ndarray:
    """One pyarrow column (ChunkedArray) as a numpy array; nulls are refused."""
    import pyarrow as pa

    if column.null_count:
        raise DataFileError(
            f"column {name!r} has {column.null_count} null values in this batch: fill them "
            "when writing the files, or leave the column out (columns=[...])"
        )
    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        flat = pa.chunked_array([c.flatten() for c in column.chunks], column.type.value_type)
        return flat.to_numpy().reshape(-1, width)
    return column.to_numpy()
