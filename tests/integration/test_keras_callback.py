"""Keras model.fit on a ShardedDataset with ShardProgressCallback, against a live master."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import dlrover_tf  # noqa: E402
from dlrover_tf.dataset import ShardedDataset  # noqa: E402


def read_fn(indices):
    x = tf.cast(tf.reshape(indices % 97, [-1, 1]), tf.float32) / 97.0
    y = tf.cast(indices % 2, tf.float32)
    return x, y


def test_fit_trains_every_record_once_per_epoch(harness):
    ds = ShardedDataset("keras", size=640, batch_size=32, epochs=2, client=harness.client(0))
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
    model.compile(optimizer="sgd", loss="mse")
    seen = []

    class Record(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    history = model.fit(
        ds.to_tf_dataset(read_fn),
        epochs=1,
        callbacks=[Record(), dlrover_tf.ShardProgressCallback(ds)],
        verbose=0,
    )
    stats = harness.job.sharding.stats()[0]
    assert len(seen) == 640 * 2 // 32
    assert stats.finished and stats.records_done == 1280
    assert np.isfinite(history.history["loss"][0])
