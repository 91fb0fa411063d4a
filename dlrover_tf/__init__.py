"""TensorFlow integration: sharded input from the master and step-granular progress reports."""

import importlib

from dlrover_tf.dataset import FileShardedDataset, ShardedDataset

__all__ = [
    "CheckpointLedgerListener",
    "FileShardedDataset",
    "KerasPSCoordinator",
    "ShardedDataset",
    "ShardFeeder",
    "ShardProgressCallback",
    "ShardProgressHook",
    "keras_ps",
]

# TF2 ParameterServerStrategy (Keras): name exported here -> name in dlrover_tf.keras_ps.
_KERAS_PS = {"KerasPSCoordinator": "Coordinator", "ShardFeeder": "ShardFeeder"}


def __getattr__(name: str):
    # The hooks and the Keras PS path import TensorFlow; load them only when asked for.
    if name in ("ShardProgressHook", "ShardProgressCallback", "CheckpointLedgerListener"):
        from dlrover_tf import hooks

        return getattr(hooks, name)
    if name in _KERAS_PS or name == "keras_ps":
        module = importlib.import_module("dlrover_tf.keras_ps")
        return module if name == "keras_ps" else getattr(module, _KERAS_PS[name])
    raise AttributeError(f"module 'dlrover_tf' has no attribute {name!r}")
