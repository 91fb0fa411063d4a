"""ShardFeeder (the coordinator's bookkeeping of dlrover_tf.keras_ps) against a live master."""

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from dlrover_tf.dataset import ShardedDataset  # noqa: E402
from dlrover_tf.keras_ps import ShardFeeder  # noqa: E402


def _done(harness) -> int:
    return harness.job.sharding.stats()[0].records_done


def test_out_of_order_results_are_reported_as_a_prefix_and_retried_batches_come_first(harness):
    ds = ShardedDataset(
        "k", size=100, batch_size=10, records_per_shard=50, client=harness.client(0)
    )
    feeder = ShardFeeder(ds)
    batches = [feeder.next_batch() for _ in range(5)]  # the first shard, cut in five
    assert [len(b.indices) for b in batches] == [10] * 5
    assert {s for b in batches for s, _, _ in b.segments} == {batches[0].segments[0][0]}

    feeder.done(batches[1])
    feeder.done(batches[2])
    feeder.flush()
    assert _done(harness) == 0  # batch 0 is still out: nothing after it counts yet
    feeder.done(batches[0])
    feeder.flush()
    assert _done(harness) == 30

    # Batch 3's step died with its worker: it is handed out again before anything new.
    feeder.again(batches[3])
    again = feeder.next_batch()
    assert again is batches[3]
    feeder.done(batches[4])
    feeder.done(again)
    feeder.flush()
    assert _done(harness) == 50

    rest = []
    while (b := feeder.next_batch(wait_ms=100)) is not None:
        rest.append(b)
        feeder.done(b)
    feeder.flush()
    assert feeder.ended and _done(harness) == 100
    trained = np.concatenate([b.indices for b in batches + rest])
    assert sorted(trained.tolist()) == list(range(100))


def test_a_new_feeder_gives_back_what_an_earlier_one_held(harness):
    ds = ShardedDataset(
        "k2", size=40, batch_size=10, records_per_shard=20, client=harness.client(1)
    )
    first = ShardFeeder(ds)
    held = first.next_batch()
    first.done(held)
    first.flush()
    second = ShardFeeder(ds)  # a restarted coordinator: the unconsumed 10 go back to the queue
    seen = []
    while (b := second.next_batch(wait_ms=100)) is not None:
        seen.extend(b.indices.tolist())
        second.done(b)
    second.flush()
    assert sorted(seen + held.indices.tolist()) == list(range(40))
    assert _done(harness) == 40
