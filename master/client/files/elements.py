"""Batches of parts turned into what a tf.data pipeline takes in: for TFRecord and text, one
blob of bytes plus each record's start and length (the pipeline keeps the last blob, so a
window's bytes cross into it once however many batches it feeds); for Parquet, numpy columns."""

from __future__ import annotations

from typing import Any

import numpy as np

from master.client.files.errors import DataFileError
from master.client.files.shard_reader import Part
from master.client.files.spans import Span


class BlobCarrier:
    """Makes (blob, starts, lengths, carried) for each batch: the first `carried` records are
    in the blob the consumer holds (the last non-empty one it was given), the others in this
    element's blob, which the consumer holds from then on."""

    def __init__(self) -> None:
        self._held: Span | None = None

    def element(self, parts: list[Part]) -> tuple[bytes, np.ndarray, np.ndarray, int]:
        groups: list[tuple[Span, list[Part]]] = []
        for part in parts:
            if groups and groups[-1][0] is part.source:
                groups[-1][1].append(part)
            else:
                groups.append((part.source, [part]))
        starts: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        carried = 0
        if groups[0][0] is self._held:
            span, held_parts = groups.pop(0)
            for part in held_parts:
                starts.append(span.starts[part.picks])
                lengths.append(span.lengths[part.picks])
                carried += len(part)
        if not groups:
            return b"", _cat(starts), _cat(lengths), carried
        shift = 0
        for span, group in groups:
            for part in group:
                starts.append(span.starts[part.picks] + shift)
                lengths.append(span.lengths[part.picks])
            shift += len(span.data)
        if len(groups) == 1:
            self._held = groups[0][0]
            return self._held.data, _cat(starts), _cat(lengths), carried
        # Several new spans (a batch over window or shard ends): their bytes joined, held by
        # the consumer but by no later part.
        self._held = None
        return b"".join(s.data for s, _ in groups), _cat(starts), _cat(lengths), carried


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
