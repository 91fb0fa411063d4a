"""ShardedDataset: record indices handed out by the master, batched into a tf.data pipeline."""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator

import numpy as np

from master.client import HeartbeatThread, MasterClient, ProgressStream
from master.client.env import read_position_base
from master.pb import data_pb2

log = logging.getLogger(__name__)

# How long one blocking shard request may wait on the master before asking again.
SHARD_WAIT_MS = 5_000


class BatchTracker:
    """Remembers which shard records each produced batch holds, until a step consumes it.

    Batches are produced by the input pipeline (ahead of training, because of
    prefetching) and consumed in the same order, one per training step.
    """

    def __init__(self) -> None:
        self._pending: collections.deque[list[tuple[int, int]]] = collections.deque()
        self._lock = threading.Lock()
        self.generation = 0

    def produced(self, segments: list[tuple[int, int]]) -> None:
        with self._lock:
            self._pending.append(segments)

    def consume(self) -> list[tuple[int, int]]:
        """(shard_id, cumulative consumed) pairs for the batch the last step trained on."""
        with self._lock:
            return self._pending.popleft() if self._pending else []

    def reset(self) -> None:
        with self._lock:
            self._pending.clear()
            self.generation += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


class ShardedDataset:
    """A dataset of `size` records whose shards come from the master, epoch by epoch.

    Registration is idempotent: every worker (and every restart) creates it with the
    same parameters and shares one ledger in the master.
    """

    def __init__(
        self,
        name: str,
        size: int,
        batch_size: int,
        epochs: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        records_per_shard: int = 0,
        client: MasterClient | None = None,
    ) -> None:
        self.name = name
        self.size = size
        self.batch_size = batch_size
        self.epochs = epochs
        self._own_client = client is None
        self.client = client or MasterClient.from_env()
        self.tracker = BatchTracker()
        # Where the platform reads a dead trainer's position back, steps are reported once a
        # second (see master.client.progress); elsewhere each step as it ends.
        self._progress = ProgressStream(self.client, position_file=read_position_base(os.environ))
        self._heartbeat: HeartbeatThread | None = None
        if self._own_client and self.client.node is not None:
            reply = self.client.register(socket.gethostname(), os.getpid())
            interval = max(reply.heartbeat_interval_ms, 200) / 1000
            self._heartbeat = HeartbeatThread(self.client, interval)
            self._heartbeat.start()
        self.client.create_dataset(
            data_pb2.DatasetSpec(
                name=name,
                size=size,
                batch_size=batch_size,
                records_per_shard=records_per_shard,
                epochs=epochs,
                shuffle=shuffle,
                seed=seed,
            )
        )

    def batches(self) -> Iterator[np.ndarray]:
        """Yield 1-D int64 arrays of record indices, `batch_size` each (the last may be short).

        Starting a new iteration first hands back whatever an earlier iteration in this
        process held but did not train on.
        """
        self.client.return_shards(self.name)
        self.tracker.reset()
        parts: list[np.ndarray] = []
        segments: list[tuple[int, int]] = []
        have = 0
        while True:
            reply = self.client.get_shard(self.name, wait_ms=0 if have else SHARD_WAIT_MS)
            if reply.status == data_pb2.GetShardReply.SHARD:
                shard = reply.shard
                indices = np.frombuffer(shard.record_indices, dtype="<i8").astype(np.int64)
                offset = 0
                while offset < len(indices):
                    take = min(self.batch_size - have, len(indices) - offset)
                    parts.append(indices[offset : offset + take])
                    offset += take
                    have += take
                    segments.append((shard.shard_id, offset))
                    if have == self.batch_size:
                        yield self._emit(parts, segments)
                        parts, segments, have = [], [], 0
                continue
            # No shard now: a partial batch goes out rather than waiting on others.
            if have:
                yield self._emit(parts, segments)
                parts, segments, have = [], [], 0
            if reply.status == data_pb2.GetShardReply.END:
                return

    def _emit(self, parts: list[np.ndarray], segments: list[tuple[int, int]]) -> np.ndarray:
        # Keep only the last offset of each shard in this batch.
        last: dict[int, int] = {}
        for shard_id, consumed in segments:
            last[shard_id] = consumed
        self.tracker.produced(list(last.items()))
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def to_tf_dataset(self, read_fn: Callable, prefetch: int = 2, parallel_reads: int = 2):
        """A tf.data.Dataset of batches: `read_fn` maps a 1-D int64 index tensor to one batch.

        Order is kept (the progress hook relies on it). Autotuning is off: in a distributed
        graph-mode session, closing the iterator otherwise waits 15-20 s for its thread.
        """
        import tensorflow as tf

        ds = tf.data.Dataset.from_generator(
            self.batches, output_signature=tf.TensorSpec(shape=[None], dtype=tf.int64)
        )
        ds = ds.map(read_fn, num_parallel_calls=parallel_reads, deterministic=True)
        options = tf.data.Options()
        options.autotune.enabled = False
        options.deterministic = True
        return ds.prefetch(prefetch).with_options(options)

    def step_done(self, global_step: int = 0, loss: float | None = None) -> None:
        """Report that one training step consumed the oldest produced batch (and its loss,
        which the master's dashboard charts).

        Reports go out on a progress stream: no round trip per step, and the report of
        step n is on the wire (or, coalescing, in the node's position file) before step n+1
        runs (see master.client.ProgressStream).
        """
        segments = self.tracker.consume()
        if segments:
            self._progress.send(self.name, segments, global_step, loss)

    def flush(self) -> None:
        """Wait until the master has applied every report sent so far."""
        reply = self._progress.close()
        if reply is not None and reply.stale:
            # Re-sent after a reconnect (already applied), or for shards given back meanwhile.
            log.info("the master skipped %d progress reports of shards it had closed", reply.stale)

    def close(self) -> None:
        self.flush()
        if self._heartbeat:
            self._heartbeat.stop()
        if self._own_client:
            self.client.close()
