"""The tf.data side of file datasets: batches of records cut out of blobs of bytes by TF
(TFRecord, text), or column tensors (Parquet)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from master.client.files.errors import DataFileError

_ELEMENT = (
    tf.TensorSpec([], tf.string),  # blob: the bytes of this element's new records
    tf.TensorSpec([None], tf.int64),  # starts of the batch's records in their blob
    tf.TensorSpec([None], tf.int64),  # their lengths
    tf.TensorSpec([], tf.int64),  # carried: the first records are in the blob held before
)


def byte_batches(
    elements: Callable[[], Iterator[tuple]], parse_fn: Callable | None, parallel: int
) -> tf.data.Dataset:
    """Batches of serialized records (a 1-D tf.string tensor each), `parse_fn` applied.

    The generator gives a window's bytes once; a scan holds them for the batches that follow
    (a tensor is passed on by reference), and `tf.strings.substr` cuts each batch's records out
    in C++: no Python object per record."""
    ds = tf.data.Dataset.from_generator(elements, output_signature=_ELEMENT)

    def hold(held: tf.Tensor, element: tuple) -> tuple:
        blob, starts, lengths, carried = element
        fresh = carried < tf.size(starts, out_type=tf.int64)
        new_held = tf.cond(fresh, lambda: blob, lambda: held)
        return new_held, (held, blob, starts, lengths, carried)

    def cut(held, blob, starts, lengths, carried) -> Any:
        old = tf.strings.substr(held, starts[:carried], lengths[:carried])
        new = tf.strings.substr(blob, starts[carried:], lengths[carried:])
        records = tf.concat([old, new], axis=0)
        return records if parse_fn is None else parse_fn(records)

    ds = ds.scan(tf.constant(b"", tf.string), hold)
    return ds.map(cut, num_parallel_calls=parallel, deterministic=True)


def column_batches(
    elements: Callable[[], Iterator[dict]], schema: Any, columns: list[str] | None
) -> tf.data.Dataset:
    """Batches of Parquet rows as a dict of tensors, one per column."""
    names = columns or list(schema.names)
    signature = {name: column_spec(schema.field(name), name) for name in names}
    return tf.data.Dataset.from_generator(elements, output_signature=signature)


def column_spec(field: Any, name: str) -> tf.TensorSpec:
    """The tensor of a batch of one Parquet column: numbers, booleans, strings, binaries, and
    fixed-size lists of numbers (a 2-D tensor)."""
    import pyarrow as pa

    kind = field.type
    width: list[int] = []
    if pa.types.is_fixed_size_list(kind):
        width, kind = [kind.list_size], kind.value_type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind):
        dtype = tf.string
    elif pa.types.is_large_binary(kind):
        dtype = tf.string
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        dtype = tf.as_dtype(kind.to_pandas_dtype())
    else:
        raise DataFileError(
            f"column {name!r} is of type {field.type}, which has no tensor here (numbers, "
            "booleans, strings, binaries and fixed-size lists of numbers do): leave it out "
            "with columns=[...], or write it as one of those"
        )
    if width and dtype == tf.string:
        raise DataFileError(f"column {name!r}: lists of strings are not read; leave it out")
    return tf.TensorSpec([None, *width], dtype)
