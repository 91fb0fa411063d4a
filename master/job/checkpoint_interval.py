"""The chief's checkpoint interval, set by the master from what a checkpoint costs.

After an unannounced PS death the model goes back to the latest checkpoint, so on average half
an interval of steps is trained again. A shorter interval redoes less but checkpoints more: the
job's `checkpoint_overhead` (a fraction of the training time) says how much checkpointing it may
cost, and the interval is the shortest that keeps within it, from the chief's measured save
time (`CHECKPOINT_COST_KEY`) and the job's step rate. The chief follows the interval the master
writes under `CHECKPOINT_INTERVAL_KEY` (dlrover_tf.elastic_saver) when it is shorter than the
job's own (the master only makes checkpoints more frequent). `CheckpointIntervalTuner` is the
part of the job that measures and sets it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from master.client import CHECKPOINT_COST_KEY, CHECKPOINT_INTERVAL_KEY
from master.job.events import Emit
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


class CheckpointIntervalTuner:
    """Sets the chief's checkpoint interval from its save cost and the job's step rate."""

    def __init__(self, overhead: float, kv: KVStore, emit: Emit) -> None:
        self._overhead = overhead  # the job's checkpoint_overhead (0: off)
        self._kv = kv
        self._emit = emit
        self._next_at = 0.0  # monotonic time of the next look
        self._sample: tuple[float, int] | None = None  # (monotonic time, global step)
        self._steps: int | None = None  # the interval told to the chief
        self._costs: list[bytes] = []  # the latest save costs the chief reported

    def tick(self, global_step: int) -> None:
        """Control loop: every few seconds, from the latest save cost and the step rate."""
        if self._overhead <= 0:
            return
        now = time.monotonic()
        if now < self._next_at:
            return
        self._next_at = now + TUNE_EVERY_SECONDS
        sample, self._sample = self._sample, (now, global_step)
        if sample is None or global_step <= sample[1]:
            return
        rate = (global_step - sample[1]) / (now - sample[0])
        raw = self._kv.get(CHECKPOINT_COST_KEY, 0)
        costs = self._costs
        if raw and (not costs or costs[-1] != raw):
            costs[:] = [*costs[-(COSTS_KEPT - 1) :], raw]
        cost = statistics.median(float(c) for c in costs) if costs else 0.0
        choice = interval_steps(cost, rate, self._overhead)
        if choice is None or not worth_changing(self._steps, choice.steps):
            return
        self._steps = choice.steps
        self._kv.set(CHECKPOINT_INTERVAL_KEY, str(choice.steps).encode())
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
