"""Wide-and-deep CTR model trained with a TF estimator in parameter-server mode.

Run it as the chief, worker and evaluator tasks of a PS cluster: the launcher (the dlrover master)
sets ``TF_CONFIG``; this script never reads it, ``tf.estimator.RunConfig`` does. The data is a
synthetic CTR set computed from the record index with TF ops, so any range of indices can be read
by any worker with no files. ``--input dlrover`` (default) takes record ranges from the master
through ``dlrover_tf``; ``--input plain`` is the same job on a plain ``tf.data`` pipeline (each
trainer reads its own 1/n of the records), the baseline the benchmarks compare with.
``--files DIR`` writes the records as TFRecord files in DIR once and trains from them
(``ShardedDataset.from_files``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

logger = logging.getLogger("wide_deep")

# Categorical features and their vocabulary sizes; ids are skewed towards small values like real
# CTR ids. c6 x c7 is crossed both in the hidden model and in the wide part.
VOCAB = {"c0": 5000, "c1": 3000, "c2": 2000, "c3": 1000, "c4": 500, "c5": 100, "c6": 50, "c7": 20}
DENSE = ("d0", "d1", "d2", "d3")
CROSS = ("c6", "c7")
RECORD_ID = "record_id"  # carried in the features for the trained-ids log; the model ignores it
EVAL_OFFSET = 10**9  # evaluation records are indices [EVAL_OFFSET, EVAL_OFFSET + eval_records)
EMBEDDING_DIM = 8
HIDDEN_UNITS = (64, 32)
LEARNING_RATE = 0.2
DONE_MARKER = "training_done.json"  # written by the chief after its final checkpoint

# The hidden logistic model the labels come from (fixed, independent of --seed).
_BIAS = -1.5
_CATEGORICAL_SCALE = 1.0
_DENSE_WEIGHTS = (1.5, -1.0, 0.8, 0.5)
_CROSS_SCALE = 1.5
_RECORD_ID_COLLECTION = "wide_deep_record_ids"
_READ_THREADS = 2
_PREFETCH_BATCHES = 2

_U64 = tf.uint64
_GOLDEN = 0x9E3779B97F4A7C15


def _shift_xor(x: tf.Tensor, bits: int) -> tf.Tensor:
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(bits, _U64)))


def _hash(x: tf.Tensor, salt: int) -> tf.Tensor:
    """splitmix64 of (x + salt * golden ratio): a well mixed uint64 per element."""
    x = tf.cast(x, _U64) + tf.constant((salt * _GOLDEN) % 2**64, _U64)
    x = _shift_xor(x, 30) * tf.constant(0xBF58476D1CE4E5B9, _U64)
    x = _shift_xor(x, 27) * tf.constant(0x94D049BB133111EB, _U64)
    return _shift_xor(x, 31)


def _uniform(x: tf.Tensor, salt: int) -> tf.Tensor:
    """A float64 in [0, 1) per element, a pure function of (x, salt)."""
    top53 = tf.bitwise.right_shift(_hash(x, salt), tf.constant(11, _U64))
    return tf.cast(top53, tf.float64) * 2.0**-53


def _signed(x: tf.Tensor, salt: int, scale: float) -> tf.Tensor:
    """A float64 in [-scale, scale) per element."""
    return scale * (2.0 * _uniform(x, salt) - 1.0)


def read_fn(indices: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    """Map a 1-D int64 tensor of record indices to (features, labels), all in TF ops."""
    idx = tf.cast(tf.reshape(indices, [-1]), tf.int64)
    features: dict[str, tf.Tensor] = {RECORD_ID: idx}
    logit = tf.fill(tf.shape(idx), tf.constant(_BIAS, tf.float64))
    for k, (name, vocab) in enumerate(VOCAB.items()):
        u = _uniform(idx, salt=1 + k)
        ids = tf.minimum(tf.cast(tf.floor(u * u * vocab), tf.int64), vocab - 1)
        features[name] = ids
        logit += _signed(ids, salt=101 + k, scale=_CATEGORICAL_SCALE)
    for j, (name, weight) in enumerate(zip(DENSE, _DENSE_WEIGHTS, strict=True)):
        value = _signed(idx, salt=201 + j, scale=1.0)
        features[name] = tf.cast(value, tf.float32)
        logit += weight * value
    cross_id = features[CROSS[0]] * VOCAB[CROSS[1]] + features[CROSS[1]]
    logit += _signed(cross_id, salt=301, scale=_CROSS_SCALE)
    labels = tf.cast(_uniform(idx, salt=401) < tf.sigmoid(logit), tf.float32)
    return features, labels


def _categorical_columns() -> list:
    return [
        tf.feature_column.categorical_column_with_identity(name, num_buckets=vocab)
        for name, vocab in VOCAB.items()
    ]


def _dense_columns() -> list:
    return [tf.feature_column.numeric_column(name) for name in DENSE]


def _dense_layer(x: tf.Tensor, units: int, name: str, activation: Callable | None) -> tf.Tensor:
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel",
            [x.shape[-1], units],
            initializer=tf.compat.v1.glorot_uniform_initializer(),
        )
        bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.zeros_initializer())
        y = tf.matmul(x, kernel) + bias
        return activation(y) if activation else y


def model_fn(
    features: dict, labels: tf.Tensor, mode: str, params: dict
) -> tf.estimator.EstimatorSpec:
    """Wide (linear over ids and one cross) + deep (embeddings, MLP) logistic regression."""
    categorical = _categorical_columns()
    # Spread big variables over the PS tasks like the canned estimators do.
    partitioner = tf.compat.v1.min_max_variable_partitioner(
        max_partitions=max(1, params["num_ps"]), min_slice_size=64 << 10
    )
    with tf.compat.v1.variable_scope("deep", partitioner=partitioner):
        embeddings = [tf.feature_column.embedding_column(c, EMBEDDING_DIM) for c in categorical]
        net = tf.compat.v1.feature_column.input_layer(features, embeddings + _dense_columns())
    with tf.compat.v1.variable_scope("mlp"):
        for i, units in enumerate(HIDDEN_UNITS):
            net = _dense_layer(net, units, f"hidden_{i}", tf.nn.relu)
        deep_logits = _dense_layer(net, 1, "logits", None)
    with tf.compat.v1.variable_scope("wide", partitioner=partitioner):
        cross = tf.feature_column.crossed_column(list(CROSS), hash_bucket_size=4 * 50 * 20)
        wide_logits = tf.compat.v1.feature_column.linear_model(
            features, categorical + [cross] + _dense_columns()
        )
    logits = tf.reshape(deep_logits + wide_logits, [-1])
    probabilities = tf.sigmoid(logits)
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions={"probability": probabilities})

    labels = tf.reshape(tf.cast(labels, tf.float32), [-1])
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
    if mode == tf.estimator.ModeKeys.EVAL:
        metrics = {
            "auc": tf.compat.v1.metrics.auc(labels, probabilities, num_thresholds=1000),
            "accuracy": tf.compat.v1.metrics.accuracy(labels, tf.round(probabilities)),
            "label_mean": tf.compat.v1.metrics.mean(labels),
            "prediction_mean": tf.compat.v1.metrics.mean(probabilities),
        }
        return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops=metrics)

    global_step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = tf.compat.v1.train.AdagradOptimizer(LEARNING_RATE)
    train_op = optimizer.minimize(loss, global_step=global_step)
    tf.compat.v1.add_to_collection(_RECORD_ID_COLLECTION, features[RECORD_ID])
    _log_partitions(params["num_ps"], params["task"])
    hooks = [MeanLossHook(loss, global_step, params["log_every"], params["task"])]
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op, training_hooks=hooks)


def _log_partitions(num_ps: int, task: str) -> None:
    """Say how the partitioned variables are split: a PS count change re-partitions them."""
    parts: dict[str, set[str]] = {}
    for v in tf.compat.v1.trainable_variables():
        if "/part_" in v.name:
            whole, part = v.name.split("/part_", 1)
            parts.setdefault(whole, set()).add(part)
    if parts:
        logger.info(
            "[%s] %d partitioned variables over %d PS, up to %d parts each",
            task,
            len(parts),
            num_ps,
            max(len(p) for p in parts.values()),
        )


class MeanLossHook(tf.estimator.SessionRunHook):
    """Logs this task's mean training loss and local steps/s every `every` local steps."""

    def __init__(self, loss: tf.Tensor, global_step: tf.Tensor, every: int, task: str) -> None:
        self._fetches = {"loss": loss, "global_step": global_step}
        self._every = every
        self._task = task

    def begin(self) -> None:
        self._steps = 0
        self._window: list[float] = []
        self._window_start = time.monotonic()
        self._first_mean: float | None = None
        self._last_mean: float | None = None
        self._first_step_at: float | None = None
        self._first_step_cpu = 0.0
        self._global_step = 0

    def before_run(
        self, run_context: tf.estimator.SessionRunContext
    ) -> tf.estimator.SessionRunArgs:
        if self._first_step_at is None:
            self._first_step_at = self._window_start = time.monotonic()
            self._first_step_cpu = time.process_time()
        return tf.estimator.SessionRunArgs(self._fetches)

    def after_run(self, run_context, run_values: tf.estimator.SessionRunValues) -> None:
        self._steps += 1
        self._window.append(float(run_values.results["loss"]))
        self._global_step = int(run_values.results["global_step"])
        if len(self._window) >= self._every:
            self._report()

    def _report(self) -> None:
        mean = float(np.mean(self._window))
        rate = len(self._window) / max(time.monotonic() - self._window_start, 1e-9)
        if self._first_mean is None:
            self._first_mean = mean
        self._last_mean = mean
        logger.info(
            "[%s] local step %d, global step %d: mean loss %.4f over %d steps, %.1f steps/s",
            self._task,
            self._steps,
            self._global_step,
            mean,
            len(self._window),
            rate,
        )
        self._window = []
        self._window_start = time.monotonic()

    def end(self, session: tf.compat.v1.Session) -> None:
        if self._window:
            self._report()
        elapsed = time.monotonic() - (self._first_step_at or time.monotonic())
        cpu = time.process_time() - self._first_step_cpu if self._first_step_at else 0.0
        logger.info(
            "[%s] trained %d local steps in %.1f s from the first step (%.1f steps/s); "
            "mean loss of the first window %s, of the last %s; %.2f CPU s",
            self._task,
            self._steps,
            elapsed,
            self._steps / max(elapsed, 1e-9),
            _fmt(self._first_mean),
            _fmt(self._last_mean),
            cpu,
        )


class TrainedIdsHook(tf.estimator.SessionRunHook):
    """Appends the record indices of every completed step to a file (int64, little endian),
    and the step's global step, record count and end (µs since the epoch) to PATH.steps."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._file = None
        self._steps_file = None

    def begin(self) -> None:
        ids = tf.compat.v1.get_collection(_RECORD_ID_COLLECTION)
        if len(ids) != 1:
            raise RuntimeError(f"expected one record id tensor in the graph, found {len(ids)}")
        self._fetches = (ids[0], tf.compat.v1.train.get_global_step())
        os.makedirs(os.path.dirname(os.path.abspath(self._path)), exist_ok=True)
        self._file = open(self._path, "ab")  # closed in end()
        self._steps_file = open(f"{self._path}.steps", "ab")

    def before_run(
        self, run_context: tf.estimator.SessionRunContext
    ) -> tf.estimator.SessionRunArgs:
        return tf.estimator.SessionRunArgs(self._fetches)

    def after_run(self, run_context, run_values: tf.estimator.SessionRunValues) -> None:
        ids, global_step = run_values.results
        self._file.write(np.asarray(ids, dtype="<i8").tobytes())
        self._file.flush()
        row = [global_step, len(ids), time.time_ns() // 1000]
        self._steps_file.write(np.asarray(row, dtype="<i8").tobytes())
        self._steps_file.flush()

    def end(self, session: tf.compat.v1.Session) -> None:
        for f in (self._file, self._steps_file):
            if f is not None:
                f.close()
        self._file = self._steps_file = None


class RehearseHangHook(tf.estimator.SessionRunHook):
    """Rehearsal of a hang: before local step `at`, stop stepping for good while the process
    (and its heartbeats) go on, as a deadlocked input or a stuck collective would. Once per
    model dir: the marker file makes the relaunched task train normally."""

    def __init__(self, at: int, marker: str) -> None:
        self._at = at
        self._marker = marker
        self._steps = 0

    def before_run(self, run_context: tf.estimator.SessionRunContext) -> None:
        self._steps += 1
        if self._steps != self._at:
            return None
        try:
            os.close(os.open(self._marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None  # hung once already (an earlier incarnation)
        logger.warning("rehearsing a hang at local step %d: no more steps", self._at)
        while True:
            time.sleep(3600)


def without_autotune(ds: tf.data.Dataset) -> tf.data.Dataset:
    """Turn tf.data autotuning off for a pipeline.

    In a distributed graph-mode session, destroying an iterator waits for the autotune thread's
    current sleep (seconds, growing with run time): session close at the end of training then
    stalls for 15-20 s. Fixed parallelism avoids that and costs nothing here.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def plain_input_fn(
    records: int, epochs: int, batch_size: int, seed: int, num_shards: int, shard: int
) -> Callable[[], tf.data.Dataset]:
    """Baseline input: this trainer's 1/num_shards of the records, shuffled, no dlrover."""

    def input_fn() -> tf.data.Dataset:
        ds = tf.data.Dataset.range(records).shard(num_shards, shard)
        buffer = max(1, min(math.ceil(records / num_shards), 100_000))
        ds = ds.shuffle(buffer, seed=seed, reshuffle_each_iteration=True).repeat(epochs)
        ds = ds.batch(batch_size).map(read_fn, num_parallel_calls=_READ_THREADS)
        return without_autotune(ds.prefetch(_PREFETCH_BATCHES))

    return input_fn


def eval_input_fn(records: int, batch_size: int) -> Callable[[], tf.data.Dataset]:
    """Evaluation records, disjoint from training ones, read in order."""

    def input_fn() -> tf.data.Dataset:
        ds = tf.data.Dataset.range(EVAL_OFFSET, EVAL_OFFSET + records).batch(batch_size)
        ds = ds.map(read_fn, num_parallel_calls=_READ_THREADS).prefetch(_PREFETCH_BATCHES)
        return without_autotune(ds)

    return input_fn


class WaitForChiefHook(tf.estimator.SessionRunHook):
    """On a non-chief worker, waits (after graph building) until the chief has initialised.

    The chief checkpoints right after it initialised the variables. A worker whose first
    readiness check comes earlier sleeps a fixed 30 s (SessionManager's recovery_wait_secs,
    which the estimator does not expose). A checkpoint left by an earlier run also counts.
    """

    def __init__(self, model_dir: str, timeout_secs: float) -> None:
        self._model_dir = model_dir
        self._timeout_secs = timeout_secs

    def begin(self) -> None:
        started = time.monotonic()
        while tf.train.latest_checkpoint(self._model_dir) is None:
            if time.monotonic() - started > self._timeout_secs:
                logger.warning("no checkpoint from the chief after %.0f s", self._timeout_secs)
                return
            time.sleep(0.1)
        logger.info("chief is ready (waited %.1f s)", time.monotonic() - started)


def run_evaluator(
    estimator: tf.estimator.Estimator,
    input_fn: Callable[[], tf.data.Dataset],
    steps: int,
    throttle_secs: float,
) -> dict | None:
    """Evaluate each new checkpoint until the chief marks training done, then the final one.

    Replaces train_and_evaluate's evaluator loop, which only ends at TrainSpec.max_steps and so
    never ends when training runs until the data ends (max_steps=None).
    """
    done_path = os.path.join(estimator.model_dir, DONE_MARKER)
    last_checkpoint = None
    metrics = None
    next_eval = 0.0
    while True:
        done = tf.io.gfile.exists(done_path)  # checked first: if set, the final ckpt exists
        checkpoint = estimator.latest_checkpoint()
        if checkpoint and checkpoint != last_checkpoint and (done or time.monotonic() >= next_eval):
            next_eval = time.monotonic() + throttle_secs
            last_checkpoint = checkpoint
            try:
                metrics = estimator.evaluate(input_fn, steps=steps, checkpoint_path=checkpoint)
            except tf.errors.NotFoundError:
                # keep_checkpoint_max deleted it meanwhile; a newer one exists.
                logger.info("checkpoint %s was deleted before evaluation; skipping", checkpoint)
                continue
            logger.info("[evaluator] %s", _format_metrics(metrics))
            continue
        if done and checkpoint in (None, last_checkpoint):
            return metrics
        time.sleep(0.5)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _format_metrics(metrics: dict) -> str:
    rate = float(metrics["label_mean"])
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if 0 < rate < 1 else 0.0
    return (
        f"global_step={int(metrics['global_step'])} loss={metrics['loss']:.4f} "
        f"auc={metrics['auc']:.4f} accuracy={metrics['accuracy']:.4f} "
        f"base_rate_entropy={entropy:.4f}"
    )


_TF_LOG_NOISE = (
    "is deprecated and will be removed",
    # The step counter reads global_step on the PS racing with other workers' updates.
    "global step (tf.train.get_global_step) has not been increased",
)


class _DropNoise(logging.Filter):
    """Drops TF's deprecation notices (all of tf.estimator is deprecated) and a benign warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in _TF_LOG_NOISE)


def _setup_logging() -> None:
    """One handler with timestamps for ours and TF's INFO logs (loss, checkpoints, steps/s)."""
    # Keras' v1 feature-column layers warn on every build; nothing to act on.
    warnings.filterwarnings("ignore", message=r".*add_variable. is deprecated")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tf_logger = tf.get_logger()
    tf_logger.handlers.clear()  # TF's own handler would print every line twice
    tf_logger.propagate = True
    tf_logger.setLevel(logging.INFO)
    tf_logger.addFilter(_DropNoise())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; the model dir defaults to $DLROVER_MODEL_DIR."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", choices=("dlrover", "plain"), default="dlrover")
    p.add_argument("--records", type=int, default=200_000, help="training records")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument(
        "--model-dir", default=os.environ.get("DLROVER_MODEL_DIR", "./runs/wide_deep/model")
    )
    p.add_argument("--eval-records", type=int, default=20_000)
    p.add_argument(
        "--checkpoint-steps", type=int, default=500, help="the chief checkpoints every N steps"
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle and initialisation seed")
    p.add_argument(
        "--files",
        metavar="DIR",
        help="write the training records as TFRecord files in DIR (once; kept) and train from "
        "them through ShardedDataset.from_files (--input dlrover only)",
    )
    p.add_argument("--num-files", type=int, default=8, help="TFRecord files --files writes")
    p.add_argument(
        "--log-trained-ids",
        metavar="PATH_PREFIX",
        help="append each step's record indices to PATH_PREFIX.<task>.<index>.<pid>.ids (and "
        "its global step, record count and end time to that path + .steps)",
    )
    p.add_argument(
        "--progress-hook-only",
        action="store_true",
        help="use only ShardProgressHook: no elastic_model_fn, no CheckpointLedgerListener",
    )
    p.add_argument(
        "--rehearse-hang",
        metavar="TASK:INDEX:STEP",
        help="rehearse a hang: that task stops stepping at its local STEP (once per model dir)",
    )
    p.add_argument(
        "--graph-rewrites",
        action="store_true",
        help="keep TF's graph optimizer (Grappler) on: every new session, e.g. after a PS "
        "failure, then spends seconds optimizing the graph before its first step",
    )
    args = p.parse_args(argv)
    if args.rehearse_hang:
        parts = args.rehearse_hang.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            p.error(f"--rehearse-hang {args.rehearse_hang!r}: expected TASK:INDEX:STEP")
    if args.files and args.input != "dlrover":
        p.error("--files reads the files through dlrover_tf: use it with --input dlrover")
    for name in (
        "records",
        "epochs",
        "batch_size",
        "eval_records",
        "checkpoint_steps",
        "num_files",
    ):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Train (chief, worker) or evaluate (evaluator) as TF_CONFIG says; 0 when the data ends."""
    args = parse_args(argv)
    _setup_logging()

    config = tf.estimator.RunConfig(
        model_dir=args.model_dir,
        tf_random_seed=args.seed,
        save_checkpoints_steps=args.checkpoint_steps,
        keep_checkpoint_max=5,
        save_summary_steps=500,
        log_step_count_steps=500,
        # The estimator otherwise sleeps 5 s per worker index before training.
        experimental_max_worker_delay_secs=0,
    )
    task = f"{config.task_type}:{config.task_id}"
    if (
        args.input == "dlrover"
        and config.task_type in ("chief", "worker")
        and not args.progress_hook_only
    ):
        from dlrover_tf.elastic_ps import elastic_model_fn, without_graph_rewrites

        if not args.graph_rewrites:
            config = without_graph_rewrites(config)
        # Sessions rebuilt after a PS failure (and the first ones) start once the chief is ready.
        fn = elastic_model_fn(model_fn)
    else:
        fn = model_fn
    estimator = tf.estimator.Estimator(
        fn,
        config=config,
        params={"num_ps": config.num_ps_replicas, "log_every": 200, "task": task},
    )
    eval_steps = math.ceil(args.eval_records / args.batch_size)
    evaluate = eval_input_fn(args.eval_records, args.batch_size)
    done_path = os.path.join(args.model_dir, DONE_MARKER)

    if config.task_type == "evaluator":
        metrics = run_evaluator(estimator, evaluate, eval_steps, throttle_secs=5)
        if metrics:
            print(f"final eval [{task}]: {_format_metrics(metrics)}", flush=True)
        return 0

    hooks: list[tf.estimator.SessionRunHook] = []
    listeners: list[tf.estimator.CheckpointSaverListener] = []
    if not config.is_chief and config.task_type == "worker" and args.input != "dlrover":
        hooks.append(WaitForChiefHook(args.model_dir, timeout_secs=60))
    if args.log_trained_ids:
        # Before the progress hook: a step's ids are on disk before the master hears of it, so a
        # kill in between can only make a record look trained twice, never not at all.
        path = f"{args.log_trained_ids}.{config.task_type}.{config.task_id}.{os.getpid()}.ids"
        hooks.append(TrainedIdsHook(path))
    if args.rehearse_hang:
        kind, index, at = args.rehearse_hang.split(":")
        if (kind, int(index)) == (config.task_type, config.task_id):
            marker = os.path.join(args.model_dir, f"rehearsed-hang.{kind}.{index}")
            os.makedirs(args.model_dir, exist_ok=True)
            hooks.append(RehearseHangHook(int(at), marker))
    if args.input == "dlrover":
        try:
            import dlrover_tf

            if args.files:
                from tfrecord_data import parse_fn, write_files

                paths = write_files(args.files, args.records, args.num_files, read_fn)
                dataset = dlrover_tf.ShardedDataset.from_files(
                    "train", paths, "tfrecord", args.batch_size, args.epochs, True, args.seed
                )
                parse_records = parse_fn(read_fn)
            else:
                dataset = dlrover_tf.ShardedDataset(
                    "train",
                    size=args.records,
                    batch_size=args.batch_size,
                    epochs=args.epochs,
                    shuffle=True,
                    seed=args.seed,
                )
        except Exception as err:  # the client's messages say what to fix; no traceback
            print(
                f"wide_deep.py: --input dlrover: {err} (--input plain needs no master)",
                file=sys.stderr,
            )
            return 2

        def train_input_fn() -> tf.data.Dataset:
            if args.files:
                return dataset.to_tf_dataset(parse_records)
            return dataset.to_tf_dataset(read_fn)

        # On the chief it also reports each checkpoint saved in the model dir with the data
        # position, and the step each session restored: the data follows the model.
        hooks.append(dlrover_tf.ShardProgressHook(dataset, model_dir=args.model_dir))
        if config.is_chief and not args.progress_hook_only:
            # The data position is saved with every checkpoint: after a PS failure the master
            # rolls the data back to the checkpoint the chief restores.
            listeners.append(dlrover_tf.CheckpointLedgerListener(dataset, model_dir=args.model_dir))
    else:
        train_input_fn = plain_input_fn(
            args.records,
            args.epochs,
            args.batch_size,
            args.seed,
            num_shards=max(1, config.num_worker_replicas),
            shard=config.global_id_in_cluster if config.cluster_spec else 0,
        )

    if config.is_chief and tf.io.gfile.exists(done_path):
        tf.io.gfile.remove(done_path)  # left by an earlier run in this model dir

    started = time.monotonic()
    tf.estimator.train_and_evaluate(
        estimator,
        tf.estimator.TrainSpec(
            train_input_fn, max_steps=None, hooks=hooks, saving_listeners=listeners
        ),
        tf.estimator.EvalSpec(evaluate, steps=eval_steps, start_delay_secs=0, throttle_secs=5),
    )
    logger.info("[%s] training ended after %.1f s", task, time.monotonic() - started)

    if config.is_chief:
        step = tf.train.load_variable(args.model_dir, tf.compat.v1.GraphKeys.GLOBAL_STEP)
        with tf.io.gfile.GFile(done_path, "w") as f:
            f.write(json.dumps({"global_step": int(step)}))
        metrics = estimator.evaluate(evaluate, steps=eval_steps, name="final")
        print(f"final eval [{task}]: {_format_metrics(metrics)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
