"""Coordinator: runs the steps of TF2 PS training on the workers (an exact loop, or Keras
`fit`), checkpoints at step boundaries, and keeps the master's data position in step."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from dlrover_tf.keras_ps.feeder import SHARD_WAIT_MS, Batch, ShardFeeder
from dlrover_tf.keras_ps.servers import DONE_KEY, exit_process
from master.client import COORDINATOR_KEY, KVClient

log = logging.getLogger(__name__)

# After a PS loss the coordinator waits this long for the master to restart it, then fails.
PS_LOSS_WAIT_SECONDS = 120.0


def _is_ps_loss(err: BaseException) -> bool:
    import tensorflow as tf

    # ClusterCoordinator retries worker failures itself; what reaches the program is a PS
    # (or the coordinator's own connection) gone.
    return isinstance(err, tf.errors.UnavailableError | tf.errors.AbortedError)


class Coordinator:
    """Runs steps on the workers, checkpoints, and keeps the master's data position in step.

    `checkpoint` holds the model and optimizer; `step` is the global step variable (e.g. the
    optimizer's `iterations`). Checkpoints are taken at a step boundary (every scheduled step
    resolved), with each dataset's ledger saved first under the same step: a restore puts the
    data back exactly where the model was.
    """

    def __init__(
        self,
        strategy: Any,
        feeder: ShardFeeder,
        checkpoint: Any,
        step: Any,
        model_dir: str,
        checkpoint_every_steps: int = 200,
        max_to_keep: int = 3,
    ) -> None:
        import tensorflow as tf

        if checkpoint_every_steps <= 0:
            raise ValueError("checkpoint_every_steps must be positive (steps between checkpoints)")
        self.strategy = strategy
        self.feeder = feeder
        self.client = feeder._client
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        self._step = step
        self._every = checkpoint_every_steps
        self.manager = tf.train.CheckpointManager(checkpoint, model_dir, max_to_keep=max_to_keep)
        # No public accessor (its cluster_resolver property is None under this strategy).
        self.num_workers = int(strategy._num_workers)
        self.global_step = 0
        self.steps_run = 0  # steps whose result resolved in this process
        self.restored_step = -1
        self._losses: list[float] = []

    def restore(self) -> int:
        """Load the latest checkpoint (or save one at step 0) and tell the master the step:
        it rolls the data back to it. Call once the model and optimizer variables exist."""
        KVClient(self.client).set(COORDINATOR_KEY, b"1")
        path = self.manager.restore_or_initialize()
        self.global_step = int(self._step.numpy())
        if path is None:
            self._save()  # a position to go back to if a PS fails before the first checkpoint
            log.info("no checkpoint in %s: training starts at step 0", self.manager.directory)
        else:
            log.info("restored %s at global step %d", path, self.global_step)
        self.client.report_model_restored(self.global_step)
        self.restored_step = self.global_step
        return self.global_step

    def _save(self) -> None:
        """A checkpoint at a step boundary: ledger snapshot, model, then the report."""
        step = self.global_step
        self.client.save_ledger(self.feeder.name, step)
        path = self.manager.save(checkpoint_number=step)
        self.client.report_checkpoint(step, path, [self.feeder.name])
        log.info("checkpoint at global step %d: %s", step, path)

    def checkpoint(self) -> None:
        """Wait for every scheduled step, then checkpoint."""
        self.coordinator.join()
        self.feeder.flush()  # the ledger snapshot must hold every resolved step
        self.global_step = int(self._step.numpy())
        self._save()

    def run(self, step_fn: Callable, max_in_flight: int = 0) -> int:
        """The exact loop: schedule `step_fn(indices)` (a tf.function calling strategy.run;
        indices: a 1-D int64 tensor) per batch until the data ends; a batch is reported when
        its step's result resolves. Returns the number of steps run."""
        import tensorflow as tf

        limit = max_in_flight or 2 * self.num_workers
        in_flight: collections.deque[tuple[Any, Batch]] = collections.deque()
        since_checkpoint = 0
        try:
            while True:
                while in_flight and (len(in_flight) >= limit or _ready(in_flight[0][0])):
                    self._resolve(*in_flight.popleft())
                    since_checkpoint += 1
                if since_checkpoint >= self._every:
                    while in_flight:
                        self._resolve(*in_flight.popleft())
                    self.checkpoint()
                    since_checkpoint = 0
                batch = self.feeder.next_batch(wait_ms=0 if in_flight else SHARD_WAIT_MS)
                if batch is None:
                    if in_flight:
                        self._resolve(*in_flight.popleft())
                        since_checkpoint += 1
                        continue
                    if self.feeder.ended:
                        break
                    continue
                indices = tf.constant(batch.indices, dtype=tf.int64)
                in_flight.append((self.coordinator.schedule(step_fn, args=(indices,)), batch))
            self.coordinator.join()
        except Exception as err:
            if _is_ps_loss(err):
                self._wait_for_restart(err)
            raise
        return self.steps_run

    def _resolve(self, value: Any, batch: Batch) -> None:
        try:
            loss = _scalar(value.fetch())
        except Exception as err:
            if not _result_lost_with_its_worker(value, err):
                raise
            # The step ran to its end (a failed step is retried elsewhere, never reported
            # here); only the copy of its result failed: its batch counts, without a loss.
            _warn_result_lost(err, "its batch counts as trained")
            loss = None
        self._count(batch, loss)

    def _count(self, batch: Batch, loss: float | None) -> None:
        self.steps_run += 1
        if loss is not None:
            self._losses.append(loss)
        self.feeder.done(batch, self.restored_step + self.steps_run, loss)

    def _wait_for_restart(self, err: BaseException) -> NoReturn:
        """A PS is gone with its variables: the master restarts this process (restore from
        the latest checkpoint). Wait for that rather than failing, which would be charged."""
        log.warning(
            "a parameter server is lost (%s: %s); waiting for the master to restart the "
            "coordinator",
            type(err).__name__,
            str(err).splitlines()[0][:200],
        )
        time.sleep(PS_LOSS_WAIT_SECONDS)
        log.error("the master did not restart the coordinator after %.0f s", PS_LOSS_WAIT_SECONDS)
        exit_process(1)

    def fit(
        self,
        model: Any,
        read_fn: Callable,
        steps_per_epoch: int = 50,
        checkpoint_every_epochs: int = 1,
        callbacks: Sequence[Any] = (),
        verbose: int = 0,
        on_step: Callable[[Any], Any] | None = None,
    ) -> Any:
        """`model.fit` (compiled under the strategy's scope) over the master's shards.

        Each Keras epoch is a chunk of `steps_per_epoch` batches the coordinator takes from
        its shards and stores on a PS; each step takes the next batch number from a counter
        on the PS and builds its batch on the worker with `read_fn(indices) -> (x, y)`, and
        returns the number it trained. A callback reads the numbers as the steps resolve;
        at the epoch's end (every step joined) the trained batches are reported, a batch
        whose step died with a worker is handed out again in the next epoch, and every
        `checkpoint_every_epochs` a checkpoint is taken. `on_step(indices)`, if given, runs
        in each step on the worker after the model update (e.g. to log the trained ids).
        Bound: a worker that dies costs at most the batch it had applied; a step whose
        number fell past the chunk (after a retry) trains an empty batch (zero gradients).
        Returns the History.
        """
        import tensorflow as tf

        if steps_per_epoch <= 0 or checkpoint_every_epochs <= 0:
            raise ValueError("steps_per_epoch and checkpoint_every_epochs must be positive")
        size = steps_per_epoch * self.feeder.batch_size
        with self.strategy.scope():
            chunk = tf.Variable(tf.fill([size], tf.constant(-1, tf.int64)), trainable=False)
            counter = tf.Variable(tf.constant(0, tf.int64), trainable=False)
        batch_size = self.feeder.batch_size
        original = model.train_step

        def train_step(data: Any) -> dict:
            del data  # a placeholder element: the batch comes from the chunk on the PS
            number = counter.assign_add(1) - 1
            ids = chunk[number * batch_size : (number + 1) * batch_size]
            ids = tf.boolean_mask(ids, ids >= 0)
            logs = dict(original(read_fn(ids)))
            if on_step is not None:
                with tf.control_dependencies([model.optimizer.iterations.read_value()]):
                    on_step(ids)
            logs[BATCH_LOG_KEY] = number
            return logs

        model.train_step = train_step
        feed = _chunk_callback(self, chunk, counter, steps_per_epoch, checkpoint_every_epochs)
        placeholder = tf.keras.utils.experimental.DatasetCreator(
            lambda _: tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).repeat()
        )
        try:
            return model.fit(
                placeholder,
                epochs=2**31 - 1,  # until the data ends (the callback stops training)
                steps_per_epoch=steps_per_epoch,
                callbacks=[feed, *callbacks],
                verbose=verbose,
            )
        except Exception as err:
            if _is_ps_loss(err):
                self._wait_for_restart(err)
            raise
        finally:
            model.train_step = original

    def finish(self) -> None:
        """Final checkpoint, then tell the worker servers to exit. Call after training."""
        self.checkpoint()
        KVClient(self.client).set(DONE_KEY, str(self.global_step).encode())
        losses, n = self._losses, min(50, len(self._losses) // 2)
        first = f"{np.mean(losses[:n]):.4f}" if n else "n/a"
        last = f"{np.mean(losses[-n:]):.4f}" if n else "n/a"
        log.info(
            "training done at global step %d (%d steps here); mean loss of the first %d steps "
            "%s, of the last %d %s",
            self.global_step,
            self.steps_run,
            n,
            first,
            n,
            last,
        )


# The key under which a fit step returns the number of the batch it trained.
BATCH_LOG_KEY = "dlrover_batch"


def _chunk_callback(
    owner: Coordinator, chunk: Any, counter: Any, steps: int, checkpoint_every: int
) -> Any:
    """The coordinator side of `Coordinator.fit` (a Keras callback, built when first used:
    TensorFlow is imported only then, never before a server blocks its signals)."""
    import tensorflow as tf

    class _ChunkCallback(tf.keras.callbacks.Callback):
        """Coordinator side of `Coordinator.fit`: fills each epoch's chunk, collects the steps'
        results as they are scheduled, and accounts for them at the epoch's end."""

        def __init__(
            self, owner: Coordinator, chunk: Any, counter: Any, steps: int, checkpoint_every: int
        ) -> None:
            super().__init__()
            # Takes the steps' results unresolved (RemoteValues), which is what makes a
            # batch-level callback acceptable under ParameterServerStrategy.
            self._supports_tf_logs = True
            self._owner = owner
            self._chunk = chunk
            self._counter = counter
            self._steps = steps
            self._checkpoint_every = checkpoint_every
            self._slots: list[Batch] = []
            self._results: list[Any] = []
            self._epochs = 0

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            feeder = self._owner.feeder
            self._slots, self._results = [], []
            while len(self._slots) < self._steps:
                batch = feeder.next_batch(wait_ms=SHARD_WAIT_MS if not self._slots else 0)
                if batch is None:
                    if feeder.ended or self._slots:
                        break
                    continue
                self._slots.append(batch)
            flat = np.full(self._steps * feeder.batch_size, -1, np.int64)
            for i, batch in enumerate(self._slots):
                flat[i * feeder.batch_size : i * feeder.batch_size + len(batch.indices)] = (
                    batch.indices
                )
            self._chunk.assign(flat)
            self._counter.assign(0)
            if not self._slots:
                self.model.stop_training = True  # the data ended: one empty step, then stop

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if logs is not None:
                self._results.append(logs)

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            owner = self._owner
            owner.coordinator.join()
            trained: dict[int, float | None] = {}
            for result in self._results:
                try:
                    values = _fetched(result)
                except Exception as err:
                    if not _result_lost_with_its_worker(result, err):
                        raise
                    # Which batch it trained is lost too: that batch goes out again.
                    _warn_result_lost(err, "its batch is handed out again")
                    continue
                trained[int(np.asarray(values[BATCH_LOG_KEY]))] = _scalar(values.get("loss"))
            for number, batch in enumerate(self._slots):
                if number in trained:
                    owner._count(batch, trained[number])
                else:
                    owner.feeder.again(batch)  # its step died with a worker
            self._epochs += 1
            if self._slots and self._epochs % self._checkpoint_every == 0:
                owner.checkpoint()

    return _ChunkCallback(owner, chunk, counter, steps, checkpoint_every)


def _fetched(result: Any) -> dict:
    """A fit step's logs, each RemoteValue fetched to the coordinator."""
    values = result.fetch() if hasattr(result, "fetch") else result
    return {k: (v.fetch() if hasattr(v, "fetch") else v) for k, v in values.items()}


def _result_lost_with_its_worker(value: Any, err: BaseException) -> bool:
    """Whether fetching a step's result failed only because the worker holding it died: the
    step had finished (ClusterCoordinator set its value), and the copy to the coordinator
    failed with a worker's RPC error, not a PS's. Logs dicts count when every value finished."""
    import tensorflow as tf
    from tensorflow.python.distribute.coordinator import remote_value

    values = value.values() if isinstance(value, dict) else [value]
    finished = all(
        getattr(v, "_status", None) is remote_value.RemoteValueStatus.READY
        and getattr(v, "_error", err) is None
        for v in values
        if hasattr(v, "fetch")
    )
    rpc_error = isinstance(err, tf.errors.UnavailableError | tf.errors.AbortedError)
    return finished and rpc_error and "/job:ps" not in str(err)


def _warn_result_lost(err: BaseException, outcome: str) -> None:
    log.warning(
        "a worker died after its step ran, before the step's result was fetched; %s (%s)",
        outcome,
        str(err).splitlines()[0][:200],
    )


def _ready(value: Any) -> bool:
    # RemoteValue has no public non-blocking check; fall back to "not ready" if it changes.
    from tensorflow.python.distribute.coordinator import remote_value

    return getattr(value, "_status", None) is remote_value.RemoteValueStatus.READY


def _scalar(result: Any) -> float | None:
    """The first scalar of a step's result (its loss, by convention), if any."""
    import tensorflow as tf

    for item in tf.nest.flatten(result):
        arr = np.asarray(item)
        if arr.size == 1 and arr.dtype.kind == "f":
            return float(arr.reshape(()))
    return None
