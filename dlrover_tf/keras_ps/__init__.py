"""TF2 `ParameterServerStrategy` (Keras) under the dlrover master.

In TF2 PS training one process, the coordinator (the chief in TF_CONFIG), runs the Python
program and schedules steps onto workers and PS that are plain `tf.distribute.Server`s. A
Python generator cannot run on a remote worker, so the coordinator owns the shard bookkeeping:
`ShardFeeder` takes shards from the master and cuts them into batches of record indices; each
step gets its batch as a tensor argument and builds the features from the indices on the
worker; the batch's records are reported consumed when that step's result resolves.

- `connect()`: on a worker or PS, serve until the coordinator is done (never returns); on the
  chief, return the strategy.
- `Coordinator.run(step_fn)`: the exact loop. A worker that dies has its steps retried on the
  others by `ClusterCoordinator` with the same indices, so at most the batch it had in flight
  is trained twice.
- `Coordinator.fit(model, read_fn, ...)`: `model.fit` on the same bookkeeping (see its doc).
- PS loss: TF2 cannot rebuild the lost variables under a running coordinator; the master
  restarts the coordinator (budget-free), which restores the latest checkpoint and tells the
  master its step, so the data goes back to exactly that position.

Modules: `servers` (TF_CONFIG, the worker and PS servers, `connect`), `feeder` (`ShardFeeder`),
`coordinator` (`Coordinator`: the step loop, `fit`, checkpoints). None imports TensorFlow at
import time: a server must block its stop signals before TensorFlow starts threads.
"""

from dlrover_tf.keras_ps.coordinator import BATCH_LOG_KEY, PS_LOSS_WAIT_SECONDS, Coordinator
from dlrover_tf.keras_ps.feeder import SHARD_WAIT_MS, Batch, ShardFeeder
from dlrover_tf.keras_ps.servers import (
    DONE_KEY,
    DONE_POLL_SECONDS,
    connect,
    exit_process,
    serve,
    tf_config,
)

__all__ = [
    "BATCH_LOG_KEY",
    "DONE_KEY",
    "DONE_POLL_SECONDS",
    "PS_LOSS_WAIT_SECONDS",
    "SHARD_WAIT_MS",
    "Batch",
    "Coordinator",
    "ShardFeeder",
    "connect",
    "exit_process",
    "serve",
    "tf_config",
]
