"""Shard sizes paced to each holder: a fast trainer gets shards that last it several seconds.

A dataset whose spec leaves `records_per_shard` at 0 starts every holder on the base shard
(batch_size * 16 records) to twice that. Once a holder has finished a shard, its next one is
sized to about TARGET_SHARD_SECONDS of its own measured pace, from the base to MAX_GROWTH times
it, and never more than an even share of half of what is left to hand out, so the last shards
of a job stay small and no trainer idles while another finishes a big one. Fewer, larger asks
cut the master's per-worker cost; what a failure redoes does not grow, since progress inside a
shard is counted per batch.

Workers started together at the same pace must not all finish their shards, and ask for the
next, in the same instant: every size is jittered per grant (the first, which every worker
asks for at once, upwards only, so a dataset no larger than the base is still one shard; the
others by up to JITTER either way) and counted in whole batches. In whole bases, the shards of
workers stepping alike would all end on one grid (every 1.6 s at 10 steps/s), a thousand
workers asking in bursts of hundreds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TARGET_SHARD_SECONDS = 6.0
MAX_GROWTH = 16
JITTER = 0.25
# Open grants remembered per holder; a holder rarely holds more than two (one prefetched).
_MAX_OPEN = 4


@dataclass
class _Holder:
    # shard id -> (records, granted at)
    open: dict[int, tuple[int, float]] = field(default_factory=dict)
    last_done: float = 0.0  # when its last shard was finished
    pace: float = 0.0  # records per second over its last finished shard (0: not measured)


class ShardPacer:
    """Measures each holder's pace from its grants and completions; sizes its next shard.

    Not thread-safe: the owner serializes calls (the dataset's lock).
    """

    def __init__(
        self,
        base: int,
        clock: Callable[[], float] = time.monotonic,
        jitter: float = JITTER,
        rng: random.Random | None = None,
        granule: int | None = None,
    ) -> None:
        self.base = base
        self.granule = granule or base  # every size is a multiple of it (a batch)
        self._clock = clock
        self._jitter = jitter
        self._rng = rng or random.Random()
        self._holders: dict[int, _Holder] = {}

    def records_for(self, holder: int, records_left: int, holders: int) -> int:
        """Records for `holder`'s next shard, given what is left to hand out and how many
        holders share it."""
        state = self._holders.get(holder)
        if state is None or state.pace <= 0:
            # Every worker asks for its first shard at once: spread their ends twice as wide,
            # upwards only, so that a dataset no larger than the base is still one shard.
            paced = self.base * (1 + self._rng.uniform(0, 4 * self._jitter))
        else:
            paced = max(state.pace * TARGET_SHARD_SECONDS, self.base)
            paced *= 1 + self._rng.uniform(-self._jitter, self._jitter)
        paced = min(paced, MAX_GROWTH * self.base)
        fair = records_left // (2 * max(1, holders))
        wanted = int(min(paced, max(fair, self.base)))
        return max(self.granule, wanted // self.granule * self.granule)

    def granted(self, holder: int, shard_id: int, records: int) -> None:
        state = self._holders.setdefault(holder, _Holder())
        if len(state.open) >= _MAX_OPEN:  # grants lost to a rollback or a release
            state.open.pop(next(iter(state.open)))
        state.open[shard_id] = (records, self._clock())

    def finished(self, holder: int, shard_id: int) -> None:
        """The holder consumed the whole shard: its pace is that shard's records over the time
        since it could start on it (its grant, or the end of its previous shard if later)."""
        state = self._holders.get(holder)
        if state is None or shard_id not in state.open:
            return
        records, granted_at = state.open.pop(shard_id)
        now = self._clock()
        started = max(granted_at, state.last_done)
        if now > started:
            state.pace = records / (now - started)
        state.last_done = now

    def forget(self, holder: int) -> None:
        """The holder gave its shards back or ended: measure it afresh if it asks again."""
        self._holders.pop(holder, None)
