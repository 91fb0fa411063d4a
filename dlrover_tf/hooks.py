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
        self._dataset.step_done(self._steps)

    def on_train_end(self, logs=None) -> None:
        self._dataset.flush()
