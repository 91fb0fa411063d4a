"""The chief's checkpoint interval, set by the master from what a checkpoint costs.

After an unannounced PS death the model goes back to the latest checkpoint, so on average half
an interval of steps is trained again. A shorter interval redoes less but checkpoints more: the
job's `checkpoint_overhead` (a fraction of the training time) says how much checkpointing it may
cost, and the interval is the shortest that keeps within it, from the chief's measured save
time (`CHECKPOINT_COST_KEY`) and the job's step rate. The chief follows the interval the master
writes under `CHECKPOINT_INTERVAL_KEY` (dlrover_tf.elastic_saver) when it is shorter than the
job's own (the master only makes checkpoints more frequent). `CheckpointIntervalMixin`
is the part of `JobMaster` that measures and sets it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from master.client import CHECKPOINT_COST_KEY, CHECKPOINT_INTERVAL_KEY

if TYPE_CHECKING:
    from master.config import JobSpec
    from master.kv.store import KVStore

MIN_INTERVAL_STEPS = 20
MAX_INTERVAL_STEPS = 1_000_000
# The interval is recomputed this often, and changed only when it moves by more than this.
TUNE_EVERY_SECONDS = 5.0
CHANGE_THRESHOLD = 0.2
COSTS_KEPT = 5  # the save cost is the median of the latest few the chief reported


@dataclass(frozen=True)
class IntervalChoice:
    """An interval in steps and what it means: its cost and the expected redo after a loss."""

    steps: int
    checkpoint_seconds: float
    steps_per_second: float
    overhead: float

    @property
    def expected_redo_steps(self) -> int:
        """Steps trained again after a PS death at a random moment: half an interval."""
        return self.steps // 2


def interval_steps(
    checkpoint_seconds: float, steps_per_second: float, overhead: float
) -> IntervalChoice | None:
    """The fewest steps between checkpoints such that saving takes at most `overhead` of the
    time: with C seconds per save and T seconds of training between saves, C / (T + C) <= f,
    so T = C (1 - f) / f. None when it cannot be said (off, or nothing measured yet)."""
    if not 0 < overhead < 1 or checkpoint_seconds <= 0 or steps_per_second <= 0:
        return None
    train_seconds = checkpoint_seconds * (1 - overhead) / overhead
    steps = math.ceil(train_seconds * steps_per_second)
    steps = min(max(steps, MIN_INTERVAL_STEPS), MAX_INTERVAL_STEPS)
    return IntervalChoice(steps, checkpoint_seconds, steps_per_second, overhead)


def worth_changing(current: int | None, proposed: int) -> bool:
    """Whether to tell the chief a new interval (small moves are noise in the measurements)."""
    return current is None or abs(proposed - current) > CHANGE_THRESHOLD * current


class CheckpointIntervalMixin:
    """The part of `JobMaster` that sets the chief's checkpoint interval."""

    spec: JobSpec
    kv: KVStore
    global_step: int
    _emit: Callable[..., Any]
    _interval_state: dict[str, Any]

    def _init_checkpoint_interval(self) -> None:
        self._interval_state = {"next": 0.0, "sample": None, "steps": None, "costs": []}

    def _tune_checkpoint_interval(self) -> None:
        """Control loop: every few seconds, from the latest save cost and the step rate."""
        if self.spec.checkpoint_overhead <= 0:
            return
        state = self._interval_state
        now = time.monotonic()
        if now < state["next"]:
            return
        state["next"] = now + TUNE_EVERY_SECONDS
        sample, state["sample"] = state["sample"], (now, self.global_step)
        if sample is None or self.global_step <= sample[1]:
            return
        rate = (self.global_step - sample[1]) / (now - sample[0])
        raw = self.kv.get(CHECKPOINT_COST_KEY, 0)
        costs = state["costs"]
        if raw and (not costs or costs[-1] != raw):
            costs[:] = [*costs[-(COSTS_KEPT - 1) :], raw]
        cost = statistics.median(float(c) for c in costs) if costs else 0.0
        choice = interval_steps(cost, rate, self.spec.checkpoint_overhead)
        if choice is None or not worth_changing(state["steps"], choice.steps):
            return
        state["steps"] = choice.steps
        self.kv.set(CHECKPOINT_INTERVAL_KEY, str(choice.steps).encode())
        self._emit(
            "checkpoint_interval",
            f"checkpoint every {choice.steps} steps: a save takes "
            f"{choice.checkpoint_seconds:.2f} s at {choice.steps_per_second:.1f} steps/s, "
            f"{choice.overhead:.0%} of the time; a PS lost at a random moment redoes "
            f"~{choice.expected_redo_steps} steps",
            steps=choice.steps,
            checkpoint_seconds=choice.checkpoint_seconds,
            steps_per_second=round(choice.steps_per_second, 2),
            overhead=choice.overhead,
            expected_redo_steps=choice.expected_redo_steps,
        )
