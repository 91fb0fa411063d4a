"""TensorFlow integration: sharded input from the master and step-granular progress reports."""

from dlrover_tf.dataset import ShardedDataset

__all__ = [
    "CheckpointLedgerListener",
    "ShardedDataset",
    "ShardProgressCallback",
    "ShardProgressHook",
]


def __getattr__(name: str):
    # The hooks import TensorFlow; load them only when asked for.
    if name in ("ShardProgressHook", "ShardProgressCallback", "CheckpointLedgerListener"):
        from dlrover_tf import hooks

        return getattr(hooks, name)
    raise AttributeError(f"module 'dlrover_tf' has no attribute {name!r}")
