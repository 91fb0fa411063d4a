"""A fixed global batch whatever the world size: gradient accumulation steps derived from it, so
the records per optimizer step, and so the learning-rate schedule, stay the same."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches each rank runs per optimizer step so that the step sees exactly
    `global_batch_size` records; ValueError when the world size cannot make it."""
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("world_size", world_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    per_round = micro_batch_size * world_size
    if global_batch_size % per_round:
        fits = [
            w
            for w in range(1, global_batch_size + 1)
            if global_batch_size % (micro_batch_size * w) == 0
        ]
        raise ValueError(
            f"global batch {global_batch_size} is not a multiple of micro batch "
            f"{micro_batch_size} x world size {world_size} = {per_round}: the job can run at "
            f"world sizes {fits} with these sizes; pick a global batch divisible by the micro "
            "batch times every world size the job may have (e.g. their least common multiple)"
        )
    return global_batch_size // per_round


class FixedGlobalBatch:
    """Gradient accumulation for a fixed global batch at the current world size.

    Each rank runs `accumulation_steps` micro-batches of `micro_batch_size` per optimizer
    step, scaling each loss by `loss_scale`; DDP's all-reduce runs only on the last one
    (`sync(model, micro_step)`). Build it after each restart (the world size is read then).
    """

    def __init__(
        self, global_batch_size: int, micro_batch_size: int, world_size: int | None = None
    ) -> None:
        if world_size is None:
            initialized = dist.is_available() and dist.is_initialized()
            world_size = dist.get_world_size() if initialized else 1
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.world_size = world_size
        self.accumulation_steps = accumulation_steps(
            global_batch_size, micro_batch_size, world_size
        )

    @property
    def loss_scale(self) -> float:
        """Multiply each micro-batch's mean loss by this: the step's gradient is then the
        mean over the global batch."""
        return 1.0 / self.accumulation_steps

    @property
    def records_per_rank(self) -> int:
        """Records one rank trains on per optimizer step."""
        return self.micro_batch_size * self.accumulation_steps

    def is_step_end(self, micro_step: int) -> bool:
        """Whether micro-batch `micro_step` (counted from 0) ends an optimizer step."""
        return (micro_step + 1) % self.accumulation_steps == 0

    @contextlib.contextmanager
    def sync(self, model: Any, micro_step: int) -> Iterator[None]:
        """Run the backward of micro-batch `micro_step` in this: gradients are all-reduced
        only at the end of an optimizer step (`model.no_sync()` before it, where the model
        has it)."""
        if self.is_step_end(micro_step) or not hasattr(model, "no_sync"):
            yield
        else:
            with model.no_sync():
                yield
