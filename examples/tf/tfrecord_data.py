"""The example's training records as TFRecord files of tf.train.Example (`wide_deep.py --files
DIR`): written once, then read through `dlrover_tf.ShardedDataset.from_files`.

Each process of the job may find the files missing; each file is written under a temporary
name and linked into place only if no other process did it first, so the files never change
once they exist (a file's index is checked against its size and modification time).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

import tensorflow as tf

logger = logging.getLogger("wide_deep")

_WRITE_BATCH = 8192


def file_paths(folder: str, records: int, num_files: int) -> list[str]:
    """The files holding `records` records in `num_files` parts (names carry both counts)."""
    return [
        os.path.join(folder, f"train-{records}-{k:03d}-of-{num_files:03d}.tfrecord")
        for k in range(num_files)
    ]


def write_files(folder: str, records: int, num_files: int, read_fn: Callable) -> list[str]:
    """Write the records [0, records) as `num_files` TFRecord files, those that do not exist
    yet; their paths. `read_fn` maps record indices to (features, labels)."""
    os.makedirs(folder, exist_ok=True)
    paths = file_paths(folder, records, num_files)
    per_file = -(-records // num_files)
    for k, path in enumerate(paths):
        if os.path.exists(path):
            continue
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        with tf.io.TFRecordWriter(tmp) as writer:
            for start in range(k * per_file, min(records, (k + 1) * per_file), _WRITE_BATCH):
                end = min(records, (k + 1) * per_file, start + _WRITE_BATCH)
                for example in _examples(read_fn, start, end):
                    writer.write(example)
        with contextlib.suppress(FileExistsError):  # another process linked it first
            os.link(tmp, path)
            logger.info("wrote %s (records %d..)", path, k * per_file)
        os.unlink(tmp)
    return paths


def _examples(read_fn: Callable, start: int, end: int):
    """Serialized tf.train.Example of records [start, end)."""
    features, labels = read_fn(tf.range(start, end, dtype=tf.int64))
    columns = {name: value.numpy() for name, value in features.items()}
    columns["label"] = labels.numpy()
    names = list(columns)
    for row in zip(*(columns[n].tolist() for n in names), strict=True):
        feature = {}
        for name, value in zip(names, row, strict=True):
            if isinstance(value, int):
                feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))
            else:
                feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=[value]))
        yield tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def parse_fn(read_fn: Callable) -> Callable:
    """A batched parse of the serialized examples into (features, labels), the types
    `read_fn` gives."""
    features, labels = read_fn(tf.zeros([1], tf.int64))
    spec = {name: tf.io.FixedLenFeature([], value.dtype) for name, value in features.items()}
    spec["label"] = tf.io.FixedLenFeature([], labels.dtype)

    def parse(records: tf.Tensor) -> tuple[dict, tf.Tensor]:
        parsed = tf.io.parse_example(records, spec)
        return parsed, parsed.pop("label")

    return parse
