"""ShardedDataset: record indices handed out by the master, batched into a tf.data pipeline."""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from master.client import MasterClient, ProgressStream, process_heartbeat
from master.client.env import read_position_base
from master.client.files import FileSet, ShardReader
from master.client.files.agreement import check_same_files
from master.client.files.dataset_files import open_dataset_files
from master.client.files.elements import byte_element, grouped
from master.client.files.elements import columns as file_columns
from master.client.files.parquet import FORMAT as PARQUET
from master.pb import data_pb2

log = logging.getLogger(__name__)

# How long one blocking shard request may wait on the master before asking again.
SHARD_WAIT_MS = 5_000
# Batches of a file dataset crossing into tf.data together (a generator element costs ~0.5 ms).
GROUP_BATCHES = 16


class ShardSource(Protocol):
    """One shard's records, handed out in order a part at a time."""

    remaining: int

    def take(self, n: int) -> Any:
        """The next part: 1 to n records (a sized value)."""


class _IndexSource:
    """A shard's record indices (the master's, or computed here from its seed)."""

    def __init__(self, indices: np.ndarray) -> None:
        self._indices = indices
        self._cut = 0
        self.remaining = len(indices)

    @classmethod
    def of(cls, shard: data_pb2.Shard) -> _IndexSource:
        return cls(np.frombuffer(shard.record_indices, dtype="<i8").astype(np.int64))

    def take(self, n: int) -> np.ndarray:
        part = self._indices[self._cut : self._cut + n]
        self._cut += len(part)
        self.remaining -= len(part)
        return part


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
        # Set by CheckpointLedgerListener: it reports this dataset's checkpoints, the progress
        # hook need not.
        self.checkpoints_reported_elsewhere = False
        # Where the platform reads a dead trainer's position back, steps are reported once a
        # second (see master.client.progress); elsewhere each step as it ends.
        self._progress = ProgressStream(self.client, position_file=read_position_base(os.environ))
        if self._own_client and self.client.node is not None:
            # The process's beat outlives this dataset: a node that goes on after its data
            # ends (a final evaluation, another dataset) must not look lost to the master.
            self._progress.carry_heartbeats(process_heartbeat())
        spec = data_pb2.DatasetSpec(
            name=name,
            size=size,
            batch_size=batch_size,
            records_per_shard=records_per_shard,
            epochs=epochs,
            shuffle=shuffle,
            seed=seed,
        )
        try:
            self._register(spec)
        except BaseException:
            self._stop_client()
            raise

    def _register(self, spec: data_pb2.DatasetSpec) -> None:
        self.client.create_dataset(spec)

    @classmethod
    def from_files(
        cls,
        name: str,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        format: str,
        batch_size: int,
        epochs: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        **options: Any,
    ) -> FileShardedDataset:
        """A dataset of the records in `files` (a glob or a list): `format` "tfrecord",
        "text" (a record per line) or "parquet" (a record per row); `options` are those of
        FileShardedDataset."""
        return FileShardedDataset(
            name, files, format, batch_size, epochs=epochs, shuffle=shuffle, seed=seed, **options
        )

    def batches(self) -> Iterator[np.ndarray]:
        """Yield 1-D int64 arrays of record indices, `batch_size` each (the last may be short).

        Starting a new iteration first hands back whatever an earlier iteration in this
        process held but did not train on.
        """
        for parts in self.batched_parts(_IndexSource.of):
            yield np.concatenate(parts) if len(parts) > 1 else parts[0]

    def batched_parts(
        self, open_shard: Callable[[data_pb2.Shard], ShardSource], before_wait: Any = None
    ) -> Iterator[Any]:
        """Batches of `batch_size` records (the last may be short), each the list of parts
        `open_shard(shard).take(n)` returned; the tracker learns which shard records each
        batch holds as it is yielded. `before_wait`, when given, is yielded before each ask
        that may wait on the master (a consumer grouping batches sends what it has). A new
        iteration first hands back what an earlier one in this process held."""
        self.client.return_shards(self.name)
        self.tracker.reset()
        parts: list[Any] = []
        segments: list[tuple[int, int]] = []
        have = 0
        while True:
            if not have and before_wait is not None:
                yield before_wait
            reply = self.client.get_shard(self.name, wait_ms=0 if have else SHARD_WAIT_MS)
            if reply.status == data_pb2.GetShardReply.SHARD:
                shard = reply.shard
                source = open_shard(shard)
                consumed = 0
                while source.remaining > 0:
                    part = source.take(self.batch_size - have)
                    parts.append(part)
                    consumed += len(part)
                    have += len(part)
                    segments.append((shard.shard_id, consumed))
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

    def _emit(self, parts: list[Any], segments: list[tuple[int, int]]) -> list[Any]:
        # Keep only the last offset of each shard in this batch.
        last: dict[int, int] = {}
        for shard_id, consumed in segments:
            last[shard_id] = consumed
        self.tracker.produced(list(last.items()))
        return parts

    def to_tf_dataset(
        self,
        read_fn: Callable | None = None,
        prefetch: int = 2,
        parallel_reads: int = 2,
        *,
        python_reader: Callable | None = None,
        output_signature: Any = None,
    ):
        """A tf.data.Dataset of batches, each built from a 1-D int64 array of record indices.

        `read_fn` is made of TF ops: tf.data runs it (`map`) on an index tensor, in parallel.
        `python_reader` is plain Python: it gets a numpy int64 array and returns numpy arrays
        (or a tuple or dict of them), so records can come from any file format. Its
        `output_signature` (tf.TensorSpec structure) is found by reading record 0 once when not
        given. Order is kept either way (the progress hook relies on it). Autotuning is off: in
        a distributed graph-mode session, closing the iterator otherwise waits 15-20 s for its
        thread.
        """
        import tensorflow as tf

        if (read_fn is None) == (python_reader is None):
            raise TypeError(
                "to_tf_dataset takes one reader: read_fn (TF ops, run by tf.data on an index "
                "tensor) or python_reader= (plain Python/numpy, run on a numpy index array)"
            )
        if python_reader is not None:
            ds = self._python_reader_dataset(python_reader, output_signature)
        else:
            ds = tf.data.Dataset.from_generator(
                self.batches, output_signature=tf.TensorSpec(shape=[None], dtype=tf.int64)
            )
            try:
                ds = ds.map(read_fn, num_parallel_calls=parallel_reads, deterministic=True)
            except (NotImplementedError, TypeError, AttributeError) as e:
                raise TypeError(_python_reader_given(read_fn, e)) from e
        options = tf.data.Options()
        options.autotune.enabled = False
        options.deterministic = True
        return ds.prefetch(prefetch).with_options(options)

    def _python_reader_dataset(self, reader: Callable, output_signature: Any):
        """Batches read by a plain Python reader inside the shard generator."""
        import tensorflow as tf

        if output_signature is None:
            sample = reader(np.zeros(1, dtype=np.int64))
            _check_not_tf(reader, sample)
            output_signature = tf.nest.map_structure(_batch_spec, sample)

        def read_batches() -> Iterator[Any]:
            first = True
            for indices in self.batches():
                batch = reader(indices)
                if first:
                    _check_not_tf(reader, batch)
                    first = False
                yield batch

        return tf.data.Dataset.from_generator(read_batches, output_signature=output_signature)

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
        self._stop_client()

    def _stop_client(self) -> None:
        if self._own_client:
            self.client.close()


class FileShardedDataset(ShardedDataset):
    """The records of a set of files as one index space [0, size): file after file, record
    after record (Parquet: row after row). Made by ShardedDataset.from_files.

    The master's dataset is plain position ranges (registered unshuffled); with `shuffle=True`
    this node maps positions to records by blocks and windows (master.client.files.order), a
    pure function every node computes alike. Options: `block` and `window` (records; default
    block: 16 batches and at least 4096, window: the block), `columns` (Parquet: the columns
    read, default all), `cache_dirs` (where indexes go when a file's folder is read-only;
    default the run dir, then ~/.cache/dlrover), `index_threads`, `records_per_shard`,
    `client`.
    """

    def __init__(
        self,
        name: str,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        format: str,
        batch_size: int,
        epochs: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        *,
        block: int = 0,
        window: int = 0,
        columns: Sequence[str] | None = None,
        cache_dirs: Sequence[str] | None = None,
        index_threads: int = 0,
        records_per_shard: int = 0,
        client: MasterClient | None = None,
    ) -> None:
        self.files: FileSet
        self.files, self.order = open_dataset_files(
            files,
            format,
            batch_size,
            shuffle,
            seed,
            block=block,
            window=window,
            columns=columns,
            cache_dirs=cache_dirs,
            index_threads=index_threads,
        )
        self.format = format
        try:
            super().__init__(
                name,
                size=self.files.size,
                batch_size=batch_size,
                epochs=epochs,
                shuffle=False,  # positions are plain ranges; the shuffle is this node's mapping
                seed=seed,
                records_per_shard=records_per_shard,
                client=client,
            )
        except BaseException:
            self.files.close()
            raise

    def _register(self, spec: data_pb2.DatasetSpec) -> None:
        # Compared first: files that differ would otherwise show only as a size the master
        # refuses, or not at all.
        check_same_files(self.client, self.name, self.files, self.order)
        super()._register(spec)

    def _open_shard(self, shard: data_pb2.Shard) -> ShardReader:
        return ShardReader(self.files, self.order, shard.start, shard.end, shard.epoch)

    def batches(self) -> Iterator[np.ndarray]:
        """The record numbers of each batch (no file read): what the file-based iteration
        yields, for checks."""

        def numbers(shard: data_pb2.Shard) -> _IndexSource:
            return _IndexSource(self.order.records(shard.start, shard.end, shard.epoch))

        for parts in self.batched_parts(numbers):
            yield np.concatenate(parts) if len(parts) > 1 else parts[0]

    def elements(self) -> Iterator[tuple]:
        """Runs of up to GROUP_BATCHES batches, each batch's size last: (blob, starts,
        lengths, sizes) (TFRecord, text; see master.client.files.elements.byte_element), or
        (numpy columns, sizes) (Parquet)."""
        wait = object()
        runs = grouped(self.batched_parts(self._open_shard, wait), wait, GROUP_BATCHES)
        names = self.files.columns or (
            list(self.files.schema.names) if self.format == PARQUET else []
        )
        for parts, sizes in runs:
            counts = np.asarray(sizes, dtype=np.int64)
            if self.format == PARQUET:
                yield file_columns(parts, names), counts
            else:
                yield (*byte_element(parts), counts)

    def to_tf_dataset(  # type: ignore[override]
        self, parse_fn: Callable | None = None, prefetch: int = 2, parallel_parse: int = 2
    ):
        """A tf.data.Dataset of batches: a 1-D tf.string tensor of serialized records
        (TFRecord, text lines) or a dict of column tensors (Parquet), each passed through
        `parse_fn` (TF ops, run by tf.data on the whole batch) when given. Batch order is kept
        (the progress hook relies on it); autotuning is off (see ShardedDataset)."""
        import tensorflow as tf

        from dlrover_tf.file_input import byte_batches, column_batches

        if self.format == PARQUET:
            schema, names = self.files.schema, self.files.columns
            ds = column_batches(self.elements, schema, names, parse_fn, parallel_parse)
        else:
            ds = byte_batches(self.elements, parse_fn, parallel_parse)
        options = tf.data.Options()
        options.autotune.enabled = False
        options.deterministic = True
        return ds.prefetch(prefetch).with_options(options)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.files.close()


def _reader_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _python_reader_given(read_fn: Callable, error: Exception) -> str:
    """The message when a plain Python reader was given where TF ops were expected."""
    name = _reader_name(read_fn)
    return (
        f"read_fn {name!r} cannot run on a TF tensor ({type(error).__name__}: {error}). "
        "to_tf_dataset(read_fn) runs it inside tf.data on a symbolic index tensor, so it must "
        "be made of TF ops. For a plain Python/numpy reader (records from any file format) "
        f"call ds.to_tf_dataset(python_reader={name})"
    )


def _check_not_tf(reader: Callable, batch: Any) -> None:
    """A python_reader must return numpy/Python values: a TF reader goes to read_fn."""
    import tensorflow as tf

    if any(tf.is_tensor(x) for x in tf.nest.flatten(batch)):
        name = _reader_name(reader)
        raise TypeError(
            f"python_reader {name!r} returned TF tensors; a reader made of TF ops runs inside "
            f"tf.data: call ds.to_tf_dataset({name}) instead"
        )


def _batch_spec(value: Any):
    """The tf.TensorSpec of one component of a batch (any number of records)."""
    import tensorflow as tf

    array = np.asarray(value)
    if array.ndim == 0:
        raise TypeError(
            "python_reader returned a scalar; return one value per record (an array whose "
            "first dimension is the number of indices it was given)"
        )
    dtype = tf.string if array.dtype.kind in "USO" else tf.as_dtype(array.dtype)
    return tf.TensorSpec(shape=(None, *array.shape[1:]), dtype=dtype)
