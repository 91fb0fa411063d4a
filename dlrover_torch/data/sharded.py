"""ShardedDataset for torch: batches of the master's shards (over a map-style dataset, or over
files), read by DataLoader workers, reported as the loop trains on them, saved with the model."""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from master.client import MasterClient, MasterError, ProgressStream
from master.client.env import read_position_base
from master.client.files import FileSet, ShardReader
from master.client.files.agreement import check_same_files
from master.client.files.dataset_files import open_dataset_files
from master.client.files.elements import byte_element
from master.client.files.elements import columns as file_columns
from master.client.files.parquet import FORMAT as PARQUET
from master.pb import data_pb2

log = logging.getLogger(__name__)

# Asks never wait on the master: a wait left by a process that died goes on there and can be
# granted after the restarted process gave the node's shards back, leaving a shard that nobody
# reads (the node is the holder; the TF side's fresh incarnation ids fence that). A reader that
# finds nothing to take now asks again after a pause that grows to PENDING_PAUSE_MAX_S; this
# happens only at the end of the last epoch, while other readers finish theirs.
PENDING_PAUSE_MIN_S = 0.05
PENDING_PAUSE_MAX_S = 1.0

Segments = list[tuple[int, int]]  # (shard_id, records of it consumed up to this batch)


class _Indices:
    """A shard's record indices, handed out a part at a time."""

    def __init__(self, indices: np.ndarray) -> None:
        self._indices = indices
        self.remaining = len(indices)

    def take(self, n: int) -> np.ndarray:
        cut = len(self._indices) - self.remaining
        part = self._indices[cut : cut + n]
        self.remaining -= len(part)
        return part


def shard_batches(
    client: MasterClient, name: str, batch_size: int, open_shard: Callable[[Any], Any]
) -> Iterator[tuple[list[Any], Segments]]:
    """(parts, segments) per batch of `batch_size` records from the shards `client` is given
    (the last may be short, and so is one sent out rather than wait for a shard)."""
    parts: list[Any] = []
    segments: dict[int, int] = {}
    have = 0
    pause = PENDING_PAUSE_MIN_S
    while True:
        reply = client.get_shard(name)
        if reply.status == data_pb2.GetShardReply.SHARD:
            pause = PENDING_PAUSE_MIN_S
            shard = reply.shard
            source = open_shard(shard)
            consumed = 0
            while source.remaining > 0:
                part = source.take(batch_size - have)
                parts.append(part)
                consumed += len(part)
                have += len(part)
                segments[shard.shard_id] = consumed
                if have == batch_size:
                    yield parts, list(segments.items())
                    parts, segments, have = [], {}, 0
            continue
        if have:
            yield parts, list(segments.items())
            parts, segments, have = [], {}, 0
        if reply.status == data_pb2.GetShardReply.END:
            return
        time.sleep(pause)
        pause = min(2 * pause, PENDING_PAUSE_MAX_S)


def _identity(item: Any) -> Any:
    return item


class ShardedDataset(IterableDataset):
    """Batches of a map-style `dataset` whose records come from the master's shards.

    Every rank (and every restart) builds it with the same arguments: they share one ledger
    in the master. Iterate `ds.loader(num_workers=...)` (each DataLoader worker asks the
    master for shards of its own), call `ds.step_done()` after each training step, and keep
    `ds.state_dict()` with the model: `load_state_dict` brings the data back to that point.
    Ranks may get different numbers of batches (shards go to whoever asks).
    """

    def __init__(
        self,
        name: str,
        dataset: Any,
        batch_size: int,
        epochs: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        records_per_shard: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        client: MasterClient | None = None,
    ) -> None:
        self.name = name
        self.dataset = dataset
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self.batch_size = batch_size
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self._own_client = client is None
        self.client = client or MasterClient.from_env()
        self._spec = data_pb2.DatasetSpec(
            name=name,
            size=self._size(),
            batch_size=batch_size,
            records_per_shard=records_per_shard,
            epochs=epochs,
            shuffle=self._registered_shuffle(),
            seed=seed,
        )
        # The master's shard holder is the node: its local ranks share it (torchrun's names).
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self._pending: collections.deque[Segments] = collections.deque()
        self._steps = 0
        self._progress = ProgressStream(self.client, position_file=read_position_base(os.environ))
        try:
            self._register()
        except BaseException:
            self._stop_client()
            raise

    @property
    def size(self) -> int:
        return int(self._spec.size)

    def _size(self) -> int:
        return len(self.dataset)

    def _registered_shuffle(self) -> bool:
        return self.shuffle

    def _register(self) -> None:
        self.client.create_dataset(self._spec)

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
        """Batches of the records in `files` (a glob or a list): "tfrecord", "text" (a record
        per line) or "parquet" (a record per row); `options` are FileShardedDataset's."""
        return FileShardedDataset(
            name, files, format, batch_size, epochs=epochs, shuffle=shuffle, seed=seed, **options
        )

    # -- reading (in a DataLoader worker, or in the main process) -----------------------

    def __iter__(self) -> Iterator[tuple[Any, Segments]]:
        """(batch, segments) pairs; `loader()` hands the loop the batches alone."""
        worker = get_worker_info()
        client = self.client
        if worker is not None:
            client = self.client.clone()  # a channel of this process's own (after fork)
            client.create_dataset(self._spec)  # identical: indices are computed here
        try:
            for parts, segments in shard_batches(client, self.name, self.batch_size, self._open):
                yield self._read(parts), segments
        finally:
            if worker is not None:
                client.close()

    def _open(self, shard: data_pb2.Shard) -> Any:
        return _Indices(np.frombuffer(shard.record_indices, dtype="<i8"))

    def _read(self, parts: list[Any]) -> Any:
        indices = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return self.collate_fn([self.dataset[int(i)] for i in indices])

    def loader(self, **kwargs: Any) -> ShardLoader:
        """A DataLoader over this dataset (DataLoader's keyword arguments: num_workers,
        pin_memory, prefetch_factor, multiprocessing_context, ...) yielding the batches."""
        return ShardLoader(self, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled to a spawned DataLoader worker: what reading needs, not the main
        process's progress stream (the client pickles as its settings)."""
        state = dict(self.__dict__)
        state["_progress"] = None
        state["_pending"] = collections.deque()
        return state

    # -- the training loop's side (main process) ----------------------------------------

    def _produced(self, segments: Segments) -> None:
        self._pending.append(segments)

    def _start_reading(self) -> None:
        """Before a new pass: give back the shards this node held and did not train on (an
        earlier pass's prefetch, or a crashed process's), once per node."""
        self._pending.clear()
        if self._local_rank == 0:
            self.client.return_shards(self.name)
        if self._local_world > 1 and dist.is_initialized():
            dist.barrier()  # no local rank asks before its node's shards are back

    def step_done(self, global_step: int | None = None, loss: float | None = None) -> None:
        """The loop trained on the oldest batch it was handed: report it (no round trip per
        step; see master.client.ProgressStream)."""
        self._steps = self._steps + 1 if global_step is None else global_step
        if self._pending:
            self._progress.send(self.name, self._pending.popleft(), self._steps, loss)

    def flush(self) -> None:
        """Wait until the master has applied every report sent so far."""
        reply = self._progress.close()
        if reply is not None and reply.stale:
            log.info("the master skipped %d progress reports of shards it had closed", reply.stale)

    def state_dict(self, global_step: int | None = None) -> dict[str, Any]:
        """The data position as of the last step_done, kept by the master under `global_step`
        (default: the steps done). Call it on every rank at the same step: a rank's own
        reports are applied before it saves."""
        if get_worker_info() is not None:
            raise TypeError(
                "ShardedDataset.state_dict() was called in a DataLoader worker (a loader that "
                "snapshots its dataset, e.g. StatefulDataLoader?): iterate ds.loader(...) and "
                "save ds.state_dict() from the training loop"
            )
        step = self._steps if global_step is None else global_step
        self.flush()
        self.client.save_ledger(self.name, step)
        return {
            "dataset": self.name,
            "global_step": step,
            "size": self.size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epochs": self.epochs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Roll the dataset back to the saved position (the master's snapshot of that step);
        done once, by rank 0, before any rank reads on."""
        mine = {"dataset": self.name, "size": self.size, "shuffle": self.shuffle, "seed": self.seed}
        differ = [
            f"{k}={state.get(k)!r} (here: {v!r})" for k, v in mine.items() if state.get(k) != v
        ]
        if differ:
            raise ValueError(
                "the data state was saved for another dataset: " + ", ".join(differ) + ". "
                "Build the ShardedDataset as it was when saved, or start without loading it."
            )
        step = int(state["global_step"])
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                found = self.client.restore_ledger(self.name, step).global_step
            except MasterError as e:
                found, error = -1, str(e)
            else:
                error = f"the master went back to step {found}, its latest saved before it"
            if found != step:
                raise MasterError(
                    f"cannot bring dataset {self.name!r} back to step {step}: {error}. The "
                    "master keeps the positions saved in its own job (ds.state_dict()); a state "
                    "saved in another job cannot be restored: start without loading it"
                )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        self._steps = step

    def close(self) -> None:
        self.flush()
        self._stop_client()

    def _stop_client(self) -> None:
        if self._own_client:
            self.client.close()


class FileShardedDataset(ShardedDataset):
    """Batches of the records of a set of files, as one index space (file after file). Made
    by ShardedDataset.from_files. A batch is `parse_fn(records)`: records are a list of bytes
    (TFRecord, text lines) or a dict of numpy columns (Parquet), passed as they are without
    `parse_fn`. Options as dlrover_tf's: `block`, `window`, `columns`, `cache_dirs`,
    `index_threads`, `records_per_shard`, `client`."""

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
        parse_fn: Callable[[Any], Any] | None = None,
        block: int = 0,
        window: int = 0,
        columns: Sequence[str] | None = None,
        cache_dirs: Sequence[str] | None = None,
        index_threads: int = 0,
        records_per_shard: int = 0,
        client: MasterClient | None = None,
    ) -> None:
        fileset, self.order = open_dataset_files(
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
        self.files: FileSet | None = fileset
        self._file_args = (fileset.indexes, format, fileset.columns)
        self.format = format
        self.parse_fn = parse_fn
        try:
            super().__init__(
                name,
                None,
                batch_size,
                epochs=epochs,
                shuffle=shuffle,
                seed=seed,
                records_per_shard=records_per_shard,
                client=client,
            )
        except BaseException:
            self.files.close()
            raise

    def _size(self) -> int:
        return self.order.size

    def _registered_shuffle(self) -> bool:
        return False  # positions are plain ranges; the shuffle is this node's mapping

    def _register(self) -> None:
        check_same_files(self.client, self.name, self.files, self.order)
        super()._register()

    def __iter__(self) -> Iterator[tuple[Any, Segments]]:
        if get_worker_info() is not None or self.files is None:
            self.files = FileSet(*self._file_args)  # file handles of this process's own
        return super().__iter__()

    def _open(self, shard: data_pb2.Shard) -> ShardReader:
        return ShardReader(self.files, self.order, shard.start, shard.end, shard.epoch)

    def _read(self, parts: list[Any]) -> Any:
        if self.format == PARQUET:
            names = self.files.columns or list(self.files.schema.names)
            records = file_columns(parts, names)
        else:
            blob, starts, lengths = byte_element(parts)
            records = [
                blob[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)
            ]
        return records if self.parse_fn is None else self.parse_fn(records)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["files"] = None
        return state

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.files is not None:
                self.files.close()


class ShardLoader:
    """A DataLoader over a ShardedDataset that hands the loop its batches and remembers which
    shard records each holds until `step_done`. Batches come as workers make them (a worker
    waiting for the last shards of an epoch never holds back the others')."""

    def __init__(self, dataset: ShardedDataset, **kwargs: Any) -> None:
        for taken in ("batch_size", "sampler", "batch_sampler", "shuffle", "collate_fn"):
            if taken in kwargs:
                raise TypeError(f"ShardLoader sets {taken} itself (the master's shards decide)")
        if kwargs.get("num_workers", 0) > 0:
            kwargs.setdefault("in_order", False)
        self.dataset = dataset
        self.iterator: Any = None  # the DataLoader's, while a pass runs
        self._loader = DataLoader(dataset, batch_size=None, collate_fn=_identity, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        self.dataset._start_reading()
        self.iterator = iter(self._loader)
        try:
            for batch, segments in self.iterator:
                self.dataset._produced(segments)
                yield batch
        finally:
            # Workers go now, not when a traceback lets go of the iterator: a dead worker's
            # SIGCHLD would otherwise raise again later, anywhere.
            iterator, self.iterator = self.iterator, None
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
