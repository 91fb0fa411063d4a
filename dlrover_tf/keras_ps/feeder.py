"""ShardFeeder: the coordinator's shard bookkeeping, batches of record indices cut from the
master's shards, and exact (prefix) progress reports as the steps resolve."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from master.client import MasterClient, ProgressStream
from master.pb import data_pb2

# How long one blocking shard request may wait on the master before asking again.
SHARD_WAIT_MS = 5_000


@dataclass
class Batch:
    """One step's record indices and where they came from: (shard_id, start, end) ranges."""

    id: int
    indices: np.ndarray
    segments: list[tuple[int, int, int]]


@dataclass
class _Shard:
    """A shard the feeder holds: its record indices, how far they are cut and reported."""

    indices: np.ndarray
    cut: int = 0  # records already put into batches
    reported: int = 0  # records reported consumed (a prefix: the master counts prefixes)
    done: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


class ShardFeeder:
    """Batches of record indices cut from the master's shards, and exact progress reports.

    `next_batch()` hands out a batch; `done(batch)` marks it trained once its step's result
    resolved; `again(batch)` hands it out again (a step that never ran). The master counts
    consumed records as a prefix of each shard, so records done after an unresolved one are
    reported once the gap is filled. Thread-safe.
    """

    def __init__(self, dataset: Any) -> None:  # a dlrover_tf.ShardedDataset
        self.dataset = dataset
        self.name: str = dataset.name
        self.batch_size: int = dataset.batch_size
        self._client: MasterClient = dataset.client
        self._progress = ProgressStream(self._client)
        self._lock = threading.Lock()
        self._shards: collections.OrderedDict[int, _Shard] = collections.OrderedDict()
        self._again: collections.deque[Batch] = collections.deque()
        self._next_id = 0
        self.ended = False
        self.records_done = 0
        # Whatever an earlier incarnation held goes back (the master also frees it on exit).
        self._client.return_shards(self.name)

    def next_batch(self, wait_ms: int = SHARD_WAIT_MS) -> Batch | None:
        """The next batch, or None: none now (in-flight steps may end the data) or `ended`."""
        with self._lock:
            if self._again:
                return self._again.popleft()
        parts: list[tuple[int, int, int]] = []
        have = 0
        while have < self.batch_size:
            with self._lock:
                shard_id, shard = self._open_shard()
            if shard is None:
                reply = self._client.get_shard(self.name, wait_ms=0 if have else wait_ms)
                if reply.status == data_pb2.GetShardReply.SHARD:
                    indices = np.frombuffer(reply.shard.record_indices, dtype="<i8")
                    with self._lock:
                        self._shards[reply.shard.shard_id] = _Shard(
                            indices.astype(np.int64), done=np.zeros(len(indices), bool)
                        )
                    continue
                if reply.status == data_pb2.GetShardReply.END and not have:
                    self.ended = True
                break  # a short batch goes out rather than waiting on others' shards
            take = min(self.batch_size - have, len(shard.indices) - shard.cut)
            parts.append((shard_id, shard.cut, shard.cut + take))
            shard.cut += take
            have += take
        if not parts:
            return None
        with self._lock:
            self._next_id += 1
            indices = np.concatenate([self._shards[s].indices[a:b] for s, a, b in parts])
            return Batch(self._next_id, indices, parts)

    def _open_shard(self) -> tuple[int, _Shard | None]:
        for shard_id, shard in self._shards.items():
            if shard.cut < len(shard.indices):
                return shard_id, shard
        return -1, None

    def done(self, batch: Batch, global_step: int = 0, loss: float | None = None) -> None:
        """The step that trained `batch` resolved: report what it completes."""
        reports = []
        with self._lock:
            for shard_id, start, end in batch.segments:
                shard = self._shards.get(shard_id)
                if shard is None:
                    continue
                shard.done[start:end] = True
                prefix = shard.reported
                while prefix < len(shard.done) and shard.done[prefix]:
                    prefix += 1
                if prefix > shard.reported:
                    self.records_done += prefix - shard.reported
                    shard.reported = prefix
                    reports.append((shard_id, prefix))
                if prefix == len(shard.indices):
                    del self._shards[shard_id]
        if reports:
            self._progress.send(self.name, reports, global_step, loss)

    def again(self, batch: Batch) -> None:
        """Hand `batch` out again before anything new (its step did not run to the end)."""
        with self._lock:
            self._again.append(batch)

    def flush(self) -> None:
        """Wait until the master has applied every report sent so far."""
        self._progress.close()
