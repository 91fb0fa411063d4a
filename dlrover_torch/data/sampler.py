"""ElasticDistributedSampler: a DistributedSampler whose epoch position is saved with the model
and re-split over the ranks that exist after a restart, whatever their number."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

STATE_VERSION = 1


class ElasticDistributedSampler(Sampler[int]):
    """A drop-in for `torch.utils.data.DistributedSampler` that resumes mid-epoch.

    An epoch is one order of the dataset (a permutation of `seed + epoch`, or 0..n-1); its
    position is the number of records at its front that the ranks have trained on. Each pass
    splits the records from the position on over the current ranks (rank r takes every
    `num_replicas`-th from r), so they consume the order front first, and a restore at any
    world size goes on from there: nothing skipped, nothing trained twice but the batches
    taken after the saved position.

    The loop tells the sampler what it trained on: `sampler.advance(len(batch))` after each
    step (the DataLoader's prefetching does not count). With torchdata's StatefulDataLoader,
    leave `advance` out: the loader's own `state_dict()` carries this sampler's position as of
    the last batch it handed out. `state_dict()` is the same on every rank of a DDP job.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "ElasticDistributedSampler needs num_replicas and rank, or an initialized "
                    "process group (call dist.init_process_group first)"
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._start = 0  # the epoch's position when the current pass began
        self._advanced = 0  # records this rank trained on since then (advance)
        self._finished = False  # the current pass ran to its end: the next one starts over

    @property
    def size(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    @property
    def num_samples(self) -> int:
        """Records this rank takes in the pass from the current start (padded unless
        drop_last, as DistributedSampler does)."""
        remaining = self.size - self._start
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    @property
    def total_size(self) -> int:
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; the epoch already current (e.g. just loaded)
        keeps its position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._restart_at(0)

    def advance(self, n: int) -> None:
        """This rank trained on `n` more records of the current pass (call after each step)."""
        if n < 0:
            raise ValueError(f"advance({n}): the number of records must be >= 0")
        self._advanced += n

    def position(self) -> int:
        """Records at the front of the epoch's order that every rank has trained on."""
        return self._position_after(self._advanced)

    def _position_after(self, taken: int) -> int:
        """The epoch position once each rank has taken `taken` records of the pass."""
        if taken >= self.num_samples:
            return self.size
        return min(self.size, self._start + taken * self.num_replicas)

    def _restart_at(self, position: int) -> None:
        self._start = position
        self._advanced = 0
        self._finished = False

    def order(self) -> torch.Tensor:
        """The epoch's order of record indices."""
        if not self.shuffle:
            return torch.arange(self.size)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=g)

    def _rank_indices(self) -> list[int]:
        rest = self.order()[self._start :]
        total = self.total_size
        if len(rest) < total and len(rest) > 0:
            reps = math.ceil(total / len(rest))
            rest = rest.repeat(reps)
        rest = rest[:total]
        return rest[self.rank : total : self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        # A pass that ran to its end (handed out every record) is followed by a new one from
        # the front; otherwise the pass goes on from what was trained (an epoch loaded at its
        # end yields nothing, once).
        self._restart_at(0 if self._finished else self.position())
        return _Pass(self)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and its position, with what they are valid for (plain ints: fits
        torch.save and flash checkpoint alike)."""
        return self._state(self.position())

    def _state(self, position: int) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": position,
            "dataset_size": self.size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a saved position (saved at any world size)."""
        _check_state(self, state)
        self.epoch = int(state["epoch"])
        self._restart_at(int(state["position"]))


class _Pass(Iterator[int]):
    """One pass over a rank's records. Its own state (what it handed out) is what torchdata's
    StatefulDataLoader snapshots with each batch, so the loader resumes after its last batch."""

    def __init__(self, sampler: ElasticDistributedSampler) -> None:
        self._sampler = sampler
        self._indices = sampler._rank_indices()
        self._next = 0

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> int:
        if self._next >= len(self._indices):
            self._sampler._finished = True
            raise StopIteration
        index = self._indices[self._next]
        self._next += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        return self._sampler._state(self._sampler._position_after(self._next))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sampler.load_state_dict(state)
        self._indices = self._sampler._rank_indices()
        self._next = 0


def _check_state(sampler: ElasticDistributedSampler, state: dict[str, Any]) -> None:
    """A saved position means something only over the same records in the same order."""
    if not isinstance(state, dict) or "position" not in state or "epoch" not in state:
        raise ValueError(
            "not an ElasticDistributedSampler state (expected the dict its state_dict() "
            f"returns, got {type(state).__name__})"
        )
    mine = {"dataset_size": sampler.size, "seed": sampler.seed, "shuffle": sampler.shuffle}
    differ = [
        f"{k}={state.get(k)!r} (this sampler: {v!r})" for k, v in mine.items() if state.get(k) != v
    ]
    if differ:
        raise ValueError(
            "the sampler state was saved for a different epoch order: "
            + ", ".join(differ)
            + ". Its position would pick other records. Build the sampler with the dataset, "
            "seed and shuffle it was saved with, or start the epoch over (do not load the "
            "sampler state)."
        )
    position = state["position"]
    if not isinstance(position, int) or not 0 <= position <= sampler.size:
        raise ValueError(f"the saved position {position!r} is outside [0, {sampler.size}]")
