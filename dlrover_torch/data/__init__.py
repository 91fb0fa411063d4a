"""Torch data that survives restarts and world-size changes.

`sampler` (ElasticDistributedSampler: a DistributedSampler whose position is saved and re-split
over the ranks after a restart), `sharded` (ShardedDataset: the master's shards over a map-style
dataset or over files, for a DataLoader with workers), `global_batch` (FixedGlobalBatch:
gradient accumulation that keeps the global batch when the world size changes).
"""

from dlrover_torch.data.global_batch import FixedGlobalBatch, accumulation_steps
from dlrover_torch.data.sampler import ElasticDistributedSampler
from dlrover_torch.data.sharded import FileShardedDataset, ShardedDataset, ShardLoader

__all__ = [
    "ElasticDistributedSampler",
    "FileShardedDataset",
    "FixedGlobalBatch",
    "ShardLoader",
    "ShardedDataset",
    "accumulation_steps",
]
