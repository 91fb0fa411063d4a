"""ShardedDataset.from_files against a live master, in real tf.data pipelines: TFRecord files
written by TF, text files, Parquet with Keras; a worker's death mid-shard, files that differ
between nodes, and a file changed while training."""

from __future__ import annotations

import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import dlrover_tf  # noqa: E402
from dlrover_tf.dataset import ShardedDataset  # noqa: E402
from master.client.files.errors import DataFileError  # noqa: E402

RECORDS, FILES, BATCH = 3000, 8, 64
FEATURES = {"id": tf.io.FixedLenFeature([], tf.int64), "x": tf.io.FixedLenFeature([], tf.float32)}


def write_examples(folder, records=RECORDS, files=FILES) -> list[str]:
    """`files` TFRecord files of tf.train.Example {id, x}, written by TF."""
    paths = []
    per_file = -(-records // files)
    for f in range(files):
        path = os.path.join(folder, f"train-{f:02d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(f * per_file, min(records, (f + 1) * per_file)):
                feature = {
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=[i % 10 / 10])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def parse_ids(records):
    return tf.io.parse_example(records, FEATURES)["id"]


def train(ds, data, steps=None):
    """Iterate `data` as a training loop would, reporting each step; the ids of each batch."""
    batches = []
    for batch in data:
        batches.append(np.asarray(batch))
        ds.step_done(len(batches))
        if steps is not None and len(batches) == steps:
            break
    ds.flush()
    return batches


def test_tfrecord_files_written_by_tf_train_every_record_once_per_epoch(harness, tmp_path):
    paths = write_examples(str(tmp_path))
    ds = ShardedDataset.from_files(
        "tfr",
        str(tmp_path / "*.tfrecord"),
        "tfrecord",
        BATCH,
        epochs=2,
        shuffle=True,
        seed=3,
        block=256,
        client=harness.client(0),
    )
    assert ds.size == RECORDS and ds.files.paths == paths
    batches = train(ds, ds.to_tf_dataset(parse_ids))
    ids = np.concatenate(batches)
    assert np.array_equal(np.bincount(ids, minlength=RECORDS), np.full(RECORDS, 2))
    assert all(len(b) == BATCH for b in batches[:-1])
    first_epoch = ids[:RECORDS]
    assert not np.array_equal(first_epoch, np.sort(first_epoch))  # shuffled
    assert np.array_equal(np.sort(first_epoch), np.arange(RECORDS))  # epoch by epoch
    stats = harness.job.sharding.stats()[0]
    assert stats.finished and stats.records_done == 2 * RECORDS
    ds.close()


def test_serialized_records_are_those_tf_reads(harness, tmp_path):
    paths = write_examples(str(tmp_path), records=500, files=3)
    ds = ShardedDataset.from_files("raw", paths, "tfrecord", 50, client=harness.client(0))
    ours = np.concatenate(train(ds, ds.to_tf_dataset()))
    theirs = list(tf.data.TFRecordDataset(paths).as_numpy_iterator())
    assert ours.tolist() == theirs
    ds.close()


def test_a_workers_remainder_is_read_by_another_with_the_same_records(harness, tmp_path):
    write_examples(str(tmp_path))
    kw = dict(epochs=1, shuffle=True, seed=11, block=1024, records_per_shard=1000)
    glob = str(tmp_path / "*.tfrecord")
    first = ShardedDataset.from_files("w", glob, "tfrecord", BATCH, client=harness.client(0), **kw)
    trained = train(first, first.to_tf_dataset(parse_ids), steps=5)  # 320 records of a shard
    # The worker dies: the master puts the rest of its shard back (mid-window) for others.
    harness.job.sharding.release("w", harness.nodes[0].id)
    second = ShardedDataset.from_files("w", glob, "tfrecord", BATCH, client=harness.client(1), **kw)
    trained += train(second, second.to_tf_dataset(parse_ids))
    ids = np.concatenate(trained)
    assert np.array_equal(np.sort(ids), np.arange(RECORDS))  # once each, none lost
    expected = second.order.records(0, RECORDS, 0)
    assert np.array_equal(ids[:320], expected[:320])
    assert harness.job.sharding.stats()[0].records_done == RECORDS
    first.close()
    second.close()


def test_text_lines_are_those_tf_reads(harness, tmp_path):
    paths = []
    for f in range(3):
        path = tmp_path / f"part-{f}.csv"
        path.write_text("".join(f"{i},{i * i % 17}\n" for i in range(f * 100, f * 100 + 100)))
        paths.append(str(path))
    ds = ShardedDataset.from_files("csv", paths, "text", 32, client=harness.client(0))

    def parse_csv(lines):
        record_id, value = tf.io.decode_csv(lines, [[0], [0]])
        return record_id, value

    batches = train(ds, ds.to_tf_dataset(parse_csv))
    ids = np.concatenate([b[0] for b in batches])
    assert ids.tolist() == list(range(300))
    assert np.array_equal(np.concatenate([b[1] for b in batches]), ids * ids % 17)
    raw = ShardedDataset.from_files("csv-raw", paths, "text", 32, client=harness.client(0))
    lines = np.concatenate(train(raw, raw.to_tf_dataset())).tolist()
    assert lines == list(tf.data.TextLineDataset(paths).as_numpy_iterator())
    ds.close()
    raw.close()


def test_keras_fit_on_parquet_with_the_progress_callback(harness, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    for f in range(2):
        ids = np.arange(f * 400, f * 400 + 400)
        table = pa.table(
            {"id": ids, "x": (ids % 7).astype(np.float32), "y": (ids % 2).astype(np.float32)}
        )
        pq.write_table(table, tmp_path / f"part-{f}.parquet", row_group_size=128)
    ds = ShardedDataset.from_files(
        "pq",
        str(tmp_path / "*.parquet"),
        "parquet",
        32,
        epochs=2,
        shuffle=True,
        client=harness.client(0),
    )
    seen = []

    def to_xy(batch):
        return tf.reshape(batch["x"], [-1, 1]), batch["y"]

    class Seen(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(
        ds.to_tf_dataset(to_xy),
        epochs=1,
        callbacks=[Seen(), dlrover_tf.ShardProgressCallback(ds)],
        verbose=0,
    )
    assert len(seen) == 800 * 2 // 32
    stats = harness.job.sharding.stats()[0]
    assert stats.finished and stats.records_done == 1600
    assert np.isfinite(history.history["loss"][0])
    ds.close()


def test_nodes_with_different_files_are_refused(harness, tmp_path):
    paths = write_examples(str(tmp_path), records=400, files=4)
    ds = ShardedDataset.from_files("same", paths, "tfrecord", 50, client=harness.client(0))
    with pytest.raises(DataFileError, match="differ from those the dataset was first read with"):
        ShardedDataset.from_files("same", paths[:3], "tfrecord", 50, client=harness.client(1))
    with pytest.raises(DataFileError, match=r"\[true, 4096, 4096, 0\]|\[True, 4096"):
        ShardedDataset.from_files(
            "same", paths, "tfrecord", 50, shuffle=True, client=harness.client(1)
        )
    ds.close()


def test_a_file_changed_while_training_stops_it_naming_the_file(harness, tmp_path):
    # The first file outlasts what the pipeline reads ahead (a few runs of 16 batches).
    paths = write_examples(str(tmp_path), records=10_000, files=2)
    ds = ShardedDataset.from_files("chg", paths, "tfrecord", 50, client=harness.client(0))
    iterator = iter(ds.to_tf_dataset(parse_ids))
    ids = [next(iterator).numpy()]
    ds.step_done(1)
    with open(paths[1], "ab") as f:
        f.write(b"appended")
    with pytest.raises(tf.errors.OpError) as e:
        while True:
            ids.append(next(iterator).numpy())
            ds.step_done(len(ids))
    assert paths[1] in str(e.value) and "changed after it was indexed" in str(e.value)
    ds.flush()
    # Only batches read from the unchanged file were trained and reported.
    assert np.concatenate(ids).max() < 5000
    assert harness.job.sharding.stats()[0].records_done == 50 * len(ids)
    ds.close()


def test_gzip_files_and_empty_globs_are_refused_before_registering(harness, tmp_path):
    with pytest.raises(DataFileError, match="no file matches"):
        ShardedDataset.from_files(
            "e", str(tmp_path / "*.tfrecord"), "tfrecord", 8, client=harness.client(0)
        )
    path = write_examples(str(tmp_path), records=10, files=1)[0]
    tf_gzip = str(tmp_path / "z.tfrecord.gz")
    with tf.io.TFRecordWriter(tf_gzip, options="GZIP") as writer:
        for record in tf.data.TFRecordDataset(path).as_numpy_iterator():
            writer.write(record)
    with pytest.raises(DataFileError, match="compressed TFRecord file \\(GZIP\\)"):
        ShardedDataset.from_files("z", tf_gzip, "tfrecord", 8, client=harness.client(0))
    assert harness.job.sharding.stats() == []
