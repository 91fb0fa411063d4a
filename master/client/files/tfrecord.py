"""TFRecord files: the index of record offsets, built by one pass over the file that checks
every record's two CRC32C checksums, and the byte layout of a run of records.

A record is: uint64 length, uint32 masked CRC32C of the length bytes, the data, uint32 masked
CRC32C of the data (all little endian).
"""

from __future__ import annotations

import struct

import numpy as np

from master.client.files.cache import FileIndex, FileStat
from master.client.files.errors import DataFileError

FORMAT = "tfrecord"
HEADER = 12  # length (8) and its CRC (4)
FOOTER = 4  # the data's CRC
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
# Read this many bytes at a time while indexing (records crossing a chunk end are carried over).
CHUNK_BYTES = 16 << 20
_GZIP_MAGIC = b"\x1f\x8b"


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32C of `data`."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32


def compressed_kind(head: bytes) -> str:
    """ "GZIP" or "ZLIB" where a file's first bytes look compressed, else ""."""
    if head.startswith(_GZIP_MAGIC):
        return "GZIP"
    # A zlib stream: CMF 0x78 (deflate, 32K window) and a header check multiple of 31.
    if len(head) >= 2 and head[0] == 0x78 and (head[0] * 256 + head[1]) % 31 == 0:
        return "ZLIB"
    return ""


def _compressed_error(path: str, kind: str) -> DataFileError:
    return DataFileError(
        f"{path} is a compressed TFRecord file ({kind}): records in it cannot be found without "
        'reading it whole. Decompress it once and train from the copy (e.g. `python -c "import '
        "tensorflow as tf; w = tf.io.TFRecordWriter('OUT'); [w.write(r.numpy()) for r in "
        f"tf.data.TFRecordDataset('{path}', compression_type='{kind}')]; w.close()\"`), or read "
        f"it with tf.data.TFRecordDataset(..., compression_type='{kind}') without "
        "ShardedDataset.from_files"
    )


def build_index(path: str) -> FileIndex:
    """Scan a TFRecord file: offsets of every record plus the file's end (count + 1 values).

    Both CRCs of every record are checked, so a corrupt or truncated file is refused here,
    naming the record and byte offset, and never half-read during training."""
    with open(path, "rb") as f:
        stat = FileStat.of(f.fileno())
        offsets: list[int] = []
        buf = f.read(CHUNK_BYTES)
        if compressed_kind(buf[:2]) == "GZIP":
            raise _compressed_error(path, "GZIP")
        base = 0  # the file offset of buf[0]
        while True:
            more = f.read(CHUNK_BYTES)
            used = _scan(path, buf, base, offsets, final=not more)
            if not more:
                break
            base += used
            buf = buf[used:] + more
    end = base + len(buf)
    if end != stat.size or FileStat.of(path) != stat:
        raise DataFileError(
            f"{path} changed while it was indexed ({stat.size} bytes at the start, {end} read): "
            "start the job once the file is complete"
        )
    offsets.append(end)
    return FileIndex(path, FORMAT, stat, len(offsets) - 1, np.asarray(offsets, dtype=np.int64))


def _scan(path: str, buf: bytes, base: int, offsets: list[int], final: bool) -> int:
    """Check and record the whole records in `buf` (at file offset `base`); the bytes used.
    With `final`, bytes left over are a truncated record."""
    pos, n = 0, len(buf)
    first = len(offsets)
    import google_crc32c

    head, stored_crc, crc32c = _LENGTH.unpack_from, _CRC.unpack_from, google_crc32c.value
    delta, u32 = _MASK_DELTA, _U32
    while pos + HEADER <= n:
        (length,) = head(buf, pos)
        end = pos + HEADER + length + FOOTER
        if end > n:
            break
        crc = crc32c(buf[pos + HEADER : end - FOOTER])
        if (((crc >> 15) | (crc << 17)) + delta) & u32 != stored_crc(buf, end - FOOTER)[0]:
            _check_header(path, buf, base, pos, len(offsets))
            raise _corrupt(path, len(offsets), base + pos, "its data's checksum differs", buf)
        offsets.append(base + pos)
        pos = end
    # The lengths' checksums, all at once; and the one a record cut by the chunk's end has.
    _check_headers(path, buf, base, offsets, first)
    if pos + HEADER <= n:
        _check_header(path, buf, base, pos, len(offsets))
    if final and pos < n:
        raise DataFileError(
            f"{path} ends in the middle of record {len(offsets)} (at byte {base + pos}; "
            f"{n - pos} bytes left): the file is truncated, e.g. still being written or cut "
            "short by a copy. Write or copy it again, then start the job again"
        )
    return pos


def _check_header(path: str, buf: bytes, base: int, pos: int, record: int) -> None:
    if masked_crc(buf[pos : pos + 8]) != _CRC.unpack_from(buf, pos + 8)[0]:
        raise _corrupt(path, record, base + pos, "its length's checksum differs", buf)


def _check_headers(path: str, buf: bytes, base: int, offsets: list[int], first: int) -> None:
    """The length checksums of records offsets[first:] (numpy, 8 table lookups a record)."""
    if len(offsets) == first:
        return
    at = np.asarray(offsets[first:], dtype=np.int64) - base
    data = np.frombuffer(buf, dtype=np.uint8)
    lengths = data[at[:, None] + np.arange(8)]
    stored = data[at[:, None] + np.arange(8, 12)].copy().view("<u4")[:, 0]
    bad = np.flatnonzero(_masked_crc8(lengths) != stored)
    if len(bad):
        k = int(bad[0])
        raise _corrupt(
            path, first + k, int(offsets[first + k]), "its length's checksum differs", buf
        )


def _tables() -> np.ndarray:
    """CRC32C slicing-by-8 tables (Castagnoli, reflected polynomial 0x82F63B78)."""
    table = np.zeros((8, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table[0, i] = c
    for k in range(1, 8):
        for i in range(256):
            prev = int(table[k - 1, i])
            table[k, i] = (prev >> 8) ^ int(table[0, prev & 0xFF])
    return table


_TABLES: np.ndarray | None = None


def _masked_crc8(rows: np.ndarray) -> np.ndarray:
    """masked_crc of each row of an (n, 8) uint8 array, vectorized."""
    global _TABLES
    if _TABLES is None:
        _TABLES = _tables()
    t = _TABLES
    rows = rows.astype(np.uint32)
    low = rows[:, 0] | (rows[:, 1] << 8) | (rows[:, 2] << 16) | (rows[:, 3] << 24)
    crc = low ^ np.uint32(_U32)
    crc = (
        t[7][crc & 0xFF]
        ^ t[6][(crc >> 8) & 0xFF]
        ^ t[5][(crc >> 16) & 0xFF]
        ^ t[4][crc >> 24]
        ^ t[3][rows[:, 4]]
        ^ t[2][rows[:, 5]]
        ^ t[1][rows[:, 6]]
        ^ t[0][rows[:, 7]]
    ) ^ np.uint32(_U32)
    rotated = (crc >> np.uint32(15)) | (crc << np.uint32(17))
    return rotated + np.uint32(_MASK_DELTA)  # wraps modulo 2**32


def _corrupt(path: str, record: int, offset: int, what: str, buf: bytes) -> DataFileError:
    hint = ""
    if record == 0 and offset == 0 and compressed_kind(buf[:2]) == "ZLIB":
        hint = " It looks ZLIB-compressed: decompress it first."
    return DataFileError(
        f"{path}: record {record} (at byte {offset}) is corrupt: {what}. Nothing from this file "
        f"is trained; write or copy the file again, or leave it out of the file list.{hint}"
    )
