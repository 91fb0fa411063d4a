"""Reading a shard of a file dataset: records in position order across files, one read per
window (shuffled) or per part asked (in order), never one per record; the blobs a tf.data
consumer gets, and Parquet batches as numpy columns."""

from __future__ import annotations

import numpy as np
import pytest

from master.client.files import Order, ShardReader, open_files
from master.client.files.elements import BlobCarrier, columns
from master.client.files.spans import ByteFile
from tests.unit.files_data import ids_of, write_parquet, write_text, write_tfrecord

SIZES = (700, 0, 1300, 500)  # records per file (one empty file among them)


@pytest.fixture
def tfrecords(tmp_path):
    start = 0
    for i, n in enumerate(SIZES):
        write_tfrecord(tmp_path / f"part-{i}.tfrecord", range(start, start + n))
        start += n
    files = open_files(str(tmp_path / "part-*.tfrecord"), "tfrecord", [])
    yield files
    files.close()


@pytest.fixture
def reads(monkeypatch):
    """Every ByteFile.read call, (first, end) local records."""
    calls = []
    real = ByteFile.read

    def read(self, lo, hi):
        calls.append((lo, hi))
        return real(self, lo, hi)

    monkeypatch.setattr(ByteFile, "read", read)
    return calls


def _read_all(reader, n):
    """Every record of a ShardReader, taken n at a time, as bytes."""
    parts = []
    while reader.remaining:
        part = reader.take(n)
        assert 1 <= len(part) <= n
        parts.append(part)
    records = []
    for part in parts:
        span = part.source
        for s, length in zip(span.starts[part.picks], span.lengths[part.picks], strict=True):
            records.append(span.data[s : s + length])
    return records


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_shard_reads_its_positions_records_in_order(tfrecords, shuffle):
    order = Order(tfrecords.size, shuffle, block=512, window=256, seed=7)
    for start, end in [(0, 2500), (650, 1900), (1999, 2001), (100, 101)]:
        expected = order.records(start, end, 3).tolist()
        assert ids_of(_read_all(ShardReader(tfrecords, order, start, end, 3), 64)) == expected


def test_in_order_parts_are_read_one_run_each_across_files(tfrecords, reads):
    order = Order(tfrecords.size)
    _read_all(ShardReader(tfrecords, order, 600, 2100, 0), 256)
    # Parts of 256 records; a part over a file's end reads both files, once each.
    assert reads[:4] == [(600, 700), (0, 156), (156, 412), (412, 668)]
    assert len(reads) == 8


def test_a_shuffled_window_is_read_once_whatever_the_parts(tfrecords, reads):
    order = Order(tfrecords.size, True, block=512, window=512, seed=1)
    _read_all(ShardReader(tfrecords, order, 0, 1024, 0), 10)
    assert 2 <= len(reads) <= 4  # two windows, each in one file or over two
    assert sum(hi - lo for lo, hi in reads) == 1024


def test_a_remainder_starting_mid_window_reads_that_window_once(tfrecords, reads):
    order = Order(tfrecords.size, True, block=512, window=512, seed=1)
    remainder = _read_all(ShardReader(tfrecords, order, 300, 512, 2), 64)
    assert ids_of(remainder) == order.records(300, 512, 2).tolist()
    assert sum(hi - lo for lo, hi in reads) <= 512  # at most the window, not a read a record


def _consume(carrier_out, held):
    """What a tf.data consumer of BlobCarrier elements cuts out: (records, held blob)."""
    blob, starts, lengths, carried = carrier_out
    old = [held[s : s + n] for s, n in zip(starts[:carried], lengths[:carried], strict=True)]
    new = [blob[s : s + n] for s, n in zip(starts[carried:], lengths[carried:], strict=True)]
    if carried < len(starts):
        held = blob
    else:
        assert blob == b""  # nothing new: no bytes cross again
    return old + new, held


@pytest.mark.parametrize("shuffle,batch", [(False, 100), (True, 100), (True, 1000)])
def test_blob_elements_give_each_batch_its_records(tfrecords, shuffle, batch):
    order = Order(tfrecords.size, shuffle, block=512, window=512, seed=2)
    shards = [(0, 333), (333, 1200), (1200, 1250), (1250, 2500)]
    expected = np.concatenate([order.records(a, b, 1) for a, b in shards]).tolist()
    readers = [ShardReader(tfrecords, order, a, b, 1) for a, b in shards]
    carrier, held, got, blobs = BlobCarrier(), b"", [], 0
    batch_parts: list = []
    have = 0
    for reader in readers:  # as ShardedDataset.batched_parts cuts them
        while reader.remaining:
            part = reader.take(batch - have)
            batch_parts.append(part)
            have += len(part)
            if have == batch:
                element = carrier.element(batch_parts)
                blobs += element[0] != b""
                records, held = _consume(element, held)
                got.extend(records)
                batch_parts, have = [], 0
    if batch_parts:
        got.extend(_consume(carrier.element(batch_parts), held)[0])
    assert ids_of(got) == expected
    if shuffle and batch == 100:
        # A window's bytes go out once, not with each of its batches.
        assert blobs < len(expected) // batch // 2


def test_text_records_are_lines_without_their_ends(tmp_path):
    write_text(tmp_path / "a.txt", range(0, 50), crlf=True)
    write_text(tmp_path / "b.txt", range(50, 120))
    files = open_files([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], "text", [])
    order = Order(files.size, True, block=64, window=32, seed=0)
    lines = _read_all(ShardReader(files, order, 0, files.size, 0), 16)
    assert [int(line.split(b",")[0]) for line in lines] == order.records(0, 120, 0).tolist()
    assert lines[0].endswith(b"," + str(int(lines[0].split(b",")[0]) * 3 % 7).encode())
    files.close()


@pytest.mark.parametrize("shuffle", [False, True])
def test_parquet_batches_are_numpy_columns_in_position_order(tmp_path, shuffle):
    write_parquet(tmp_path / "a.parquet", range(0, 250), rows_per_group=64)
    write_parquet(tmp_path / "b.parquet", range(250, 400), rows_per_group=100)
    files = open_files(str(tmp_path / "*.parquet"), "parquet", [])
    order = Order(files.size, shuffle, block=128, window=128, seed=3)
    reader = ShardReader(files, order, 30, 390, 4)
    ids = []
    while reader.remaining:
        batch = columns([reader.take(50)], ["id", "x", "name", "vec"])
        assert batch["x"].dtype == np.float32 and batch["vec"].shape == (len(batch["id"]), 2)
        assert np.array_equal(batch["x"], (batch["id"] % 13).astype(np.float32))
        assert batch["name"].tolist() == [f"r{i}" for i in batch["id"]]
        assert np.array_equal(batch["vec"][:, 1], -batch["id"].astype(np.float32))
        ids.extend(batch["id"].tolist())
    assert ids == order.records(30, 390, 4).tolist()
    files.close()


def test_parquet_columns_can_be_chosen(tmp_path):
    write_parquet(tmp_path / "a.parquet", range(10))
    files = open_files(str(tmp_path / "a.parquet"), "parquet", [], columns=["id"])
    reader = ShardReader(files, Order(files.size), 0, 10, 0)
    assert list(columns([reader.take(10)], ["id"])) == ["id"]
    files.close()
    with pytest.raises(Exception, match="columns \\['nope'\\] are not in"):
        open_files(str(tmp_path / "a.parquet"), "parquet", [], columns=["nope"])
