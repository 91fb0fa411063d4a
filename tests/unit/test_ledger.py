"""Tests for the shard ledger: plain scenarios and a simulated elastic job driven by hypothesis."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from master.sharding.ledger import (
    BadReportError,
    DatasetLedger,
    DatasetSpec,
    LedgerError,
    Shard,
    StaleShardError,
)


def spec(**kwargs) -> DatasetSpec:
    values = {"name": "ds", "size": 10, "batch_size": 2, "records_per_shard": 4}
    values.update(kwargs)
    return DatasetSpec(**values)


def json_roundtrip(data: dict) -> dict:
    return json.loads(json.dumps(data))


def drain(ledger: DatasetLedger, holder: int = 1) -> list[Shard]:
    """Take and fully consume every remaining shard; return them in order."""
    shards = []
    while (shard := ledger.next_shard(holder)) is not None:
        assert ledger.report(holder, shard.shard_id, shard.size)
        shards.append(shard)
    return shards


def assert_conserved(ledger: DatasetLedger) -> None:
    total = ledger.spec.size * ledger.spec.epochs
    assert ledger.records_done + ledger.records_doing() + ledger.records_todo() == total
    assert sum(ledger.done_per_epoch().values()) == ledger.records_done


# DatasetSpec


def test_spec_shard_records_defaults_and_caps() -> None:
    assert spec(records_per_shard=0, batch_size=3, size=1000).shard_records() == 48
    assert spec(records_per_shard=0, batch_size=3, size=20).shard_records() == 20
    assert spec(records_per_shard=7).shard_records() == 7
    assert spec(records_per_shard=500, size=10).shard_records() == 10


@pytest.mark.parametrize(
    "field_name,value,fix",
    [
        ("name", "", "name"),
        ("name", "x" * 129, "shorter"),
        ("name", "bad\nname", "control"),
        ("size", 0, "number of records"),
        ("size", 2**40 + 1, "number of records"),
        ("size", 3.5, "number of records"),
        ("batch_size", 0, "batch size"),
        ("records_per_shard", -1, "use 0 for the default"),
        ("epochs", 0, "epochs"),
        ("epochs", 10_001, "epochs"),
        ("shuffle", "yes", "boolean"),
        ("seed", 2**64, "seed"),
    ],
)
def test_spec_validation_names_field_value_and_fix(field_name: str, value, fix: str) -> None:
    bad = spec(**{field_name: value})
    with pytest.raises(ValueError) as info:
        bad.validate()
    message = str(info.value)
    assert f"'{field_name}'" in message
    assert repr(value) in message
    assert fix in message
    with pytest.raises(ValueError):
        DatasetLedger(bad)


def test_spec_validation_accepts_limits() -> None:
    spec(size=2**40, epochs=10_000, name="n" * 128, seed=-(2**63)).validate()
    spec(size=1, batch_size=1, records_per_shard=0, epochs=1).validate()


# Handing out shards


def test_shards_follow_epochs_in_order() -> None:
    ledger = DatasetLedger(spec(epochs=2))
    assert ledger.epoch == -1
    assert ledger.records_todo() == 20
    shards = drain(ledger)
    assert [(s.epoch, s.start, s.end) for s in shards] == [
        (0, 0, 4),
        (0, 4, 8),
        (0, 8, 10),
        (1, 0, 4),
        (1, 4, 8),
        (1, 8, 10),
    ]
    assert [s.shard_id for s in shards] == list(range(6))
    assert ledger.epoch == 1
    assert ledger.finished and ledger.exhausted
    assert ledger.records_done == 20
    assert ledger.records_redone == 0
    assert ledger.done_per_epoch() == {0: 10, 1: 10}
    assert ledger.next_shard(1) is None


def test_next_epoch_is_created_lazily_while_previous_shards_are_held() -> None:
    ledger = DatasetLedger(spec(size=4, epochs=2))
    first = ledger.next_shard(1)
    assert ledger.epoch == 0 and not ledger.exhausted
    second = ledger.next_shard(2)
    assert (second.epoch, ledger.epoch) == (1, 1)
    assert ledger.exhausted and not ledger.finished
    assert ledger.next_shard(3) is None
    assert ledger.report(1, first.shard_id, 4)
    assert not ledger.finished
    assert ledger.report(2, second.shard_id, 4)
    assert ledger.finished


def test_unshuffled_record_indices_are_positions() -> None:
    ledger = DatasetLedger(spec())
    shard = ledger.next_shard(1)
    indices = ledger.record_indices(shard)
    assert indices.dtype == np.int64
    assert indices.tolist() == [0, 1, 2, 3]


def test_shuffle_covers_every_index_once_per_epoch() -> None:
    size = 1000
    ledger = DatasetLedger(spec(size=size, records_per_shard=64, epochs=3, shuffle=True, seed=5))
    per_epoch: dict[int, list[int]] = {}
    for shard in drain(ledger):
        per_epoch.setdefault(shard.epoch, []).extend(ledger.record_indices(shard).tolist())
    assert sorted(per_epoch) == [0, 1, 2]
    for order in per_epoch.values():
        assert sorted(order) == list(range(size))
        assert order != list(range(size))
    assert len({tuple(order) for order in per_epoch.values()}) == 3


def test_shuffle_remainder_shard_keeps_the_original_indices() -> None:
    ledger = DatasetLedger(spec(size=100, records_per_shard=10, shuffle=True, seed=1))
    shard = ledger.next_shard(1)
    indices = ledger.record_indices(shard).tolist()
    ledger.report(1, shard.shard_id, 3)
    ledger.release(1)
    again = ledger.next_shard(2)
    assert ledger.record_indices(again).tolist() == indices[3:]


def test_record_indices_rejects_foreign_shard() -> None:
    ledger = DatasetLedger(spec())
    with pytest.raises(LedgerError):
        ledger.record_indices(Shard(0, 0, 5, 11))
    with pytest.raises(LedgerError):
        ledger.record_indices(Shard(0, 1, 0, 4))


# Reports


def test_reports_are_cumulative_and_monotone() -> None:
    ledger = DatasetLedger(spec())
    shard = ledger.next_shard(7)
    assert not ledger.report(7, shard.shard_id, 2)
    assert ledger.records_done == 2
    assert not ledger.report(7, shard.shard_id, 1)  # late report: ignored
    assert not ledger.report(7, shard.shard_id, 2)  # repeated report: ignored
    assert ledger.records_done == 2
    assert ledger.records_doing() == 2
    assert ledger.report(7, shard.shard_id, 4)
    assert ledger.records_done == 4
    assert ledger.holders() == set()
    with pytest.raises(StaleShardError):
        ledger.report(7, shard.shard_id, 4)  # done shards are no longer held


@pytest.mark.parametrize("consumed", [-1, 5, 2.0, True, None])
def test_malformed_reports_raise(consumed) -> None:
    ledger = DatasetLedger(spec())
    shard = ledger.next_shard(1)
    with pytest.raises(BadReportError):
        ledger.report(1, shard.shard_id, consumed)
    assert ledger.records_done == 0


def test_reports_from_non_holders_are_stale() -> None:
    ledger = DatasetLedger(spec())
    shard = ledger.next_shard(1)
    with pytest.raises(StaleShardError):
        ledger.report(2, shard.shard_id, 1)
    with pytest.raises(StaleShardError):
        ledger.report(1, 99, 1)
    assert issubclass(StaleShardError, LedgerError)
    assert issubclass(BadReportError, LedgerError)


# Release


def test_release_requeues_the_unconsumed_remainder_at_the_front() -> None:
    ledger = DatasetLedger(spec(size=20))
    held = ledger.next_shard(1)  # [0, 4)
    other = ledger.next_shard(2)  # [4, 8)
    ledger.report(1, held.shard_id, 3)
    assert ledger.release(1) == 1
    assert ledger.records_redone == 0  # counted when handed out again
    assert ledger.holders() == {2}
    with pytest.raises(StaleShardError):
        ledger.report(1, held.shard_id, 4)
    again = ledger.next_shard(1)
    assert (again.epoch, again.start, again.end) == (0, 3, 4)
    assert again.shard_id not in (held.shard_id, other.shard_id)
    assert ledger.records_redone == 1
    assert ledger.records_done == 3
    fresh = ledger.next_shard(3)
    assert (fresh.start, fresh.end) == (8, 12)
    assert_conserved(ledger)


def test_release_of_several_shards_keeps_them_oldest_first() -> None:
    ledger = DatasetLedger(spec(size=20, epochs=2))
    mine = [ledger.next_shard(1) for _ in range(3)]
    ledger.report(1, mine[1].shard_id, 2)
    assert ledger.held_by(1) == mine
    assert ledger.release(1) == 4 + 2 + 4
    assert ledger.held_by(1) == []
    again = [ledger.next_shard(2) for _ in range(4)]
    assert [(s.start, s.end) for s in again] == [(0, 4), (6, 8), (8, 12), (12, 16)]
    assert ledger.records_redone == 10


def test_release_of_unknown_holder_is_a_noop() -> None:
    ledger = DatasetLedger(spec())
    assert ledger.release(5) == 0
    ledger.next_shard(1)
    assert ledger.release(5) == 0
    assert ledger.holders() == {1}


def test_release_after_full_consumption_requeues_nothing() -> None:
    ledger = DatasetLedger(spec(epochs=1))
    shards = [ledger.next_shard(1) for _ in range(3)]
    for s in shards:
        ledger.report(1, s.shard_id, s.size)
    assert ledger.release(1) == 0
    assert ledger.finished


def test_holder_must_be_an_int() -> None:
    with pytest.raises(TypeError):
        DatasetLedger(spec()).next_shard("worker-1")  # type: ignore[arg-type]


# Snapshots


def busy_ledger() -> DatasetLedger:
    ledger = DatasetLedger(spec(size=30, epochs=3, shuffle=True, seed=3))
    for _ in range(8):
        ledger.next_shard(1)
    for s in ledger.held_by(1)[:5]:
        ledger.report(1, s.shard_id, s.size)
    a = ledger.next_shard(2)
    ledger.report(2, a.shard_id, 1)
    b = ledger.next_shard(3)
    ledger.report(3, b.shard_id, 3)
    ledger.release(3)
    ledger.next_shard(4)
    return ledger


def test_snapshot_round_trip_through_json_keeps_everything() -> None:
    ledger = busy_ledger()
    data = json_roundtrip(ledger.snapshot())
    copy = DatasetLedger.from_snapshot(data, requeue_doing=False)
    assert copy.snapshot() == ledger.snapshot()
    assert copy.spec == ledger.spec
    assert copy.holders() == ledger.holders()
    for holder in ledger.holders():
        assert copy.held_by(holder) == ledger.held_by(holder)
    assert copy.epoch == ledger.epoch
    assert copy.records_done == ledger.records_done
    assert copy.records_redone == ledger.records_redone
    assert copy.records_todo() == ledger.records_todo()
    assert copy.records_doing() == ledger.records_doing()
    assert copy.done_per_epoch() == ledger.done_per_epoch()
    # Both continue identically.
    for holder in sorted(ledger.holders()):
        for s in ledger.held_by(holder):
            assert ledger.report(holder, s.shard_id, s.size)
            assert copy.report(holder, s.shard_id, s.size)
    assert drain(copy) == drain(ledger)
    assert copy.finished and copy.records_done == 90


def test_snapshot_before_first_shard() -> None:
    ledger = DatasetLedger(spec())
    copy = DatasetLedger.from_snapshot(json_roundtrip(ledger.snapshot()), requeue_doing=True)
    assert copy.epoch == -1
    assert drain(copy) == drain(ledger)


def test_restore_with_requeue_gives_held_remainders_back() -> None:
    ledger = busy_ledger()
    held = {h: [(s, ledger_consumed(ledger, h, s)) for s in ledger.held_by(h)] for h in (1, 2, 4)}
    data = json_roundtrip(ledger.snapshot())
    restored = DatasetLedger.from_snapshot(data, requeue_doing=True)
    assert restored.holders() == set()
    assert restored.records_doing() == 0
    assert restored.records_done == ledger.records_done
    assert_conserved(restored)
    with pytest.raises(StaleShardError):
        restored.report(2, held[2][0][0].shard_id, 2)
    remainders = sorted(
        (
            (s.shard_id, s.epoch, s.start + done, s.end)
            for pairs in held.values()
            for s, done in pairs
        ),
    )
    again = [restored.next_shard(9) for _ in remainders]
    assert [(s.epoch, s.start, s.end) for s in again] == [r[1:] for r in remainders]
    assert min(s.shard_id for s in again) >= data["next_shard_id"]


def test_restore_does_not_reissue_ids_of_the_live_ledger() -> None:
    ledger = DatasetLedger(spec(size=40))
    saved = json_roundtrip(ledger.snapshot())
    old = [ledger.next_shard(1) for _ in range(3)]
    restored = DatasetLedger.from_snapshot(
        saved, requeue_doing=True, first_shard_id=ledger.next_shard_id
    )
    fresh = restored.next_shard(1)
    assert (fresh.shard_id, fresh.start) == (3, 0)
    for shard in old:
        with pytest.raises(StaleShardError):
            restored.report(1, shard.shard_id, 1)
    with pytest.raises(ValueError):
        DatasetLedger.from_snapshot(saved, requeue_doing=True, first_shard_id=-1)


def ledger_consumed(ledger: DatasetLedger, holder: int, shard: Shard) -> int:
    return ledger.consumed(holder, shard.shard_id)


def _mutations() -> list[tuple[str, object]]:
    def set_key(path, value):
        def apply(d):
            target = d
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value

        return apply

    def drop(key):
        return lambda d: d.pop(key)

    def dup_doing(d):
        d["doing"].append(dict(d["doing"][0]))

    def dup_todo(d):
        d["todo"].append(dict(d["todo"][0]))

    return [
        ("not a dict", lambda d: None),
        ("format", set_key(["format"], 99)),
        ("missing todo", drop("todo")),
        ("missing spec", drop("spec")),
        ("bad spec", set_key(["spec", "size"], 0)),
        ("unknown spec field", set_key(["spec", "colour"], "red")),
        ("epoch too high", set_key(["epoch"], 7)),
        ("negative done", set_key(["records_done"], -1)),
        ("done mismatch", set_key(["records_done"], 1)),
        ("done per epoch mismatch", set_key(["done_per_epoch", "0"], 0)),
        ("done per epoch bad key", set_key(["done_per_epoch", "x"], 0)),
        ("todo not a list", set_key(["todo"], {})),
        ("todo range empty", set_key(["todo", 0, "end"], 0)),
        ("todo range past size", set_key(["todo", 0, "end"], 31)),
        ("todo redo not bool", set_key(["todo", 0, "redo"], "no")),
        ("duplicate todo", dup_todo),
        ("duplicate doing", dup_doing),
        ("doing consumed full", set_key(["doing", 0, "consumed"], 10)),
        ("doing consumed float", set_key(["doing", 0, "consumed"], 1.0)),
        ("doing holder", set_key(["doing", 0, "holder"], "w1")),
        ("doing id beyond next", set_key(["doing", 0, "shard_id"], 10**6)),
        ("doing item not dict", set_key(["doing", 0], [1, 2])),
    ]


@pytest.mark.parametrize("name,mutate", _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_snapshots_raise_ledger_error(name: str, mutate) -> None:
    data = json_roundtrip(busy_ledger().snapshot())
    assert data["todo"] and data["doing"]
    if name == "not a dict":
        data = ["not", "a", "dict"]
    else:
        mutate(data)
    with pytest.raises(LedgerError) as info:
        DatasetLedger.from_snapshot(data, requeue_doing=False)
    assert "snapshot" in str(info.value)


def test_snapshot_with_overlapping_ranges_is_rejected() -> None:
    ledger = DatasetLedger(spec())
    ledger.next_shard(1)  # doing [0, 4); todo [4, 10)
    data = json_roundtrip(ledger.snapshot())
    DatasetLedger.from_snapshot(data, requeue_doing=False)
    data["doing"][0].update(start=4, end=8)  # same totals, but positions 4..7 twice, 0..3 lost
    with pytest.raises(LedgerError, match="overlap"):
        DatasetLedger.from_snapshot(data, requeue_doing=False)


# Simulated elastic job


@dataclass
class Held:
    shard: Shard
    indices: list[int]
    consumed: int = 0


@dataclass
class Worker:
    holder: int
    shards: list[Held] = field(default_factory=list)


class Simulation:
    """Workers train batch by batch and report; they die, the master restarts, models restore."""

    def __init__(self, ds: DatasetSpec, n_workers: int) -> None:
        self.spec = ds
        self.ledger = DatasetLedger(ds)
        self._ids = iter(range(1000, 10**9))
        self.workers = [Worker(next(self._ids)) for _ in range(n_workers)]
        # The model's view: how often each (epoch, record) was trained, and which trainings were
        # ambiguous (trained, never reported, then re-queued).
        self.trained: Counter[tuple[int, int]] = Counter()
        self.ambiguous: Counter[tuple[int, int]] = Counter()
        self.ambiguous_deaths = 0
        self.snapshots: list[tuple[dict, Counter, Counter, int]] = []

    # Actions.

    def get(self, w: int) -> bool:
        worker = self.workers[w]
        shard = self.ledger.next_shard(worker.holder)
        if shard is None:
            assert self.ledger.exhausted
            return False
        assert 0 < shard.size <= self.spec.shard_records()
        worker.shards.append(Held(shard, self.ledger.record_indices(shard).tolist()))
        return True

    def _train_batch(self, w: int) -> tuple[Held, list[int]] | None:
        worker = self.workers[w]
        if not worker.shards and not self.get(w):
            return None
        held = worker.shards[0]
        batch = held.indices[held.consumed : held.consumed + self.spec.batch_size]
        assert batch
        for index in batch:
            self.trained[(held.shard.epoch, index)] += 1
        return held, batch

    def batch(self, w: int, resend_old: bool = False) -> None:
        worker = self.workers[w]
        trained = self._train_batch(w)
        if trained is None:
            return
        held, batch = trained
        previous = held.consumed
        held.consumed += len(batch)
        done = self.ledger.report(worker.holder, held.shard.shard_id, held.consumed)
        assert done == (held.consumed == held.shard.size)
        if done:
            worker.shards.pop(0)
            if resend_old:
                with pytest.raises(StaleShardError):
                    self.ledger.report(worker.holder, held.shard.shard_id, previous)
        elif resend_old:
            assert not self.ledger.report(worker.holder, held.shard.shard_id, previous)

    def die(self, w: int, trained_unreported: bool, new_incarnation: bool) -> None:
        worker = self.workers[w]
        if trained_unreported:
            trained = self._train_batch(w)
            if trained is not None:
                held, batch = trained
                for index in batch:
                    self.ambiguous[(held.shard.epoch, index)] += 1
                self.ambiguous_deaths += 1
        expected = sum(h.shard.size - h.consumed for h in worker.shards)
        assert self.ledger.release(worker.holder) == expected
        for held in worker.shards:
            with pytest.raises(StaleShardError):
                self.ledger.report(worker.holder, held.shard.shard_id, held.shard.size)
        worker.shards.clear()
        if new_incarnation:
            worker.holder = next(self._ids)

    def snapshot(self) -> None:
        data = json_roundtrip(self.ledger.snapshot())
        self.snapshots.append(
            (data, self.trained.copy(), self.ambiguous.copy(), self.ambiguous_deaths)
        )

    def restore(self, k: int, keep_node_ids: bool = False) -> None:
        """Restore a model checkpoint and the ledger saved with it; every worker restarts input.

        With keep_node_ids the workers keep their ids, so ids the discarded timeline issued must
        not be reissued: reports for the old shards have to be stale.
        """
        if not self.snapshots:
            return
        data, trained, ambiguous, deaths = self.snapshots[k % len(self.snapshots)]
        first_id = self.ledger.next_shard_id if keep_node_ids else 0
        self.ledger = DatasetLedger.from_snapshot(data, requeue_doing=True, first_shard_id=first_id)
        self.trained, self.ambiguous = trained.copy(), ambiguous.copy()
        self.ambiguous_deaths = deaths
        old = [(worker.holder, held.shard) for worker in self.workers for held in worker.shards]
        for worker in self.workers:
            worker.shards.clear()
            if not keep_node_ids:
                worker.holder = next(self._ids)
        if keep_node_ids:
            for w in range(len(self.workers)):  # new shards, whose ids must not collide with old
                self.get(w)
            for holder, shard in old:
                with pytest.raises(StaleShardError):
                    self.ledger.report(holder, shard.shard_id, shard.size)

    def master_restart(self) -> None:
        data = json_roundtrip(self.ledger.snapshot())
        self.ledger = DatasetLedger.from_snapshot(data, requeue_doing=False)
        assert self.ledger.snapshot() == data

    # Checks.

    def check(self) -> None:
        ledger = self.ledger
        assert_conserved(ledger)
        assert ledger.holders() == {w.holder for w in self.workers if w.shards}
        for worker in self.workers:
            assert ledger.held_by(worker.holder) == [h.shard for h in worker.shards]
        unconsumed = sum(h.shard.size - h.consumed for w in self.workers for h in w.shards)
        assert ledger.records_doing() == unconsumed
        assert sum(self.trained.values()) == ledger.records_done + sum(self.ambiguous.values())

    def run_to_completion(self) -> None:
        for _ in range(10 * self.spec.size * self.spec.epochs + 100):
            if self.ledger.finished:
                return
            for w in range(len(self.workers)):
                self.batch(w)
            self.check()
        raise AssertionError("the job did not finish")

    def check_final(self) -> None:
        ledger, ds = self.ledger, self.spec
        assert ledger.finished and ledger.exhausted
        assert ledger.records_done == ds.size * ds.epochs
        assert ledger.records_todo() == 0 and ledger.records_doing() == 0
        assert ledger.done_per_epoch() == dict.fromkeys(range(ds.epochs), ds.size)
        assert ledger.next_shard(self.workers[0].holder) is None
        # Every record trained exactly once per epoch, plus the ambiguous batches.
        expected = Counter({(e, i): 1 for e in range(ds.epochs) for i in range(ds.size)})
        expected.update(self.ambiguous)
        assert self.trained == expected
        per_record = Counter(i for (_, i), n in self.trained.items() for _ in range(n))
        extras = 0
        for index in range(ds.size):
            assert per_record[index] >= ds.epochs, f"record {index} missing"
            extras += per_record[index] - ds.epochs
        assert extras <= self.ambiguous_deaths * ds.batch_size
        assert ledger.records_redone >= sum(self.ambiguous.values())


workers_st = st.integers(0, 3)
action_st = st.one_of(
    st.tuples(st.just("get"), workers_st),
    st.tuples(st.just("batch"), workers_st, st.booleans()),
    st.tuples(st.just("batch"), workers_st, st.just(False)),
    st.tuples(st.just("batch"), workers_st, st.just(False)),
    st.tuples(st.just("die"), workers_st, st.booleans(), st.booleans()),
    st.tuples(st.just("snapshot")),
    st.tuples(st.just("restore"), st.integers(0, 20), st.booleans()),
    st.tuples(st.just("master_restart")),
)
spec_st = st.builds(
    DatasetSpec,
    name=st.just("sim"),
    size=st.integers(1, 40),
    batch_size=st.integers(1, 6),
    records_per_shard=st.integers(0, 15),
    epochs=st.integers(1, 3),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**20),
)


def simulate(ds: DatasetSpec, n_workers: int, actions: list[tuple]) -> Simulation:
    sim = Simulation(ds, n_workers)
    for action in actions:
        kind, args = action[0], action[1:]
        if kind in ("get", "batch", "die"):
            args = (args[0] % n_workers, *args[1:])
        getattr(sim, kind)(*args)
        sim.check()
    sim.run_to_completion()
    sim.check_final()
    return sim


@settings(max_examples=600, deadline=None)
@given(
    ds=spec_st, n_workers=st.integers(1, 4), actions=st.lists(action_st, min_size=5, max_size=60)
)
def test_property_every_record_trained_once_per_epoch(
    ds: DatasetSpec, n_workers: int, actions: list[tuple]
) -> None:
    simulate(ds, n_workers, actions)


def test_simulation_scenario_with_every_kind_of_failure() -> None:
    ds = spec(size=23, batch_size=3, records_per_shard=7, epochs=2, shuffle=True, seed=9)
    actions = [
        ("get", 0),
        ("get", 1),
        ("batch", 0, False),
        ("batch", 1, True),
        ("snapshot",),
        ("batch", 0, False),
        ("die", 0, True, True),  # trained a batch, died before reporting it
        ("get", 0),
        ("batch", 0, False),
        ("master_restart",),
        ("batch", 1, False),
        ("batch", 1, False),
        ("restore", 0),  # back to the snapshot: the ambiguous batch above is forgotten
        ("get", 2),
        ("get", 2),
        ("batch", 2, False),
        ("die", 2, True, False),
        ("die", 1, False, True),
    ]
    sim = simulate(ds, 3, actions)
    assert sim.ambiguous_deaths == 1
    assert 1 <= sum(sim.ambiguous.values()) <= ds.batch_size
    assert sim.ledger.records_redone > 0


def test_simulation_without_failures_redoes_nothing() -> None:
    ds = spec(size=50, batch_size=4, records_per_shard=9, epochs=3, shuffle=True)
    sim = simulate(ds, 3, [("snapshot",), ("master_restart",)])
    assert sim.ledger.records_redone == 0
    assert not sim.ambiguous


def test_spec_is_frozen() -> None:
    base = spec()
    assert replace(base, epochs=2).epochs == 2
    with pytest.raises(AttributeError):
        base.epochs = 3  # type: ignore[misc]


def test_a_retried_ask_finds_the_shard_its_lost_answer_carried() -> None:
    ledger = DatasetLedger(spec())
    first = ledger.next_shard(1, request_id=41)
    assert ledger.granted(1, 41) == first
    assert ledger.granted(1, 42) is None  # another ask
    assert ledger.granted(2, 41) is None  # another holder
    assert ledger.granted(1, 0) is None  # no id given: never matched
    # A master restarted from the snapshot still knows which ask got the shard.
    restored = DatasetLedger.from_snapshot(json_roundtrip(ledger.snapshot()), requeue_doing=False)
    assert restored.granted(1, 41) == first
    assert restored.records_doing() == first.size
    restored.report(1, first.shard_id, first.size)
    assert restored.granted(1, 41) is None  # finished: a late retry must not get it again


def test_snapshot_with_a_bad_request_id_is_refused() -> None:
    ledger = DatasetLedger(spec())
    ledger.next_shard(1, request_id=3)
    data = json_roundtrip(ledger.snapshot())
    data["doing"][0]["request_id"] = -1
    with pytest.raises(LedgerError, match="request_id=-1"):
        DatasetLedger.from_snapshot(data, requeue_doing=False)
