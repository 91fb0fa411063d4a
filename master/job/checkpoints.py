"""The checkpoint registry: which model checkpoints completed, with their ledger snapshots."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from master.state.api import StateStore

CHECKPOINT_TABLE = "checkpoints"


@dataclass(frozen=True)
class Checkpoint:
    """A model checkpoint that finished writing at `global_step`."""

    global_step: int
    path: str
    datasets: tuple[str, ...]


class CheckpointRegistry:
    """Completed checkpoints, kept in the state store; the latest one is what a restore uses."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._lock = threading.Lock()

    def report(self, checkpoint: Checkpoint) -> None:
        if checkpoint.global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {checkpoint.global_step}")
        record = {"path": checkpoint.path, "datasets": list(checkpoint.datasets)}
        with self._lock:
            self._store.put(
                CHECKPOINT_TABLE, f"{checkpoint.global_step:015d}", json.dumps(record).encode()
            )

    def latest(self) -> Checkpoint | None:
        with self._lock:
            rows = self._store.scan(CHECKPOINT_TABLE)
        if not rows:
            return None
        key = max(rows)
        record = json.loads(rows[key])
        return Checkpoint(int(key), record["path"], tuple(record["datasets"]))
