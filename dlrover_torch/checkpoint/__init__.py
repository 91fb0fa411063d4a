"""Flash checkpoint: save to shared memory at copy speed, persist to disk in the background.

``Checkpointer`` (plain and DDP models) and ``ShardedCheckpointer`` (FSDP; its disk layout is
the one ``torch.distributed.checkpoint`` reads) run in training processes;
``AgentCheckpointKeeper`` runs in the node agent and owns the shared memory and the persister.
Names are imported lazily so the persister process never pays for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from dlrover_torch.checkpoint.env import SERVICE_ENV
from dlrover_torch.checkpoint.errors import (
    CapacityError,
    CheckpointError,
    CorruptCheckpointError,
    UnsupportedValueError,
)

_LAZY = {
    "Checkpointer": "dlrover_torch.checkpoint.checkpointer",
    "ShardedCheckpointer": "dlrover_torch.checkpoint.sharded",
    "AgentCheckpointKeeper": "dlrover_torch.checkpoint.keeper",
}

__all__ = [
    "SERVICE_ENV",
    "AgentCheckpointKeeper",
    "CapacityError",
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "ShardedCheckpointer",
    "UnsupportedValueError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
