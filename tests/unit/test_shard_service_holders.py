"""Shard asks of a node incarnation that ended: never granted, even while still waiting."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from master.sharding.ledger import DatasetSpec
from master.sharding.service import ShardingService, ShardStatus
from master.state.sqlite import SQLiteStateStore

# Two shards, one epoch: once both are held, a further ask waits for one to come back.
SPEC = DatasetSpec("ds", size=200, batch_size=10, records_per_shard=100)


def test_an_ask_a_node_sent_before_it_died_does_not_take_its_requeued_shard(
    tmp_path: Path,
) -> None:
    svc = ShardingService(SQLiteStateStore(str(tmp_path / "state.sqlite")), flush_seconds=3600)
    svc.create(SPEC)
    dying = svc.get_shard("ds", holder=4).shard
    assert svc.get_shard("ds", holder=3).status == ShardStatus.SHARD
    svc.report("ds", 4, [(dying.shard_id, 30)])
    # Its input pipeline asked for the next shard just before it was killed: the ask waits.
    answers = []
    ask = threading.Thread(
        target=lambda: answers.append(svc.get_shard("ds", holder=4, wait_seconds=10.0))
    )
    ask.start()
    deadline = time.monotonic() + 10.0
    while not svc._datasets["ds"].cond._waiters:  # until the ask waits on the ledger
        assert ask.is_alive() and time.monotonic() < deadline, answers
        ask.join(0.01)
    assert svc.retire(4) == {"ds": 70}  # the node's end: its remainder goes back
    ask.join(10.0)
    assert not ask.is_alive()
    assert [a.status for a in answers] == [ShardStatus.PENDING]
    # The remainder is there for the living (it was handed to the dead node before the fix,
    # and the job waited for ever for a shard no process would train).
    regrant = svc.get_shard("ds", holder=3)
    assert regrant.status == ShardStatus.SHARD and regrant.shard.size == 70
    assert svc.get_shard("ds", holder=4).status == ShardStatus.PENDING
    svc.close()


def test_shards_kept_for_a_late_holder_go_to_it_alone_until_given_back(tmp_path: Path) -> None:
    svc = ShardingService(SQLiteStateStore(str(tmp_path / "state.sqlite")), flush_seconds=3600)
    svc.create(SPEC)
    svc.create(DatasetSpec("eval", size=100, batch_size=10, records_per_shard=100))
    first = svc.get_shard("ds", holder=3)
    assert first.status == ShardStatus.SHARD
    assert svc.datasets_held_by([3]) == {"ds"} and svc.datasets_held_by([7]) == set()
    svc.keep_work_for(7, {"ds"})
    # Holder 3 waits, however long it asks for, while holder 7 has not taken its work.
    assert svc.get_shard("ds", holder=3, wait_seconds=0.2).status == ShardStatus.PENDING
    assert svc.get_shard("eval", holder=3).status == ShardStatus.SHARD  # not a kept dataset
    answers = []
    ask = threading.Thread(
        target=lambda: answers.append(svc.get_shard("ds", holder=3, wait_seconds=10.0))
    )
    ask.start()
    kept = svc.get_shard("ds", holder=7)
    assert kept.status == ShardStatus.SHARD and kept.shard.size == 100
    svc.report("ds", 7, [(kept.shard.shard_id, 10)])
    svc.keep_work_for(None)  # e.g. the fault fired: 7 is killed, its remainder requeued
    assert svc.retire(7) == {"ds": 90}
    ask.join(10.0)
    assert not ask.is_alive()
    assert answers[0].status == ShardStatus.SHARD and answers[0].shard.size == 90
    svc.close()
