"""Per-file indexes of file datasets: TFRecord offsets with both CRCs checked, text line starts,
Parquet row groups and schemas; their cache next to the data or elsewhere, reused while the
file is unchanged and rebuilt when it changes; and the errors bad input gets."""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np
import pytest

from master.client.files import cache, fileset, parquet, text, tfrecord
from master.client.files.errors import DataFileError, FileChangedError
from master.client.files.fileset import open_files, resolve
from tests.unit.files_data import frame, record, write_parquet, write_text, write_tfrecord


def test_tfrecord_offsets_are_every_record_and_the_end(tmp_path):
    path = tmp_path / "a.tfrecord"
    offsets = write_tfrecord(path, range(500))
    index = tfrecord.build_index(str(path))
    assert index.count == 500
    assert index.array.tolist() == offsets


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_tfrecord_records_across_read_chunks_are_found(tmp_path, monkeypatch, chunk):
    path = tmp_path / "a.tfrecord"
    offsets = write_tfrecord(path, range(300))
    with open(path, "ab") as f:  # a record much larger than a chunk
        f.write(frame(b"x" * 5000))
    offsets.append(os.path.getsize(path))
    monkeypatch.setattr(tfrecord, "CHUNK_BYTES", chunk)
    assert tfrecord.build_index(str(path)).array.tolist() == offsets


def test_an_empty_tfrecord_file_has_no_record(tmp_path):
    path = tmp_path / "empty.tfrecord"
    path.write_bytes(b"")
    index = tfrecord.build_index(str(path))
    assert (index.count, index.array.tolist()) == (0, [0])


def _corrupt(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where,what", [(12 + 3, "data's checksum"), (2, "length's checksum")])
def test_a_bad_crc_is_refused_naming_file_record_and_offset(tmp_path, where, what):
    path = tmp_path / "bad.tfrecord"
    offsets = write_tfrecord(path, range(50))
    _corrupt(path, offsets[37] + where)
    with pytest.raises(DataFileError) as e:
        tfrecord.build_index(str(path))
    message = str(e.value)
    assert str(path) in message and what in message
    assert f"record 37 (at byte {offsets[37]})" in message
    assert "write or copy the file again" in message


def test_a_length_crc_error_far_into_a_big_file_is_found_in_its_chunk(tmp_path, monkeypatch):
    path = tmp_path / "bad.tfrecord"
    offsets = write_tfrecord(path, range(2000))
    _corrupt(path, offsets[1500] + 1)  # a length pointing far away, with a bad checksum
    monkeypatch.setattr(tfrecord, "CHUNK_BYTES", 4096)
    with pytest.raises(DataFileError, match=f"record 1500 \\(at byte {offsets[1500]}\\)"):
        tfrecord.build_index(str(path))


def test_a_truncated_tfrecord_file_is_refused(tmp_path):
    path = tmp_path / "cut.tfrecord"
    offsets = write_tfrecord(path, range(20))
    with open(path, "r+b") as f:
        f.truncate(offsets[-1] - 3)
    with pytest.raises(DataFileError, match="ends in the middle of record 19.*truncated"):
        tfrecord.build_index(str(path))


def test_gzip_tfrecord_is_refused_with_the_fix(tmp_path):
    plain = tmp_path / "a.tfrecord"
    write_tfrecord(plain, range(10))
    path = tmp_path / "a.tfrecord.gz"
    path.write_bytes(gzip.compress(plain.read_bytes()))
    with pytest.raises(DataFileError) as e:
        tfrecord.build_index(str(path))
    message = str(e.value)
    assert str(path) in message and "compressed TFRecord file (GZIP)" in message
    assert "Decompress it" in message and "compression_type='GZIP'" in message


def test_a_zlib_tfrecord_gets_a_hint(tmp_path):
    plain = tmp_path / "a.tfrecord"
    write_tfrecord(plain, range(10))
    path = tmp_path / "z.tfrecord"
    path.write_bytes(zlib.compress(plain.read_bytes()))
    with pytest.raises(DataFileError, match="looks ZLIB-compressed"):
        tfrecord.build_index(str(path))


LINES = b"a,1\r\nb,2\n\nc\n" + b"x" * 30 + b"\nlast"


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_text_index_is_line_starts_and_the_end(tmp_path, monkeypatch, chunk):
    path = tmp_path / "a.txt"
    path.write_bytes(LINES)
    monkeypatch.setattr(text, "CHUNK_BYTES", chunk)
    index = text.build_index(str(path))
    assert index.array.tolist() == [0, 5, 9, 10, 12, 43, len(LINES)]
    data = np.frombuffer(LINES, np.uint8)
    lengths = text.line_lengths(data, index.array[:-1], index.array[1:])
    lines = [LINES[s : s + n] for s, n in zip(index.array[:-1], lengths, strict=True)]
    assert lines == [b"a,1", b"b,2", b"", b"c", b"x" * 30, b"last"]


@pytest.mark.parametrize(
    "content,count", [(b"", 0), (b"\n", 1), (b"\n\n", 2), (b"a", 1), (b"a\n", 1), (b"\r\n", 1)]
)
def test_text_line_counts_at_the_edges(tmp_path, content, count):
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    index = text.build_index(str(path))
    assert index.count == count and index.array[-1] == len(content)


def test_parquet_index_is_rows_per_row_group(tmp_path):
    path = tmp_path / "a.parquet"
    write_parquet(path, range(1050), rows_per_group=100)
    index = parquet.build_index(str(path))
    assert index.array.tolist() == [100] * 10 + [50] and index.count == 1050
    assert parquet.schema_of(index).names == ["id", "x", "name", "vec"]


def test_parquet_files_with_another_schema_are_refused_naming_both(tmp_path):
    write_parquet(tmp_path / "a.parquet", range(10))
    write_parquet(tmp_path / "b.parquet", range(10, 20), extra_column=True)
    with pytest.raises(DataFileError) as e:
        open_files(str(tmp_path / "*.parquet"), "parquet", [str(tmp_path / "cache")])
    message = str(e.value)
    assert str(tmp_path / "a.parquet") in message and str(tmp_path / "b.parquet") in message
    assert "more: int64" in message and "same schema" in message


def test_a_file_that_is_not_parquet_is_refused(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataFileError, match="not a readable Parquet file"):
        parquet.build_index(str(path))


def _counting(monkeypatch, fmt):
    calls = []
    real = fileset.BUILDERS[fmt]

    def build(path):
        calls.append(path)
        return real(path)

    monkeypatch.setitem(fileset.BUILDERS, fmt, build)
    return calls


def test_an_index_is_cached_next_to_its_file_and_reused(tmp_path, monkeypatch):
    for i in range(3):
        write_tfrecord(tmp_path / f"p{i}.tfrecord", range(i * 100, i * 100 + 100))
    calls = _counting(monkeypatch, "tfrecord")
    first = open_files(str(tmp_path / "*.tfrecord"), "tfrecord", [])
    assert len(calls) == 3 and first.size == 300
    assert os.path.exists(tmp_path / ".p0.tfrecord.tfrecord.dlrover-index")
    again = open_files(str(tmp_path / "*.tfrecord"), "tfrecord", [])
    assert len(calls) == 3  # all three read from the cache
    assert [i.array.tolist() for i in again.indexes] == [i.array.tolist() for i in first.indexes]
    # The glob does not see the (hidden) index files.
    assert resolve(str(tmp_path / "*")) == [str(tmp_path / f"p{i}.tfrecord") for i in range(3)]


def test_a_changed_file_is_indexed_again(tmp_path, monkeypatch):
    path = tmp_path / "a.tfrecord"
    write_tfrecord(path, range(100))
    calls = _counting(monkeypatch, "tfrecord")
    assert open_files(str(path), "tfrecord", []).size == 100
    with open(path, "ab") as f:
        f.write(frame(record(100)))
    assert open_files(str(path), "tfrecord", []).size == 101
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # same size, touched
    assert open_files(str(path), "tfrecord", []).size == 101
    assert len(calls) == 3


def test_where_the_files_folder_takes_no_index_the_fallback_dir_does(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    path = data / "a.txt"
    write_text(path, range(10))
    # The index's place next to the file is taken by a folder: writing there fails (as it
    # does in a read-only folder, which root would not notice).
    (data / ".a.txt.text.dlrover-index").mkdir()
    fallback = tmp_path / "run" / "file-index"
    calls = _counting(monkeypatch, "text")
    assert open_files(str(path), "text", [str(fallback)]).size == 10
    assert len(os.listdir(fallback)) == 1
    assert open_files(str(path), "text", [str(fallback)]).size == 10
    assert len(calls) == 1


def test_an_unreadable_cached_index_is_ignored_and_rebuilt(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    write_text(path, range(10))
    open_files(str(path), "text", [])
    where = tmp_path / ".a.txt.text.dlrover-index"
    where.write_bytes(cache.MAGIC + b"\xff\xff")
    calls = _counting(monkeypatch, "text")
    assert open_files(str(path), "text", []).size == 10 and len(calls) == 1


def test_default_cache_dirs_are_the_run_dir_then_the_user_cache():
    dirs = cache.default_cache_dirs({"DLROVER_RUN_DIR": "/r", "XDG_CACHE_HOME": "/c"})
    assert dirs == ["/r/file-index", "/c/dlrover/file-index"]
    assert cache.default_cache_dirs({"HOME": "/h"})[-1].endswith(".cache/dlrover/file-index")


def test_a_file_changed_after_indexing_is_not_read(tmp_path):
    path = tmp_path / "a.tfrecord"
    write_tfrecord(path, range(100))
    files = open_files(str(path), "tfrecord", [])
    assert len(files.read_span(0, 10)) == 10
    with open(path, "ab") as f:
        f.write(frame(record(100)))
    with pytest.raises(FileChangedError) as e:
        files.read_span(10, 20)
    assert str(path) in str(e.value) and "nothing is read from it" in str(e.value)
    files.close()


def test_an_empty_glob_and_a_missing_file_name_what_to_fix(tmp_path):
    with pytest.raises(DataFileError, match="no file matches .*nothing-\\*"):
        resolve(str(tmp_path / "nothing-*"))
    write_text(tmp_path / "a.txt", range(3))
    missing = str(tmp_path / "b.txt")
    with pytest.raises(DataFileError, match=f"{missing}: no such file"):
        resolve([str(tmp_path / "a.txt"), missing])
    with pytest.raises(DataFileError, match="is a directory"):
        resolve(str(tmp_path))
    with pytest.raises(DataFileError, match="list of files is empty"):
        resolve([])


def test_globs_are_sorted_and_lists_kept_in_order(tmp_path):
    for name in ("b.txt", "a.txt", "c.txt"):
        write_text(tmp_path / name, range(2))
    assert [os.path.basename(p) for p in resolve(str(tmp_path / "*.txt"))] == [
        "a.txt",
        "b.txt",
        "c.txt",
    ]
    listed = [str(tmp_path / "c.txt"), str(tmp_path / "a.txt")]
    assert resolve(listed) == listed


def test_files_without_records_are_refused(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    with pytest.raises(DataFileError, match="hold no record"):
        open_files(str(tmp_path / "a.txt"), "text", [])
    with pytest.raises(ValueError, match="not one of"):
        open_files(str(tmp_path / "a.txt"), "csv", [])
