"""Every node of a file dataset must read the same files the same way: the first node's files
and order are kept in the master's KV store, and each node compares its own with them."""

from __future__ import annotations

import json

from master.client.files.errors import DataFileError
from master.client.files.fileset import FileSet
from master.client.files.order import Order
from master.client.kv import KVClient
from master.client.master import MasterClient


def files_key(dataset: str) -> bytes:
    """The KV key holding what the first node read `dataset` from."""
    return f"dlrover/dataset-files/{dataset}".encode()


def check_same_files(client: MasterClient, dataset: str, files: FileSet, order: Order) -> None:
    """Keep this node's files and order as the dataset's if it is the first to read it, else
    raise a DataFileError where they differ from the first node's."""
    mine = {
        "files": len(files.indexes),
        "records": files.size,
        "fingerprint": files.fingerprint(),
        "order": [order.shuffle, order.block, order.window, order.seed],
    }
    value = json.dumps(mine, sort_keys=True).encode()
    kept = KVClient(client).compare_set(files_key(dataset), b"", value)
    if kept == value:
        return
    first = json.loads(kept)
    raise DataFileError(
        f"dataset {dataset!r}: this node's files or options differ from those the dataset was "
        f"first read with (first: {first['files']} files, {first['records']} records, "
        f"shuffle/block/window/seed {first['order']}; here: {mine['files']} files, "
        f"{mine['records']} records, {mine['order']}). Give every node the same files (names, "
        "sizes, record counts) and options"
    )
