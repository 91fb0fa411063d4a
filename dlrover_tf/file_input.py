"""The tf.data side of file datasets: batches of records cut out of blobs of bytes by TF
(TFRecord, text), or column tensors (Parquet)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from master.client.files.errors import DataFileError

_ELEMENT = (
    tf.TensorSpec([], tf.string),  # blob: the bytes of a run of batches
    tf.TensorSpec([None], tf.int64),  # starts of the records in it
    tf.TensorSpec([None], tf.int64),  # their lengths
    tf.TensorSpec([None], tf.int64),  # the size of each batch
)


def byte_batches(
    elements: Callable[[], Iterator[tuple]], parse_fn: Callable | None, parallel: int
) -> tf.data.Dataset:
    """Batches of serialized records (a 1-D tf.string tensor each), `parse_fn` applied.

    A generator element carries several batches in one blob; `tf.strings.substr` cuts the
    records out in C++ (no Python object per record), then they are split into batches."""
    ds = tf.data.Dataset.from_generator(elements, output_signature=_ELEMENT)

    def cut(blob, starts, lengths, sizes) -> tuple:
        return tf.strings.substr(blob, starts, lengths), sizes

    ds = ds.map(cut, num_parallel_calls=parallel, deterministic=True)
    ds = ds.flat_map(_split)
    return ds if parse_fn is None else ds.map(parse_fn, parallel, deterministic=True)


def _split(values: Any, sizes: tf.Tensor) -> tf.data.Dataset:
    """The rows of `values` (a tensor or a dict of them) as consecutive batches of `sizes`."""
    ends = tf.cumsum(sizes)
    bounds = tf.stack([ends - sizes, ends], axis=1)
    return tf.data.Dataset.from_tensor_slices(bounds).map(
        lambda b: tf.nest.map_structure(lambda v: v[b[0] : b[1]], values)
    )


def column_batches(
    elements: Callable[[], Iterator[tuple]],
    schema: Any,
    columns: list[str] | None,
    parse_fn: Callable | None,
    parallel: int,
) -> tf.data.Dataset:
    """Batches of Parquet rows as a dict of tensors, one per column, `parse_fn` applied."""
    names = columns or list(schema.names)
    signature = {name: column_spec(schema.field(name), name) for name in names}
    sizes = tf.TensorSpec([None], tf.int64)
    ds = tf.data.Dataset.from_generator(elements, output_signature=(signature, sizes))
    ds = ds.flat_map(_split)
    return ds if parse_fn is None else ds.map(parse_fn, parallel, deterministic=True)


def column_spec(field: Any, name: str) -> tf.TensorSpec:
    """The tensor of a batch of one Parquet column: numbers, booleans, strings, binaries, and
    fixed-size lists of numbers (a 2-D tensor)."""
    import pyarrow as pa

    kind = field.type
    width: list[int] = []
    if pa.types.is_fixed_size_list(kind):
        width, kind = [kind.list_size], kind.value_type
    strings = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary)
    if any(is_kind(kind) for is_kind in (*strings, pa.types.is_large_binary)):
        dtype = tf.string
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        dtype = tf.as_dtype(pa.array([], type=kind).to_numpy(zero_copy_only=False).dtype)
    else:
        raise DataFileError(
            f"column {name!r} is of type {field.type}, which has no tensor here (numbers, "
            "booleans, strings, binaries and fixed-size lists of numbers do): leave it out "
            "with columns=[...], or write it as one of those"
        )
    if width and dtype == tf.string:
        raise DataFileError(f"column {name!r}: lists of strings are not read; leave it out")
    return tf.TensorSpec([None, *width], dtype)
