"""A TF2 parameter-server program as Kubeflow TFJob users write it; it knows nothing of dlrover.

It reads TF_CONFIG through TFConfigClusterResolver. Workers and PS start a tf.distribute.Server
and serve in server.join() for ever; the chief builds a ParameterServerStrategy, trains a small
Keras model with model.fit on a synthetic dataset, then evaluates through a ClusterCoordinator.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")  # the coordinator retries a lost worker

import tensorflow as tf  # noqa: E402


def serve(resolver: tf.distribute.cluster_resolver.TFConfigClusterResolver) -> None:
    """A worker or PS: serve the cluster until killed."""
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    print(f"{resolver.task_type} {resolver.task_id} serving", flush=True)
    server.join()


def dataset_fn(input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
    x = tf.random.uniform((1024, 8))
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024).repeat()
    return dataset.batch(32).prefetch(2)


def train(resolver: tf.distribute.cluster_resolver.TFConfigClusterResolver, args) -> None:
    """The chief: fit, then evaluate on the workers through a ClusterCoordinator."""
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(1)]
        )
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="mse")
    model.fit(
        tf.keras.utils.experimental.DatasetCreator(dataset_fn),
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        verbose=2,
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        eval_loss = tf.keras.metrics.Mean()

    @tf.function
    def eval_step(iterator):
        def step(x, y):
            eval_loss.update_state(tf.reduce_mean(tf.square(model(x) - y)))

        strategy.run(step, args=next(iterator))

    eval_iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    for _ in range(args.eval_steps):
        coordinator.schedule(eval_step, args=(eval_iterator,))
    coordinator.join()
    print(f"evaluation loss {float(eval_loss.result()):.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=100)
    parser.add_argument("--eval-steps", type=int, default=20)
    args = parser.parse_args()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        serve(resolver)
    else:
        train(resolver, args)
        print("chief done", flush=True)


if __name__ == "__main__":
    main()
