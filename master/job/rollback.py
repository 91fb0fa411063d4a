"""The data follows the model back to a checkpoint: each dataset's position saved with it.

When a PS loses its variables (or the chief restores a checkpoint), the model goes back to a
checkpoint's step, and every shard ledger goes back to the snapshot saved with that step
(master.sharding). `DataRollback` is the part of the job that does it and records it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from master.job.checkpoints import Checkpoint, CheckpointRegistry
from master.job.events import Emit
from master.nodes.manager import NodeManager
from master.nodes.model import TRAINING_TYPES
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


class DataRollback:
    """Moves the data back with the model, and knows how: whether the chief reports the step
    of each model it restores (dlrover_tf.elastic_model_fn) or the master must guess it."""

    def __init__(
        self,
        nodes: NodeManager,
        sharding: ShardingService,
        checkpoints: CheckpointRegistry,
        platform: Platform,
        emit: Emit,
    ) -> None:
        self._nodes = nodes
        self._sharding = sharding
        self._checkpoints = checkpoints
        self._platform = platform
        self._emit = emit
        # From the chief's first restore report on, a PS failure waits for that report
        # instead of guessing the step (kept in the runtime record).
        self.chief_reports_restores = False
        # A PS was lost and the chief's restore report will roll the data back: that rollback
        # is reported even when it moves nothing (the checkpoint was where the data was).
        self._restore_after_ps_loss = False

    def catch_up_positions(self) -> int:
        """Apply every running trainer's latest position that its platform can read (steps
        its coalesced reports have not carried yet), so a ledger snapshot saved now counts
        every step taken so far, as with a report per step. Returns the positions applied."""
        applied = 0
        for node in self._nodes.all_current():
            if node.type in TRAINING_TYPES and not node.state.ended:
                applied += self._sharding.apply_positions(
                    node.id, self._platform.read_positions(node.id)
                )
        return applied

    def free_held_shards(self, keep: int | None = None) -> None:
        """The model is lost until the chief restores it: every trainer's held shards (but
        node `keep`'s) go back to the queue now. Their input pipelines, blocked waiting for a
        shard while the others hold the rest, then yield, so the failed sessions can close
        and be rebuilt (TF waits for running input ops when it closes a session). What they
        trained counts first."""
        self.catch_up_positions()
        for node in self._nodes.all_current():
            if node.type in TRAINING_TYPES and node.id != keep:
                self._sharding.release_everywhere(node.id)

    def await_restore(self, keep: int | None = None) -> None:
        """A PS lost its variables and the chief will report the step it restores: held
        shards go back now (but node `keep`'s), the data follows that report."""
        self.free_held_shards(keep)
        self._restore_after_ps_loss = True

    def note_restore_report(self) -> bool:
        """The chief reported a restore; whether it is its first (the runtime record changes)."""
        first = not self.chief_reports_restores
        self.chief_reports_restores = True
        return first

    def to_restored_step(self, step: int) -> None:
        """The chief restored the model at `step`: the data goes back to exactly that step."""
        after_ps_loss, self._restore_after_ps_loss = self._restore_after_ps_loss, False
        if step == 0 and all(s.records_done == 0 for s in self._sharding.stats()):
            return  # a fresh start: nothing to go back from
        self.rollback(step, reason=MODEL_RESTORED, report_unchanged=after_ps_loss)

    def rollback(
        self, step: int | None = None, reason: str = PS_FAILED, report_unchanged: bool = False
    ) -> None:
        """The model goes back to a checkpoint (a PS lost its variables, or the chief restored
        one), so every dataset goes back to the position saved with it. Without a step: the
        latest checkpoint the master knows of (or the start if none exists). An event says
        so for each dataset it moved (`rollbacks_to_report`)."""
        if step is None:
            step = rollback_step(self._checkpoints.latest())
        # Every step taken so far counts before (coalesced reports lag): the records to train
        # again are then exactly those the restored model has not trained on.
        self.catch_up_positions()
        before = _records_done(self._sharding.stats())
        # The position saved last at or before `step` (a model's global step may be past its
        # checkpoint's name: workers step on while the chief saves).
        saved_at = {
            name: self._sharding.restore_snapshot(name, step)["global_step"]
            for name in self._sharding.names()
        }
        after = _records_done(self._sharding.stats())
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
