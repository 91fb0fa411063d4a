"""Data files for the file-dataset tests, written here without the code under test: TFRecord
framing (with its masked CRC32C), text lines, Parquet row groups."""

from __future__ import annotations

import struct

import google_crc32c


def masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) % 2**32


def frame(record: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, the data's masked CRC."""
    length = struct.pack("<Q", len(record))
    return (
        length
        + struct.pack("<I", masked_crc(length))
        + record
        + struct.pack("<I", masked_crc(record))
    )


def record(i: int) -> bytes:
    """Record i: its id (8 bytes) then 0 to 40 bytes that vary with it."""
    return i.to_bytes(8, "little") + bytes([i % 251]) * (i * 7 % 41)


def write_tfrecord(path, ids) -> list[int]:
    """A TFRecord file of record(i) for each id; the byte offset of each record and the end."""
    offsets, data = [], b""
    for i in ids:
        offsets.append(len(data))
        data += frame(record(i))
    offsets.append(len(data))
    with open(path, "wb") as f:
        f.write(data)
    return offsets


def ids_of(records) -> list[int]:
    """The ids record(i) carries."""
    return [int.from_bytes(r[:8], "little") for r in records]


def write_text(path, ids, crlf: bool = False) -> None:
    end = "\r\n" if crlf else "\n"
    with open(path, "w", newline="") as f:
        f.writelines(f"{i},{i * 3 % 7}{end}" for i in ids)


def write_parquet(path, ids, rows_per_group: int = 100, extra_column: bool = False) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = np.asarray(list(ids), dtype=np.int64)
    columns = {
        "id": ids,
        "x": (ids % 13).astype(np.float32),
        "name": [f"r{i}" for i in ids],
        "vec": pa.array([[float(i), float(-i)] for i in ids], type=pa.list_(pa.float32(), 2)),
    }
    if extra_column:
        columns["more"] = ids
    pq.write_table(pa.table(columns), path, row_group_size=rows_per_group)
