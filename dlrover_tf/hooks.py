"""Step-granular progress reporting for tf.estimator (a SessionRunHook) and Keras (a callback)."""

from __future__ import annotations

import tensorflow as tf

from dlrover_tf.dataset import ShardedDataset


class ShardProgressHook(tf.estimator.SessionRunHook):
    """Tells the master, after every completed step, which records that step trained on."""

    def __init__(self, dataset: ShardedDataset) -> None:
        self._dataset = dataset
        self._global_step = None

    def begin(self) -> None:
        self._global_step = tf.compat.v1.train.get_global_step()

    def before_run(self, run_context):
        if self._global_step is None:
            return None
        return tf.estimator.SessionRunArgs(self._global_step)

    def after_run(self, run_context, run_values) -> None:
        step = run_values.results if self._global_step is not None else 0
        self._dataset.step_done(int(step or 0))

    def end(self, session) -> None:
        self._dataset.flush()


class ShardProgressCallback(tf.keras.callbacks.Callback):
    """The Keras counterpart of ShardProgressHook: reports each completed batch."""

    def __init__(self, dataset: ShardedDataset) -> None:
        super().__init__()
        self._dataset = dataset
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None) -> None:
        # A local count: reading optimizer.iterations would cost a PS round trip per batch.
        self._steps += 1
        loss = (logs or {}).get("loss")
        self._dataset.step_done(self._steps, None if loss is None else float(loss))

    def on_train_end(self, logs=None) -> None:
        self._dataset.flush()


class CheckpointLedgerListener(tf.estimator.CheckpointSaverListener):
    """Saves each dataset's shard ledger with every model checkpoint (pass it on the chief).

    The ledger is saved just before the model, tagged with the same global step, and the
    checkpoint is registered with the master once written. When a PS fails, the master rolls
    the data back to the latest registered checkpoint, the one the chief restores.
    """

    def __init__(self, *datasets: ShardedDataset, model_dir: str = "") -> None:
        if not datasets:
            raise ValueError("CheckpointLedgerListener needs at least one ShardedDataset")
        self._datasets = datasets
        self._model_dir = model_dir

    def before_save(self, session, global_step_value) -> None:
        for ds in self._datasets:
            ds.client.save_ledger(ds.name, int(global_step_value))

    def after_save(self, session, global_step_value) -> None:
        path = tf.train.latest_checkpoint(self._model_dir) if self._model_dir else ""
        client = self._datasets[0].client
        client.report_checkpoint(
            int(global_step_value), path or "", [ds.name for ds in self._datasets]
        )
