"""Shard ledger: which record positions of a dataset are todo, doing (held by a node) or done.

Progress is counted in records consumed within a shard, so a dead holder only gives back the
unconsumed remainder of its shards.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from master.shuffle.permutation import record_indices

__all__ = [
    "BadReportError",
    "DatasetLedger",
    "DatasetSpec",
    "LedgerError",
    "Shard",
    "StaleShardError",
]

logger = logging.getLogger(__name__)

MAX_DATASET_SIZE = 2**40
MAX_EPOCHS = 10_000
MAX_NAME_LENGTH = 128
DEFAULT_BATCHES_PER_SHARD = 16
SNAPSHOT_FORMAT = 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class LedgerError(Exception):
    """Base."""


class StaleShardError(LedgerError):
    """Report for a shard this holder does not hold (already requeued, done or unknown)."""


class BadReportError(LedgerError):
    """A malformed report, e.g. consumed count negative or past the shard end."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset as record indices [0, size), read in batches, shard by shard, epoch by epoch."""

    name: str
    size: int
    batch_size: int
    records_per_shard: int = 0  # 0 -> batch_size * 16 (never more than size)
    epochs: int = 1
    shuffle: bool = False
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the bad field, its value and the fix."""

        def bad(field: str, rule: str, fix: str) -> ValueError:
            value = getattr(self, field)
            return ValueError(f"dataset spec field '{field}' {rule}, got {value!r}: {fix}")

        if not isinstance(self.name, str) or not self.name:
            raise bad("name", "must be a non-empty string", "give the dataset a name")
        if len(self.name) > MAX_NAME_LENGTH or not self.name.isprintable():
            raise bad(
                "name",
                f"must be at most {MAX_NAME_LENGTH} printable characters",
                "use a shorter name without control characters",
            )
        if not _is_int(self.size) or not 1 <= self.size <= MAX_DATASET_SIZE:
            raise bad(
                "size",
                "must be an integer between 1 and 2**40",
                "set it to the number of records in the dataset",
            )
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise bad("batch_size", "must be an integer >= 1", "set the per-step batch size")
        if not _is_int(self.records_per_shard) or self.records_per_shard < 0:
            raise bad(
                "records_per_shard",
                "must be an integer >= 0",
                f"use 0 for the default (batch_size * {DEFAULT_BATCHES_PER_SHARD})",
            )
        if not _is_int(self.epochs) or not 1 <= self.epochs <= MAX_EPOCHS:
            raise bad(
                "epochs",
                f"must be an integer between 1 and {MAX_EPOCHS}",
                "set how many passes over the data to make",
            )
        if not isinstance(self.shuffle, bool):
            raise bad("shuffle", "must be true or false", "use a boolean")
        if not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise bad("seed", "must be a 64-bit signed integer", "use a smaller seed")

    def shard_records(self) -> int:
        """Effective records per shard: the configured count or batch_size * 16, capped at size."""
        wanted = self.records_per_shard or self.batch_size * DEFAULT_BATCHES_PER_SHARD
        return max(1, min(wanted, self.size))


@dataclass(frozen=True)
class Shard:
    """Positions [start, end) of one epoch's order, handed out under a unique shard_id."""

    shard_id: int
    epoch: int
    start: int
    end: int

    @property
    def size(self) -> int:
        """Number of records in the shard."""
        return self.end - self.start


@dataclass
class _Lease:
    holder: int
    shard: Shard
    consumed: int = 0
    request_id: int = 0  # the holder's id for the ask that got this shard (0: none given)


@dataclass
class _Range:
    """A todo range; `redo` marks a remainder given back by a holder (counted when re-served)."""

    epoch: int
    start: int
    end: int
    redo: bool


class DatasetLedger:
    """Todo / doing / done bookkeeping for one dataset's record positions, epoch by epoch.

    Not thread-safe: the owner serializes calls.
    """

    def __init__(self, spec: DatasetSpec) -> None:
        spec.validate()
        self.spec = spec
        self._spec_fields = dataclasses.asdict(spec)  # values are plain ints, str and bool
        self._shard_records = spec.shard_records()
        self._epoch = -1
        self._next_shard_id = 0
        self._todo: deque[_Range] = deque()
        self._todo_records = 0  # records in self._todo
        self._doing: dict[int, _Lease] = {}
        self._by_holder: dict[int, dict[int, _Lease]] = {}
        self._records_done = 0
        self._records_redone = 0
        self._done_per_epoch: dict[int, int] = {}
        # Shards whose lease was added, changed or removed since take_touched(): what an
        # incremental write to the state store must rewrite (see lease_record).
        self._touched: set[int] = set()

    # Handing out and taking back.

    def granted(self, holder: int, request_id: int) -> Shard | None:
        """The shard already handed to `holder` for ask `request_id` (a retried ask), if any."""
        if request_id <= 0:
            return None
        for lease in self._by_holder.get(holder, {}).values():
            if lease.request_id == request_id:
                return lease.shard
        return None

    def next_shard(
        self, holder: int, request_id: int = 0, records: int | None = None
    ) -> Shard | None:
        """Hand the front of todo to `holder`, at most `records` of it (default: the spec's
        shard size); None when todo is empty and no epoch is left."""
        _check_holder(holder)
        if not self._todo:
            if self._epoch >= self.spec.epochs - 1:
                return None
            self._epoch += 1
            self._done_per_epoch[self._epoch] = 0
            self._push_back(_Range(self._epoch, 0, self.spec.size, False))
            logger.debug("dataset %s: epoch %d created", self.spec.name, self._epoch)
        front = self._todo.popleft()
        end = min(front.end, front.start + max(1, records or self._shard_records))
        self._todo_records -= end - front.start
        if end < front.end:
            self._todo.appendleft(_Range(front.epoch, end, front.end, front.redo))
        shard = Shard(self._next_shard_id, front.epoch, front.start, end)
        self._next_shard_id += 1
        if front.redo:
            self._records_redone += shard.size
        self._add_lease(_Lease(holder, shard, request_id=request_id))
        return shard

    def record_indices(self, shard: Shard) -> np.ndarray:
        """The record indices at the shard's positions (shuffled per (seed, epoch) if enabled),
        as an int64 array."""
        if not 0 <= shard.epoch < self.spec.epochs or not (
            0 <= shard.start <= shard.end <= self.spec.size
        ):
            raise LedgerError(f"shard {shard} does not fit dataset {self.spec.name!r}")
        spec = self.spec
        return record_indices(
            shard.start, shard.end, spec.size, spec.shuffle, spec.seed, shard.epoch
        )

    def report(self, holder: int, shard_id: int, consumed: int) -> bool:
        """Record the cumulative records consumed in a held shard; True once it is done."""
        lease = self._doing.get(shard_id)
        if lease is None or lease.holder != holder:
            raise StaleShardError(
                f"dataset {self.spec.name!r}: node {holder} does not hold shard {shard_id} "
                "(it was given back, finished or never handed out)"
            )
        size = lease.shard.size
        if not _is_int(consumed) or not 0 <= consumed <= size:
            raise BadReportError(
                f"dataset {self.spec.name!r}: shard {shard_id} has {size} records, "
                f"a report of {consumed!r} consumed is outside [0, {size}]"
            )
        if consumed <= lease.consumed:
            return False  # a late or repeated report: progress never goes backwards
        self._count_done(lease.shard.epoch, consumed - lease.consumed)
        lease.consumed = consumed
        self._touched.add(shard_id)
        if consumed < size:
            return False
        self._remove_lease(lease)
        return True

    def release(self, holder: int) -> int:
        """Give back every shard `holder` holds; unconsumed remainders go to the front of todo."""
        leases = self._by_holder.get(holder)
        if not leases:
            return 0
        returned = self._requeue(list(leases.values()))
        logger.info(
            "dataset %s: node %s released, %d records back to todo",
            self.spec.name,
            holder,
            returned,
        )
        return returned

    # Queries.

    def holders(self) -> set[int]:
        """Nodes holding at least one shard."""
        return set(self._by_holder)

    def holds(self, holder: int) -> bool:
        """Whether `holder` holds a shard (constant time)."""
        return holder in self._by_holder

    def holder_count(self) -> int:
        """How many nodes hold a shard (constant time)."""
        return len(self._by_holder)

    def held_by(self, holder: int) -> list[Shard]:
        """Shards `holder` holds, oldest first."""
        return sorted(
            (lease.shard for lease in self._by_holder.get(holder, {}).values()),
            key=lambda s: s.shard_id,
        )

    def consumed(self, holder: int, shard_id: int) -> int:
        """Records consumed so far in a held shard (StaleShardError if not held by `holder`)."""
        lease = self._doing.get(shard_id)
        if lease is None or lease.holder != holder:
            raise StaleShardError(f"node {holder} does not hold shard {shard_id}")
        return lease.consumed

    @property
    def finished(self) -> bool:
        """Every epoch created and every record done."""
        return self.exhausted and not self._doing

    @property
    def exhausted(self) -> bool:
        """Nothing left to hand out (shards may still be held)."""
        return not self._todo and self._epoch >= self.spec.epochs - 1

    @property
    def epoch(self) -> int:
        """Highest epoch whose shards were created (-1 before the first next_shard)."""
        return self._epoch

    @property
    def records_done(self) -> int:
        """Records consumed, across all epochs."""
        return self._records_done

    @property
    def records_redone(self) -> int:
        """Records handed out again after a holder gave them back unconsumed."""
        return self._records_redone

    def records_todo(self) -> int:
        """Records not handed out yet, including epochs not created yet."""
        return self._todo_records + (self.spec.epochs - 1 - self._epoch) * self.spec.size

    def records_doing(self) -> int:
        """Unconsumed records in held shards."""
        return sum(lease.shard.size - lease.consumed for lease in self._doing.values())

    def done_per_epoch(self) -> dict[int, int]:
        """Records done per created epoch."""
        return dict(self._done_per_epoch)

    # Persistence.

    def snapshot(self) -> dict[str, Any]:
        """The full state as JSON-serializable data (see from_snapshot)."""
        data = self.head()
        data["doing"] = [_lease_record(lease) for _, lease in sorted(self._doing.items())]
        return data

    def head(self) -> dict[str, Any]:
        """The snapshot without its "doing" list: small, whatever the number of held shards."""
        return {
            "format": SNAPSHOT_FORMAT,
            "spec": dict(self._spec_fields),
            "epoch": self._epoch,
            "next_shard_id": self._next_shard_id,
            "todo": [
                {"epoch": r.epoch, "start": r.start, "end": r.end, "redo": r.redo}
                for r in self._todo
            ],
            "records_done": self._records_done,
            "records_redone": self._records_redone,
            "done_per_epoch": {str(e): n for e, n in sorted(self._done_per_epoch.items())},
        }

    def lease_record(self, shard_id: int) -> dict[str, Any] | None:
        """One item of the snapshot's "doing" list, or None when the shard is not held."""
        lease = self._doing.get(shard_id)
        return None if lease is None else _lease_record(lease)

    def doing_ids(self) -> set[int]:
        """Ids of the held shards."""
        return set(self._doing)

    def take_touched(self) -> set[int]:
        """Shard ids whose lease changed since the last call (then forgets them)."""
        touched, self._touched = self._touched, set()
        return touched

    def retouch(self, shard_ids: set[int]) -> None:
        """Mark shards changed again (a write of them to the state store failed)."""
        self._touched |= shard_ids

    @property
    def next_shard_id(self) -> int:
        """The id the next handed-out shard gets."""
        return self._next_shard_id

    @classmethod
    def from_snapshot(
        cls, data: dict[str, Any], requeue_doing: bool, first_shard_id: int = 0
    ) -> DatasetLedger:
        """Rebuild a ledger; requeue_doing gives held remainders back to todo as release() would.

        Pass the live ledger's next_shard_id as first_shard_id so ids it issued are never reused.
        """
        if not _is_int(first_shard_id) or first_shard_id < 0:
            raise ValueError(f"first_shard_id must be an integer >= 0, got {first_shard_id!r}")
        try:
            ledger = _restore(cls, data)
        except LedgerError:
            raise
        except KeyError as exc:
            raise LedgerError(f"malformed ledger snapshot: missing field {exc}") from exc
        except (TypeError, ValueError, AttributeError) as exc:
            raise LedgerError(f"malformed ledger snapshot: {exc!r}") from exc
        if requeue_doing and ledger._doing:
            ledger._requeue(list(ledger._doing.values()))
        ledger._next_shard_id = max(ledger._next_shard_id, first_shard_id)
        return ledger

    # Internals.

    def _push_back(self, r: _Range) -> None:
        self._todo.append(r)
        self._todo_records += r.end - r.start

    def _add_lease(self, lease: _Lease) -> None:
        self._doing[lease.shard.shard_id] = lease
        self._by_holder.setdefault(lease.holder, {})[lease.shard.shard_id] = lease
        self._touched.add(lease.shard.shard_id)

    def _remove_lease(self, lease: _Lease) -> None:
        del self._doing[lease.shard.shard_id]
        self._touched.add(lease.shard.shard_id)
        held = self._by_holder[lease.holder]
        del held[lease.shard.shard_id]
        if not held:
            del self._by_holder[lease.holder]

    def _count_done(self, epoch: int, records: int) -> None:
        self._records_done += records
        self._done_per_epoch[epoch] += records

    def _requeue(self, leases: list[_Lease]) -> int:
        """Drop the leases; their remainders go to the front of todo, oldest shard first."""
        returned = 0
        for lease in sorted(leases, key=lambda le: le.shard.shard_id, reverse=True):
            self._remove_lease(lease)
            shard = lease.shard
            start = shard.start + lease.consumed
            if start < shard.end:
                self._todo.appendleft(_Range(shard.epoch, start, shard.end, True))
                self._todo_records += shard.end - start
                returned += shard.end - start
        return returned


def _lease_record(lease: _Lease) -> dict[str, Any]:
    return {
        "holder": lease.holder,
        "shard_id": lease.shard.shard_id,
        "epoch": lease.shard.epoch,
        "start": lease.shard.start,
        "end": lease.shard.end,
        "consumed": lease.consumed,
        "request_id": lease.request_id,
    }


def _check_holder(holder: object) -> None:
    if not _is_int(holder):
        raise TypeError(f"holder must be an integer node id, got {holder!r}")


def _field(data: dict[str, Any], key: str, low: int, high: int, where: str = "") -> int:
    value = data[key]
    if not _is_int(value) or not low <= value <= high:
        raise LedgerError(
            f"malformed ledger snapshot: {where}{key}={value!r} is not an integer "
            f"in [{low}, {high}]"
        )
    return value


def _restore(cls: type[DatasetLedger], data: dict[str, Any]) -> DatasetLedger:
    """Parse and check a snapshot; every inconsistency raises LedgerError."""

    def fail(message: str) -> LedgerError:
        return LedgerError(f"malformed ledger snapshot: {message}")

    if not isinstance(data, dict):
        raise fail(f"expected a dict, got {type(data).__name__}")
    if data.get("format") != SNAPSHOT_FORMAT:
        raise fail(f"format {data.get('format')!r} is not {SNAPSHOT_FORMAT}")
    spec_data = data["spec"]
    if not isinstance(spec_data, dict):
        raise fail("spec is not a dict")
    try:
        spec = DatasetSpec(**spec_data)
        ledger = cls(spec)
    except (TypeError, ValueError) as exc:
        raise fail(f"bad spec: {exc}") from exc
    size = spec.size
    big = 2**63 - 1
    epoch = _field(data, "epoch", -1, spec.epochs - 1)
    next_id = _field(data, "next_shard_id", 0, big)
    ledger._epoch = epoch
    ledger._next_shard_id = next_id
    ledger._records_done = _field(data, "records_done", 0, big)
    ledger._records_redone = _field(data, "records_redone", 0, big)

    done_data = data["done_per_epoch"]
    if not isinstance(done_data, dict):
        raise fail("done_per_epoch is not a dict")
    done_per_epoch = {int(k): v for k, v in done_data.items()}
    if sorted(done_per_epoch) != list(range(epoch + 1)):
        raise fail(f"done_per_epoch has epochs {sorted(done_per_epoch)}, expected 0..{epoch}")
    for e, n in done_per_epoch.items():
        if not _is_int(n) or not 0 <= n <= size:
            raise fail(f"done_per_epoch[{e}]={n!r} is not in [0, {size}]")
    if sum(done_per_epoch.values()) != ledger._records_done:
        raise fail("done_per_epoch does not add up to records_done")
    ledger._done_per_epoch = done_per_epoch

    # Every created epoch's positions must be covered exactly once by done + doing + todo.
    open_ranges: list[tuple[int, int, int]] = []  # (epoch, start, end) of unconsumed positions
    todo_data = data["todo"]
    doing_data = data["doing"]
    if not isinstance(todo_data, list) or not isinstance(doing_data, list):
        raise fail("todo and doing must be lists")
    for i, item in enumerate(todo_data):
        where = f"todo[{i}]."
        r_epoch = _field(item, "epoch", 0, epoch, where)
        start = _field(item, "start", 0, size - 1, where)
        end = _field(item, "end", start + 1, size, where)
        redo = item["redo"]
        if not isinstance(redo, bool):
            raise fail(f"{where}redo={redo!r} is not a boolean")
        ledger._push_back(_Range(r_epoch, start, end, redo))
        open_ranges.append((r_epoch, start, end))
    for i, item in enumerate(doing_data):
        where = f"doing[{i}]."
        holder = item["holder"]
        if not _is_int(holder):
            raise fail(f"{where}holder={holder!r} is not an integer")
        shard_id = _field(item, "shard_id", 0, next_id - 1, where)
        if shard_id in ledger._doing:
            raise fail(f"shard {shard_id} appears twice in doing")
        s_epoch = _field(item, "epoch", 0, epoch, where)
        start = _field(item, "start", 0, size - 1, where)
        end = _field(item, "end", start + 1, size, where)
        consumed = _field(item, "consumed", 0, end - start - 1, where)
        request_id = item.get("request_id", 0)
        if not _is_int(request_id) or request_id < 0:
            raise fail(f"{where}request_id={request_id!r} is not an integer >= 0")
        shard = Shard(shard_id, s_epoch, start, end)
        ledger._add_lease(_Lease(holder, shard, consumed, request_id))
        open_ranges.append((s_epoch, start + consumed, end))
    open_ranges.sort()
    open_per_epoch = dict.fromkeys(range(epoch + 1), 0)
    for (e1, _, end1), (e2, start2, _) in pairwise(open_ranges):
        if e1 == e2 and start2 < end1:
            raise fail(f"todo/doing ranges overlap in epoch {e1}")
    for e, start, end in open_ranges:
        open_per_epoch[e] += end - start
    for e in range(epoch + 1):
        if done_per_epoch[e] + open_per_epoch[e] != size:
            raise fail(
                f"epoch {e}: {done_per_epoch[e]} done + {open_per_epoch[e]} todo/doing "
                f"records != dataset size {size}"
            )
    return ledger
