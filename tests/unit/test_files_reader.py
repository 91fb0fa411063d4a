"""Reading a shard of a file dataset: records in position order across files, one read per
window (shuffled) or per part asked (in order), never one per record; the blobs a tf.data
consumer gets, and Parquet batches as numpy columns."""

from __future__ import annotations

import numpy as np
import pytest

from master.client.files import Order, ShardReader, fileset, open_files, shard_reader
from master.client.files.elements import byte_element, columns, grouped
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


def test_in_order_records_are_read_in_runs_one_read_per_file(tfrecords, reads, monkeypatch):
    order = Order(tfrecords.size)
    records = _read_all(ShardReader(tfrecords, order, 600, 2100, 0), 100)
    assert ids_of(records) == list(range(600, 2100))
    # One run: the rest of file 0, file 2 whole (file 1 is empty), the start of file 3.
    assert reads == [(600, 700), (0, 1300), (0, 100)]
    reads.clear()
    monkeypatch.setattr(shard_reader, "RUN_RECORDS", 256)
    _read_all(ShardReader(tfrecords, order, 600, 2100, 0), 100)
    # Runs of 256; one over a file's end reads both files, once each.
    assert reads[:4] == [(600, 700), (0, 156), (156, 412), (412, 668)]
    assert len(reads) == 8  # six runs, two of them over a file end


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


def _cut(element):
    """What tf.data cuts out of a byte element: the records."""
    blob, starts, lengths = element
    return [blob[s : s + n] for s, n in zip(starts, lengths, strict=True)]


@pytest.mark.parametrize("shuffle,batch", [(False, 100), (True, 100), (True, 1000)])
def test_byte_elements_of_grouped_batches_give_each_record_once(tfrecords, shuffle, batch):
    order = Order(tfrecords.size, shuffle, block=512, window=512, seed=2)
    shards = [(0, 333), (333, 1200), (1200, 1250), (1250, 2500)]
    expected = np.concatenate([order.records(a, b, 1) for a, b in shards]).tolist()
    flush = object()

    def batches():  # as ShardedDataset.batched_parts cuts them, a flush before each shard
        parts, have = [], 0
        for a, b in shards:
            if not have:
                yield flush
            reader = ShardReader(tfrecords, order, a, b, 1)
            while reader.remaining:
                part = reader.take(batch - have)
                parts.append(part)
                have += len(part)
                if have == batch:
                    yield parts
                    parts, have = [], 0
        if parts:
            yield parts

    got, runs = [], []
    for parts, sizes in grouped(batches(), flush, 4):
        assert 1 <= len(sizes) <= 4 and all(n <= batch for n in sizes)
        records = _cut(byte_element(parts))
        assert len(records) == sum(sizes)
        got.extend(records)
        runs.append(sizes)
    assert ids_of(got) == expected
    sizes = [n for run in runs for n in run]
    assert all(n == batch for n in sizes[:-1]) and sum(sizes) == len(expected)


def test_grouped_sends_what_it_has_before_a_wait():
    flush = object()
    stream = [[range(3)], flush, [range(2)], [range(5)], [range(1)], flush, flush, [range(4)]]
    runs = list(grouped(stream, flush, 2))
    assert [sizes for _, sizes in runs] == [[3], [2, 5], [1], [4]]


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


def test_at_most_max_open_files_stay_open(tfrecords, monkeypatch):
    monkeypatch.setattr(fileset, "MAX_OPEN_FILES", 2)
    order = Order(tfrecords.size, True, block=256, window=256, seed=5)
    for epoch in range(2):
        records = _read_all(ShardReader(tfrecords, order, 0, tfrecords.size, epoch), 100)
        assert ids_of(records) == order.records(0, tfrecords.size, epoch).tolist()
        assert len(tfrecords._readers) <= 2
