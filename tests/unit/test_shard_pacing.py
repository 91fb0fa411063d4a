"""Shard sizes follow each holder's pace: fast trainers ask rarely, the last shards stay small."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from pathlib import Path

import numpy as np

from master.sharding.ledger import DatasetSpec
from master.sharding.pacing import JITTER, MAX_GROWTH, TARGET_SHARD_SECONDS, ShardPacer
from master.sharding.service import ShardingService, ShardStatus
from master.state.sqlite import SQLiteStateStore

BASE = 1024
PLENTY = 10**9


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_holder_gets_the_base_shard_until_its_pace_is_known() -> None:
    pacer = ShardPacer(BASE, Clock(), jitter=0)
    assert pacer.records_for(7, PLENTY, 1) == BASE
    pacer.granted(7, 0, BASE)
    assert pacer.records_for(7, PLENTY, 1) == BASE  # granted, not finished yet


def test_the_next_shard_lasts_about_the_target_time_at_the_holder_pace() -> None:
    clock = Clock()
    pacer = ShardPacer(BASE, clock, jitter=0)
    pacer.granted(7, 0, BASE)
    clock.now += 1.6  # 640 records/s: a 10 steps/s trainer with batches of 64
    pacer.finished(7, 0)
    expected = int(640 * TARGET_SHARD_SECONDS // BASE) * BASE
    assert BASE < expected <= 640 * TARGET_SHARD_SECONDS
    assert pacer.records_for(7, PLENTY, 1) == expected
    # A very fast holder is capped; a slow one stays at the base.
    pacer.granted(8, 1, BASE)
    clock.now += 0.001
    pacer.finished(8, 1)
    assert pacer.records_for(8, PLENTY, 1) == MAX_GROWTH * BASE
    pacer.granted(9, 2, BASE)
    clock.now += 60.0
    pacer.finished(9, 2)
    assert pacer.records_for(9, PLENTY, 1) == BASE


def test_a_prefetched_shard_is_timed_from_the_end_of_the_one_before() -> None:
    """A trainer that asks one step ahead holds two shards: its pace is not halved by that."""
    clock = Clock()
    pacer = ShardPacer(BASE, clock, jitter=0)
    pacer.granted(7, 0, BASE)
    clock.now += 2.0
    pacer.granted(7, 1, BASE)  # prefetched a step before shard 0 ends
    clock.now += 0.1
    pacer.finished(7, 0)
    clock.now += 1.0
    pacer.finished(7, 1)  # 1,024 records in the 1.0 s since shard 0 ended
    assert pacer.records_for(7, PLENTY, 1) == int(BASE * TARGET_SHARD_SECONDS // BASE) * BASE


def test_near_the_end_no_holder_gets_more_than_an_even_share_of_half_of_what_is_left() -> None:
    clock = Clock()
    pacer = ShardPacer(BASE, clock, jitter=0)
    pacer.granted(7, 0, BASE)
    clock.now += 0.001
    pacer.finished(7, 0)
    assert pacer.records_for(7, 40 * BASE, 4) == 5 * BASE  # 40 left, 4 holders: 40 / 8
    assert pacer.records_for(7, 3 * BASE, 4) == BASE  # never below the base
    pacer.forget(7)  # it gave its shards back: measured afresh
    assert pacer.records_for(7, PLENTY, 1) == BASE


def _drain(svc: ShardingService, name: str, holders: list[int]) -> list[tuple[int, int, int]]:
    """Every holder in turn takes a shard and trains it at once, until the data ends."""
    got = []
    while True:
        ended = 0
        for h in holders:
            grant = svc.get_shard(name, h)
            if grant.status != ShardStatus.SHARD:
                ended += 1
                continue
            s = grant.shard
            got.append((s.epoch, s.start, s.end))
            assert len(grant.indices) == s.size
            svc.report(name, h, [(s.shard_id, s.size)])
        if ended == len(holders):
            return got


def test_the_service_grows_shards_for_fast_holders_and_still_hands_every_record_once(
    tmp_path: Path,
) -> None:
    svc = ShardingService(SQLiteStateStore(str(tmp_path / "state.sqlite")), flush_seconds=3600)
    spec = DatasetSpec("paced", size=1_000_000, batch_size=64, epochs=2, shuffle=True, seed=3)
    svc.create(spec)
    shards = _drain(svc, "paced", [1, 2])
    sizes = [end - start for _, start, end in shards]
    assert max(sizes) > BASE  # instant training: shards grew
    assert max(sizes) <= MAX_GROWTH * BASE
    assert sizes[-1] <= BASE  # the last ones are small again
    for epoch in (0, 1):  # every position of every epoch exactly once
        covered = np.zeros(spec.size, dtype=np.int64)
        for e, start, end in shards:
            if e == epoch:
                covered[start:end] += 1
        assert (covered == 1).all()
    stats = svc.stats()[0]
    assert stats.finished and stats.records_done == 2 * spec.size
    svc.close()


def test_a_fixed_records_per_shard_is_kept(tmp_path: Path) -> None:
    svc = ShardingService(SQLiteStateStore(str(tmp_path / "state.sqlite")), flush_seconds=3600)
    svc.create(DatasetSpec("fixed", size=100_000, batch_size=64, records_per_shard=BASE))
    sizes = {end - start for _, start, end in _drain(svc, "fixed", [1, 2])}
    assert sizes == {BASE, 100_000 % BASE}
    svc.close()


def test_the_target_is_jittered_so_workers_started_together_do_not_ask_together() -> None:
    clock = Clock()
    pacer = ShardPacer(BASE, clock, rng=random.Random(5))
    pacer.granted(7, 0, BASE)
    clock.now += 1.6  # 640 records/s: 3,840 records in 6 s
    pacer.finished(7, 0)
    sizes = [pacer.records_for(7, PLENTY, 1) for _ in range(200)]
    low = int(640 * TARGET_SHARD_SECONDS * (1 - JITTER) // BASE) * BASE
    high = int(640 * TARGET_SHARD_SECONDS * (1 + JITTER) // BASE) * BASE
    assert set(sizes) <= set(range(low, high + 1, BASE))
    assert len(set(sizes)) >= 2  # not one size for every grant


def _ask_times(granule: int, holders: int = 1000, seconds: float = 40.0) -> list[float]:
    """When holders that start together and train at one pace (640 records/s: 10 steps/s of
    64) ask for their next shard, on a simulated clock."""
    clock = Clock()
    start = clock.now
    pacer = ShardPacer(BASE, clock, rng=random.Random(11), granule=granule)
    ends: list[tuple[float, int, int]] = []  # (when its shard ends, holder, shard id)
    shard_ids = iter(range(10**9))
    for h in range(holders):
        sid = next(shard_ids)
        records = pacer.records_for(h, PLENTY, holders)
        pacer.granted(h, sid, records)
        heapq.heappush(ends, (start + records / 640, h, sid))
    asks = []
    while ends[0][0] < start + seconds:
        clock.now, h, sid = heapq.heappop(ends)
        asks.append(clock.now - start)
        pacer.finished(h, sid)
        nxt = next(shard_ids)
        records = pacer.records_for(h, PLENTY, holders)
        pacer.granted(h, nxt, records)
        heapq.heappush(ends, (clock.now + records / 640, h, nxt))
    return asks


def _busiest_tenth_of_a_second(times: list[float]) -> int:
    return max(Counter(int(t * 10) for t in times).values())


def test_workers_stepping_alike_do_not_ask_in_bursts() -> None:
    """Sized in whole bases, every shard of a 10 steps/s worker lasts a multiple of 1.6 s: a
    thousand such workers started together ask in bursts of hundreds within 0.1 s, for ever
    (the master then takes those calls up seconds late). Sized in whole batches, and the
    first shard jittered too, the asks spread out."""
    first_round_ends = 3.0
    on_the_grid = _ask_times(granule=BASE)
    assert _busiest_tenth_of_a_second([t for t in on_the_grid if t < first_round_ends]) == 1000
    assert _busiest_tenth_of_a_second([t for t in on_the_grid if t > first_round_ends]) > 250
    spread = _ask_times(granule=64)
    assert _busiest_tenth_of_a_second([t for t in spread if t < first_round_ends]) < 150
    later = [t for t in spread if t > first_round_ends]
    assert len(later) > 5000
    assert _busiest_tenth_of_a_second(later) < 80  # 17 a tenth on average


def test_sizes_are_whole_batches_spread_over_the_jitter() -> None:
    clock = Clock()
    pacer = ShardPacer(BASE, clock, rng=random.Random(5), granule=64)
    first = [pacer.records_for(7, PLENTY, 1) for _ in range(200)]
    assert all(s % 64 == 0 for s in first)
    # Pace unknown: every worker asks at once, so the first sizes are spread twice as wide,
    # upwards only (a dataset no larger than the base stays one shard).
    assert min(first) >= BASE and max(first) <= 2 * BASE
    assert min(first) < BASE * (1 + JITTER) and max(first) > BASE * (1 + 3 * JITTER)
    tiny = ShardPacer(100, clock, rng=random.Random(5), granule=10)  # a 100-record dataset
    assert {tiny.records_for(8, 100, 2) for _ in range(50)} == {100}  # one shard, as ever
    pacer.granted(7, 0, BASE)
    clock.now += 1.6  # 640 records/s: 3,840 records in 6 s
    pacer.finished(7, 0)
    sizes = [pacer.records_for(7, PLENTY, 1) for _ in range(200)]
    assert all(s % 64 == 0 for s in sizes)
    assert len(set(sizes)) > 20  # 2,880 to 4,800 records, not three sizes
    assert 3840 * (1 - JITTER) - 64 <= min(sizes) and max(sizes) <= 3840 * (1 + JITTER)
    assert pacer.records_for(7, 3 * BASE, 4) <= BASE * (1 + JITTER)  # small near the end
