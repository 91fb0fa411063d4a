"""The data follows the model back to a checkpoint: each dataset's position saved with it.

When a PS loses its variables (or the chief restores a checkpoint), the model goes back to a
checkpoint's step, and every shard ledger goes back to the snapshot saved with that step
(master.sharding). `RollbackMixin` is the part of `JobMaster` that does it and records it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from master.nodes.model import TRAINING_TYPES

if TYPE_CHECKING:
    from master.job.checkpoints import Checkpoint, CheckpointRegistry
    from master.nodes.manager import NodeManager
    from master.platform.api import Platform
    from master.sharding.service import ShardingService

MODEL_RESTORED = "model_restored"  # the chief reported the step it restored
PS_FAILED = "ps_failed"  # a PS lost its variables


def rollback_step(latest: Checkpoint | None) -> int:
    """The step to go back to when none is known: the latest checkpoint's, or the start."""
    return latest.global_step if latest else 0


@dataclass(frozen=True)
class DatasetRollback:
    """One dataset sent back to a checkpoint's position: how many records train again."""

    dataset: str
    records_to_redo: int


def rollbacks_to_report(
    before: Mapping[str, int],
    after: Mapping[str, int],
    reason: str,
    report_unchanged: bool = False,
) -> list[DatasetRollback]:
    """The datasets whose rollback is worth an event, from the records done before and after
    it. A restore the chief reports that changed nothing (it restored where the data was) is
    not, unless it follows a PS loss (`report_unchanged`); a PS failure always is."""
    quiet = reason == MODEL_RESTORED and not report_unchanged
    return [
        DatasetRollback(name, before[name] - done)
        for name, done in after.items()
        if not (before[name] == done and quiet)
    ]


class RollbackMixin:
    """The part of `JobMaster` that moves the data back with the model."""

    nodes: NodeManager
    sharding: ShardingService
    checkpoints: CheckpointRegistry
    platform: Platform
    _emit: Callable[..., Any]

    def catch_up_positions(self) -> int:
        """Apply every running trainer's latest position that its platform can read (steps
        its coalesced reports have not carried yet), so a ledger snapshot saved now counts
        every step taken so far, as with a report per step. Returns the positions applied."""
        applied = 0
        for node in self.nodes.all_current():
            if node.type in TRAINING_TYPES and not node.state.ended:
                applied += self.sharding.apply_positions(
                    node.id, self.platform.read_positions(node.id)
                )
        return applied

    def _free_held_shards(self, keep: int | None = None) -> None:
        """The model is lost until the chief restores it: every trainer's held shards (but
        node `keep`'s) go back to the queue now. Their input pipelines, blocked waiting for a
        shard while the others hold the rest, then yield, so the failed sessions can close
        and be rebuilt (TF waits for running input ops when it closes a session). What they
        trained counts first."""
        self.catch_up_positions()
        for node in self.nodes.all_current():
            if node.type in TRAINING_TYPES and node.id != keep:
                self.sharding.release_everywhere(node.id)

    def _rollback_data(
        self, step: int | None = None, reason: str = PS_FAILED, report_unchanged: bool = False
    ) -> None:
        """The model goes back to a checkpoint (a PS lost its variables, or the chief restored
        one), so every dataset goes back to the position saved with it. Without a step: the
        latest checkpoint the master knows of (or the start if none exists). An event says
        so for each dataset it moved (`rollbacks_to_report`)."""
        if step is None:
            step = rollback_step(self.checkpoints.latest())
        # Every step taken so far counts before (coalesced reports lag): the records to train
        # again are then exactly those the restored model has not trained on.
        self.catch_up_positions()
        before = _records_done(self.sharding.stats())
        # The position saved last at or before `step` (a model's global step may be past its
        # checkpoint's name: workers step on while the chief saves).
        saved_at = {
            name: self.sharding.restore_snapshot(name, step)["global_step"]
            for name in self.sharding.names()
        }
        after = _records_done(self.sharding.stats())
        for r in rollbacks_to_report(before, after, reason, report_unchanged):
            self._emit(
                "rollback",
                f"dataset {r.dataset}: back to the position of checkpoint step {step} "
                f"({r.records_to_redo:,} records to train again)",
                reason=reason,
                dataset=r.dataset,
                checkpoint_step=step,
                position_step=saved_at[r.dataset],
                records_to_redo=r.records_to_redo,
            )


def _records_done(stats: Iterable[Any]) -> dict[str, int]:
    return {s.name: s.records_done for s in stats}
