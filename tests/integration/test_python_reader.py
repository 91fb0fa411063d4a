"""ShardedDataset.to_tf_dataset with a plain Python/numpy reader, in real tf.data pipelines
against a live master; and the errors when a reader of one kind is passed as the other."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import dlrover_tf  # noqa: E402
from dlrover_tf.dataset import ShardedDataset  # noqa: E402

SIZE, BATCH = 640, 32


@pytest.fixture
def npy_records(tmp_path):
    """Records in .npy files (any format readable by index would do): features and labels."""
    features = np.arange(SIZE * 3, dtype=np.float32).reshape(SIZE, 3)
    labels = (np.arange(SIZE) % 2).astype(np.int64)
    np.save(tmp_path / "x.npy", features)
    np.save(tmp_path / "y.npy", labels)
    return np.load(tmp_path / "x.npy", mmap_mode="r"), np.load(tmp_path / "y.npy", mmap_mode="r")


def test_keras_fit_on_a_numpy_reader_trains_every_record_once_per_epoch(harness, npy_records):
    features, labels = npy_records
    seen = []

    def read_records(indices):  # numpy in, numpy out
        seen.append(indices.copy())
        return features[indices] / SIZE, labels[indices].astype(np.float32)

    ds = ShardedDataset("py", size=SIZE, batch_size=BATCH, epochs=2, client=harness.client(0))
    data = ds.to_tf_dataset(python_reader=read_records)
    assert data.element_spec[0].shape.as_list() == [None, 3]  # inferred from record 0
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(data, epochs=1, callbacks=[dlrover_tf.ShardProgressCallback(ds)], verbose=0)
    stats = harness.job.sharding.stats()[0]
    assert stats.finished and stats.records_done == SIZE * 2
    read = np.concatenate(seen[1:])  # seen[0]: the record read for the signature
    assert np.array_equal(np.bincount(read, minlength=SIZE), np.full(SIZE, 2))
    assert np.isfinite(history.history["loss"][0])


def test_a_reader_returning_a_dict_with_an_explicit_signature(harness, npy_records):
    features, labels = npy_records
    signature = {
        "x": tf.TensorSpec([None, 3], tf.float32),
        "y": tf.TensorSpec([None], tf.int64),
        "name": tf.TensorSpec([None], tf.string),
    }

    def read_records(indices):
        names = np.array([f"r{i}" for i in indices])
        return {"x": features[indices], "y": labels[indices], "name": names}

    ds = ShardedDataset("dict", size=SIZE, batch_size=BATCH, client=harness.client(0))
    batches = []
    for batch in ds.to_tf_dataset(python_reader=read_records, output_signature=signature):
        batches.append(batch)
        ds.step_done()  # the data ends once every record is reported trained
    assert sum(len(b["y"]) for b in batches) == SIZE
    first = batches[0]
    i = int(first["x"][0][0].numpy()) // 3
    assert first["name"][0].numpy() == f"r{i}".encode() and first["y"][0] == i % 2


def test_a_numpy_reader_in_graph_mode_as_an_estimator_input_fn_builds_it(harness, npy_records):
    features, labels = npy_records

    def read_records(indices):
        return features[indices], labels[indices]

    ds = ShardedDataset("graph", size=SIZE, batch_size=BATCH, client=harness.client(0))
    with tf.Graph().as_default():
        x, y = tf.compat.v1.data.make_one_shot_iterator(
            ds.to_tf_dataset(python_reader=read_records)
        ).get_next()
        total = 0
        with tf.compat.v1.Session() as session:
            try:
                while True:
                    xs, ys = session.run([x, y])
                    assert np.array_equal(xs[:, 0] // 3 % 2, ys)
                    total += len(ys)
                    ds.step_done()
            except tf.errors.OutOfRangeError:
                pass
    ds.flush()
    assert total == SIZE
    assert harness.job.sharding.stats()[0].records_done == SIZE


def test_a_numpy_reader_given_as_read_fn_names_python_reader(harness, npy_records):
    features, _ = npy_records

    def read_records(indices):
        return features[np.asarray(indices)]

    ds = ShardedDataset("wrong1", size=SIZE, batch_size=BATCH, client=harness.client(0))
    with pytest.raises(TypeError) as e:
        ds.to_tf_dataset(read_records)
    assert "ds.to_tf_dataset(python_reader=read_records)" in str(e.value)
    assert "must be made of TF ops" in str(e.value)


def test_a_tf_reader_given_as_python_reader_names_read_fn(harness):
    table = tf.constant(np.arange(SIZE, dtype=np.float32))

    def read_fn(indices):
        return tf.gather(table, indices)

    ds = ShardedDataset("wrong2", size=SIZE, batch_size=BATCH, client=harness.client(0))
    with pytest.raises(TypeError, match=r"call ds.to_tf_dataset\(read_fn\) instead"):
        ds.to_tf_dataset(python_reader=read_fn)
    with pytest.raises(TypeError, match="takes one reader"):
        ds.to_tf_dataset()
