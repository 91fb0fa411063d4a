"""Flash-checkpoint storage: durable checksummed files, commit by manifest, tracker, pruning."""

from __future__ import annotations

import os

import pytest

from dlrover_torch.checkpoint import storage
from dlrover_torch.checkpoint.errors import CorruptCheckpointError


def write_step(root, step, ranks=(0,), writers=(0,), payload=b"x" * 1000):
    d = storage.step_dir(str(root), step)
    os.makedirs(d, exist_ok=True)
    for r in ranks:
        name = storage.flash_file_name(r)
        digest = storage.write_durable(os.path.join(d, name), [payload])
        manifest = {
            "format": "flash",
            "step": step,
            "rank": r,
            "writers": list(writers),
            "files": {name: digest.to_json()},
        }
        storage.write_json_durable(os.path.join(d, storage.manifest_name(r)), manifest)
    return d


def test_chunked_crc_detects_a_flipped_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "CHUNK_BYTES", 1024)
    data = os.urandom(5000)
    path = str(tmp_path / "f")
    digest = storage.write_durable(path, [data[:100], memoryview(data)[100:]])
    assert digest.size == 5000 and len(digest.crc32) == 5
    buf = bytearray(5000)
    storage.read_verified(path, digest, memoryview(buf))
    assert bytes(buf) == data
    storage.verify_file(path, digest)
    with open(path, "r+b") as fh:
        fh.seek(3000)
        byte = fh.read(1)
        fh.seek(3000)
        fh.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="bytes 2048..3072"):
        storage.read_verified(path, digest, memoryview(buf))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        storage.verify_file(path, digest)


def test_truncated_or_missing_file_is_corrupt(tmp_path):
    path = str(tmp_path / "f")
    digest = storage.write_durable(path, [b"abc" * 100])
    os.truncate(path, 10)
    with pytest.raises(CorruptCheckpointError, match="manifest says 300"):
        storage.verify_file(path, digest)
    os.unlink(path)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        storage.verify_file(path, digest)


def test_write_durable_leaves_no_file_when_cancelled(tmp_path):
    path = str(tmp_path / "f")
    with pytest.raises(InterruptedError):
        storage.write_durable(path, [b"a", b"b"], should_abort=lambda: True)
    assert os.listdir(tmp_path) == []


def test_step_commits_only_when_every_writer_has_a_manifest(tmp_path):
    write_step(tmp_path, 10, ranks=(0, 1), writers=(0, 1))
    write_step(tmp_path, 20, ranks=(0,), writers=(0, 1))  # rank 1 never finished
    assert storage.is_complete(storage.step_dir(str(tmp_path), 10))
    assert not storage.is_complete(storage.step_dir(str(tmp_path), 20))
    assert storage.committed_steps(str(tmp_path)) == [10]


def test_steps_newer_than_the_tracker_are_not_committed(tmp_path):
    write_step(tmp_path, 1)
    write_step(tmp_path, 2)
    assert storage.advance_tracker(str(tmp_path), 1, keep_latest=None)
    assert storage.committed_steps(str(tmp_path)) == [1]
    assert not storage.advance_tracker(str(tmp_path), 1, keep_latest=None)
    assert storage.advance_tracker(str(tmp_path), 2, keep_latest=None)
    assert storage.committed_steps(str(tmp_path)) == [2, 1]


def test_tracker_never_moves_back_and_prunes_to_keep_latest(tmp_path):
    for step in (1, 2, 3, 4):
        write_step(tmp_path, step)
        storage.advance_tracker(str(tmp_path), step, keep_latest=2)
    assert not storage.advance_tracker(str(tmp_path), 3, keep_latest=2)
    assert storage.read_tracker(str(tmp_path)) == 4
    assert storage.list_steps(str(tmp_path)) == [4, 3]


def test_unreadable_tracker_is_ignored(tmp_path):
    write_step(tmp_path, 5)
    (tmp_path / storage.TRACKER).write_bytes(b"\x00garbage")
    assert storage.read_tracker(str(tmp_path)) is None
    assert storage.committed_steps(str(tmp_path)) == [5]


def test_page_aligned_files_are_read_directly_and_still_verified(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "CHUNK_BYTES", 8192)
    data = os.urandom(5 * 4096)
    path = str(tmp_path / "aligned")
    digest = storage.write_durable(path, [data], direct=True)
    import mmap

    buf = mmap.mmap(-1, len(data))  # page aligned, as restore buffers are
    storage.read_verified(path, digest, memoryview(buf))
    assert buf[:] == data
    with open(path, "r+b") as fh:
        fh.seek(4096 * 4 + 7)
        fh.write(b"\x00" if data[4096 * 4 + 7] else b"\x01")
    with pytest.raises(CorruptCheckpointError, match="bytes 16384..20480"):
        storage.read_verified(path, digest, memoryview(buf))
