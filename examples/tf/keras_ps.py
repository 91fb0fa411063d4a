"""A small CTR model trained with TF2 ParameterServerStrategy (Keras) under the dlrover master.

One program for every node: on the PS and workers `keras_ps.connect()` runs a plain TF server
until the coordinator is done; on the chief (the coordinator) it returns the strategy. The
data is the synthetic CTR set of wide_deep.py, computed from the record index with TF ops, so
a step's batch is built on the worker from the record indices the coordinator hands it.

`--loop coordinator` (default) runs the exact ClusterCoordinator loop; `--loop fit` runs
`model.fit` on the same bookkeeping.
"""

from __future__ import annotations

import argparse
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from wide_deep import DENSE, VOCAB, read_fn  # noqa: E402 (same folder)

import dlrover_tf  # noqa: E402
from dlrover_tf import keras_ps  # noqa: E402

logger = logging.getLogger("keras_ps")
EMBEDDING_DIM = 8


def build_model() -> tf.keras.Model:
    """Embeddings of the categorical ids and the dense features into a small MLP (logits)."""
    inputs, parts = {}, []
    for name, vocab in VOCAB.items():
        inputs[name] = tf.keras.Input(shape=(), dtype=tf.int64, name=name)
        parts.append(
            tf.keras.layers.Embedding(vocab, EMBEDDING_DIM, name=f"emb_{name}")(inputs[name])
        )
    for name in DENSE:
        inputs[name] = tf.keras.Input(shape=(), dtype=tf.float32, name=name)
        parts.append(tf.keras.layers.Reshape((1,))(inputs[name]))
    net = tf.keras.layers.Concatenate()(parts)
    net = tf.keras.layers.Dense(32, activation="relu")(net)
    logits = tf.keras.layers.Dense(1)(net)
    return tf.keras.Model(inputs, logits)


def features_of(indices: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    features, labels = read_fn(indices)
    x = {name: features[name] for name in VOCAB}
    x |= {name: tf.cast(features[name], tf.float32) for name in DENSE}
    return x, tf.reshape(tf.cast(labels, tf.float32), [-1, 1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=100_000, help="training records")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        help="steps between checkpoints (--loop fit: steps per Keras epoch, a checkpoint each)",
    )
    p.add_argument("--loop", choices=("coordinator", "fit"), default="coordinator")
    p.add_argument("--model-dir", default=os.environ.get("DLROVER_MODEL_DIR", "./runs/keras/model"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-trained-ids",
        metavar="PATH_PREFIX",
        help="workers append each applied step's record indices to PATH_PREFIX.steps.txt",
    )
    args = p.parse_args(argv)
    for name in ("records", "epochs", "batch_size", "checkpoint_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    strategy = keras_ps.connect()  # a worker or PS serves here until training is done
    tf.keras.utils.set_random_seed(args.seed)
    dataset = dlrover_tf.ShardedDataset(
        "train",
        size=args.records,
        batch_size=args.batch_size,
        epochs=args.epochs,
        shuffle=True,
        seed=args.seed,
    )
    with strategy.scope():
        model = build_model()
        optimizer = tf.keras.optimizers.Adagrad(0.1)
        optimizer.build(model.trainable_variables)  # slots exist before a restore
    loss_fn = tf.keras.losses.BinaryCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.SUM
    )
    ids_log = (
        f"file://{os.path.abspath(args.log_trained_ids)}.steps.txt" if args.log_trained_ids else ""
    )

    def log_ids(indices: tf.Tensor) -> None:
        # Written by the worker once the update is applied (tests count trained records).
        tf.print(indices, summarize=-1, output_stream=ids_log)

    def replica_step(indices: tf.Tensor) -> tf.Tensor:
        x, y = features_of(indices)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / tf.cast(tf.size(indices), tf.float32)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if ids_log:
            with tf.control_dependencies([optimizer.iterations.read_value()]):
                log_ids(indices)
        return loss

    @tf.function
    def step_fn(indices: tf.Tensor) -> tf.Tensor:
        return strategy.run(replica_step, args=(indices,))

    feeder = keras_ps.ShardFeeder(dataset)
    coordinator = keras_ps.Coordinator(
        strategy,
        feeder,
        tf.train.Checkpoint(model=model, optimizer=optimizer),
        optimizer.iterations,
        args.model_dir,
        checkpoint_every_steps=args.checkpoint_every,
    )
    if args.loop == "fit":
        with strategy.scope():
            model.compile(
                optimizer=optimizer, loss=tf.keras.losses.BinaryCrossentropy(from_logits=True)
            )
        coordinator.restore()
        coordinator.fit(
            model,
            features_of,
            steps_per_epoch=args.checkpoint_every,
            on_step=log_ids if ids_log else None,
        )
        steps = coordinator.steps_run
    else:
        coordinator.restore()
        steps = coordinator.run(step_fn)
    coordinator.finish()
    logger.info("trained %d steps here; global step %d", steps, coordinator.global_step)
    dataset.close()
    return 0


if __name__ == "__main__":
    # Not sys.exit: interpreter teardown can hang in ClusterCoordinator's destructor.
    keras_ps.exit_process(main())
