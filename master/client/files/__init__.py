"""Datasets made of files (TFRecord, text, Parquet) for the master's shards, framework-neutral.

`fileset` finds the files and indexes them (`tfrecord`, `text`, `parquet` build each format's
index, `cache` keeps it on disk); `order` maps an epoch's positions to records (shuffled by
blocks and windows); `shard_reader` reads a shard's records in runs (`spans` for the byte
formats); `elements` turns batches into what a tf.data pipeline takes in. numpy is needed;
pyarrow (Parquet) and google_crc32c (TFRecord) are imported when used.
"""

from master.client.files.errors import DataFileError, FileChangedError
from master.client.files.fileset import FORMATS, FileSet, open_files, resolve
from master.client.files.order import Order
from master.client.files.shard_reader import Part, ShardReader

__all__ = [
    "FORMATS",
    "DataFileError",
    "FileChangedError",
    "FileSet",
    "Order",
    "Part",
    "ShardReader",
    "open_files",
    "resolve",
]
