"""A trainer's latest data position in a node-local file, written at every step.

A progress stream that sends a report per second instead of per step (`ProgressStream` with a
position file) would lose up to a second of steps when its trainer is killed. Each step's
cumulative position therefore also goes into this file, one `pwrite` that the process's death
cannot tear; the platform, which outlives the trainer, reads it when the trainer ends and the
master applies it before it hands the trainer's shards back. So a failure still costs at most
the one batch in flight.
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import os
import struct
import zlib

log = logging.getLogger(__name__)

# Header: the write's sequence number, the JSON payload's length and its CRC-32; the payload
# follows. The checksum matters for a reader racing the writer (the master reads a live
# trainer's file before a ledger snapshot): a torn record is ignored, never half-read.
_HEADER = struct.Struct("<QII")
MAX_POSITION_BYTES = 1 << 20  # a reader never takes more than this from a file


_instances = itertools.count()


def stream_position_path(base: str) -> str:
    """The file of one progress stream of this process under the platform's `base` path (a
    process may run several streams; the platform reads every `base.*`)."""
    return f"{base}.{os.getpid()}-{next(_instances)}"


class PositionFile:
    """Writes {dataset: {shard_id: records consumed}} over the previous record, in one call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._seq = 0

    def write(self, positions: dict[str, dict[int, int]]) -> None:
        """Record the latest cumulative progress of the shards not yet reported to the master."""
        payload = json.dumps(
            {d: [[s, c] for s, c in shards.items()] for d, shards in positions.items()},
            separators=(",", ":"),
        ).encode()
        self._seq += 1
        # One pwrite: a killed process leaves either the previous record or this one (a longer
        # old record's tail is beyond the new length, so it is never read).
        header = _HEADER.pack(self._seq, len(payload), zlib.crc32(payload))
        os.pwrite(self._fd, header + payload, 0)

    def close(self) -> None:
        """Release the descriptor (the file stays for the platform to read)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_positions(path: str) -> dict[str, list[tuple[int, int]]]:
    """The last record of a position file: (shard_id, consumed) pairs per dataset; {} when the
    file is missing, empty or malformed (the master then re-queues from what it was told)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_POSITION_BYTES)
    except OSError:
        return {}
    if len(data) < _HEADER.size:
        return {}
    _, length, crc = _HEADER.unpack_from(data)
    payload = data[_HEADER.size : _HEADER.size + length]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return {}
    try:
        raw = json.loads(payload)
        return {
            str(d): [(int(s), int(c)) for s, c in pairs]
            for d, pairs in raw.items()
            if isinstance(pairs, list)
        }
    except (ValueError, TypeError, AttributeError) as e:
        log.warning("ignoring the malformed position file %s: %s", path, e)
        return {}


def collect_positions(base: str, remove: bool = True) -> dict[str, list[tuple[int, int]]]:
    """Every stream's last record under `base` (see stream_position_path), merged: the highest
    position per shard. The files are removed once read unless `remove` is False."""
    merged: dict[str, dict[int, int]] = {}
    for path in sorted(glob.glob(glob.escape(base) + ".*")):
        for dataset, pairs in read_positions(path).items():
            shards = merged.setdefault(dataset, {})
            for shard_id, consumed in pairs:
                shards[shard_id] = max(consumed, shards.get(shard_id, 0))
        if remove:
            try:
                os.unlink(path)
            except OSError:
                pass
    return {d: sorted(shards.items()) for d, shards in merged.items() if shards}


def encode_positions(positions: dict[str, list[tuple[int, int]]]) -> str:
    """A position record as text (how a platform hands it to the master in a node event)."""
    return json.dumps({d: [list(p) for p in pairs] for d, pairs in positions.items()})


def decode_positions(text: str) -> dict[str, list[tuple[int, int]]]:
    """The inverse of encode_positions; {} for empty or malformed text."""
    try:
        raw = json.loads(text) if text else {}
        return {str(d): [(int(s), int(c)) for s, c in pairs] for d, pairs in raw.items()}
    except (ValueError, TypeError, AttributeError):
        return {}
