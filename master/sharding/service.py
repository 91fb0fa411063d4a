"""The data sharding service: every dataset's ledger, blocking shard requests, persistence."""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass

import numpy as np

from master.sharding.ledger import DatasetLedger, DatasetSpec, LedgerError, Shard
from master.sharding.pacing import ShardPacer
from master.state.api import StateStore

log = logging.getLogger(__name__)

# A live ledger is stored as a head row (everything but the held shards) in LEDGER_TABLE and one
# row per held shard in LEASE_TABLE, so a grant or a completion rewrites two small rows, not the
# whole ledger. A head row with a "doing" list (written before the lease rows existed) is a whole
# ledger; it is read as such and rewritten in the new layout by the next write.
LEDGER_TABLE = "ledger"
LEASE_TABLE = "ledger_lease"
SNAPSHOT_TABLE = "ledger_snapshot"
# Lease rows one write may change in a store that limits its transactions (etcd: 128
# operations by default). A store without a limit (SQLite) takes every changed row in one
# transaction, so a write costs the rows it changed whatever the number of held shards.
MAX_LEASE_ROWS_PER_WRITE = 100
DEFAULT_FLUSH_SECONDS = 0.2


class UnknownDatasetError(LookupError):
    """No dataset of that name was created in this job."""


class DatasetConflictError(ValueError):
    """A dataset of that name exists with a different spec."""


class ShardStatus(enum.Enum):
    SHARD = 0
    PENDING = 1
    END = 2


@dataclass(frozen=True)
class ShardGrant:
    """The answer to a shard request."""

    status: ShardStatus
    shard: Shard | None = None
    indices: np.ndarray | None = None  # int64 record indices of the shard


@dataclass(frozen=True)
class DatasetStats:
    """Progress figures of one dataset, for status and summaries."""

    name: str
    size: int
    epochs: int
    current_epoch: int
    records_done: int
    records_redone: int
    records_todo: int
    records_doing: int
    finished: bool


class _Entry:
    """A dataset's ledger, its lock, and how far its changes are in the state store.

    `version` counts changes to the ledger; `durable` is the version the store last received.
    """

    def __init__(self, ledger: DatasetLedger, stored: set[int] | None = None) -> None:
        self.ledger = ledger
        self.cond = threading.Condition()
        self.version = 0
        self.durable = 0
        # Group commit: one thread at a time writes (`writing`); the others wait on
        # `durable_cond` until `durable` covers their change, woken all at once.
        self.durable_cond = threading.Condition(threading.Lock())
        self.writing = False
        self.stored: set[int] = stored or set()  # shard ids with a row in LEASE_TABLE
        self.rewrite_all = False  # the next write rewrites every lease row (ledger replaced)
        # Shard sizes follow each holder's pace unless the spec fixes them.
        spec = ledger.spec
        base = spec.shard_records()
        self.pacer = (
            None if spec.records_per_shard else ShardPacer(base, granule=min(spec.batch_size, base))
        )

    def next_shard(self, holder: int, request_id: int) -> Shard | None:
        """The ledger's next shard for `holder`, sized to its pace (call with `cond` held)."""
        ledger = self.ledger
        if self.pacer is None:
            return ledger.next_shard(holder, request_id)
        records = self.pacer.records_for(holder, ledger.records_todo(), ledger.holder_count())
        shard = ledger.next_shard(holder, request_id, records)
        if shard is not None:
            self.pacer.granted(holder, shard.shard_id, shard.size)
        return shard

    def changed(self) -> int:
        """Count a change (call with `cond` held); returns the version to make durable."""
        self.version += 1
        return self.version


class _Deferred:
    """The context of `ShardingService.deferred_commits` (a class: it runs on every call)."""

    __slots__ = ("_local",)

    def __init__(self, local: threading.local) -> None:
        self._local = local

    def __enter__(self) -> list[tuple[_Entry, int]]:
        pending: list[tuple[_Entry, int]] = []
        self._local.pending = pending
        return pending

    def __exit__(self, *exc_info: object) -> None:
        self._local.pending = None


def _lease_key(dataset: str, shard_id: int) -> str:
    return f"{dataset}/{shard_id:020d}"


def snapshot_key(dataset: str, global_step: int) -> str:
    return f"{dataset}@{global_step:015d}"


class ShardingService:
    """Hands out shards of every dataset, tracks progress, persists ledgers to the state store."""

    def __init__(self, store: StateStore, flush_seconds: float = DEFAULT_FLUSH_SECONDS) -> None:
        self._store = store
        self._datasets: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._flush_seconds = flush_seconds
        self._closed = threading.Event()
        # Node incarnations that ended: never granted a shard again (ids are per incarnation).
        self._retired: set[int] = set()
        self._deferring = threading.local()  # .pending: the commits a caller makes itself
        # (holder, datasets): those datasets' shards are granted to that holder only.
        self._kept: tuple[int, frozenset[str]] | None = None
        leases: dict[str, list[dict]] = {}
        for key, raw in store.scan(LEASE_TABLE).items():
            leases.setdefault(key.rpartition("/")[0], []).append(json.loads(raw))
        for name, raw in store.scan(LEDGER_TABLE).items():
            data = json.loads(raw)
            whole = "doing" in data
            if not whole:
                data["doing"] = sorted(leases.get(name, []), key=lambda d: d["shard_id"])
            ledger = DatasetLedger.from_snapshot(data, requeue_doing=False)
            ledger.take_touched()  # as stored
            entry = _Entry(ledger, {d["shard_id"] for d in leases.get(name, [])})
            entry.rewrite_all = whole
            self._datasets[name] = entry
        self._flusher = threading.Thread(target=self._flush_loop, name="ledger-flush", daemon=True)
        self._flusher.start()

    # -- datasets -----------------------------------------------------------

    def create(self, spec: DatasetSpec) -> bool:
        """Register a dataset; True if new, False if an identical one exists."""
        spec.validate()
        with self._lock:
            entry = self._datasets.get(spec.name)
            if entry is not None:
                if entry.ledger.spec != spec:
                    raise DatasetConflictError(
                        f"dataset {spec.name!r} already exists with a different spec "
                        f"({_spec_diff(entry.ledger.spec, spec)}); use another name or the same "
                        "parameters on every node"
                    )
                return False
            entry = _Entry(DatasetLedger(spec))
            self._datasets[spec.name] = entry
        self._persist(entry, force=True)
        # The position of a model that has trained nothing yet: restored when a PS fails
        # before the first checkpoint.
        self.save_snapshot(spec.name, 0)
        log.info("dataset %r created: %s", spec.name, spec)
        return True

    def _entry(self, name: str) -> _Entry:
        entry = self._datasets.get(name)
        if entry is None:
            known = ", ".join(sorted(self._datasets)) or "none"
            raise UnknownDatasetError(
                f"unknown dataset {name!r} (known: {known}); create it first (ShardedDataset does)"
            )
        return entry

    def names(self) -> list[str]:
        return sorted(self._datasets)

    # -- shards -------------------------------------------------------------

    def get_shard(
        self,
        name: str,
        holder: int,
        wait_seconds: float = 0.0,
        request_id: int = 0,
        indices: bool = True,
    ) -> ShardGrant:
        """Next shard for `holder`; waits up to wait_seconds while others still hold shards.

        A repeated `request_id` gets the shard that ask already got (its answer was lost).
        `indices`: with the shard's record indices (a node that computes them asks without)."""
        entry = self._entry(name)
        deadline = time.monotonic() + max(0.0, wait_seconds)
        with entry.cond:
            again = entry.ledger.granted(holder, request_id)
            if again is not None:
                # Its grant may still be on its way to the store (a retry racing the first ask).
                version = entry.version
                ledger = entry.ledger
                shard = again
            while again is None:
                if holder in self._retired:
                    return ShardGrant(ShardStatus.PENDING)  # its answer has nobody to reach
                ledger = entry.ledger
                kept = self._kept_from(name, ledger, holder)
                shard = None if kept else entry.next_shard(holder, request_id)
                if shard is not None:
                    version = entry.changed()
                    break
                if ledger.finished:
                    return ShardGrant(ShardStatus.END)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed.is_set():
                    return ShardGrant(ShardStatus.PENDING)
                entry.cond.wait(remaining)
        # Durable before the node learns of it: a restarted master must know who holds it.
        self._commit(entry, version)
        # Pure in (spec, shard): computed outside the lock.
        return ShardGrant(
            ShardStatus.SHARD, shard, ledger.record_indices(shard) if indices else None
        )

    def keep_work_for(self, holder: int | None, datasets: Iterable[str] = ()) -> None:
        """Grant shards of `datasets` to `holder` only (other asks wait), so a fault due on a
        late trainer's first step lands where it was due; None ends it."""
        kept = None if holder is None else (holder, frozenset(datasets))
        if kept == self._kept:
            return
        self._kept = kept
        for entry in list(self._datasets.values()):
            with entry.cond:
                entry.cond.notify_all()  # asks held back re-check

    def _kept_from(self, name: str, ledger: DatasetLedger, holder: int) -> bool:
        """Whether `holder`'s ask waits: what is left of `name` is kept for another holder."""
        kept = self._kept
        if kept is None or holder == kept[0] or name not in kept[1]:
            return False
        return ledger.records_todo() > 0

    def report(self, name: str, holder: int, reports: list[tuple[int, int]]) -> None:
        """Apply (shard_id, cumulative consumed) reports; wakes waiters when a shard completes."""
        entry = self._entry(name)
        with entry.cond:
            completed = False
            try:
                for shard_id, consumed in reports:
                    if entry.ledger.report(holder, shard_id, consumed):
                        completed = True
                        if entry.pacer is not None:
                            entry.pacer.finished(holder, shard_id)
            finally:
                # Reports before a bad one were applied: they count as a change either way.
                version = entry.changed()
            if completed and entry.ledger.finished:
                entry.cond.notify_all()
        if completed:
            # A finished shard is never reported again: make its end durable now. Partial
            # progress may lag by one flush; nodes re-send it after a master restart.
            self._commit(entry, version)

    def apply_positions(self, holder: int, positions: dict[str, list[tuple[int, int]]]) -> int:
        """Apply the last positions an ended holder left with its platform (its coalesced
        reports had not carried them yet); stale, bad or unknown ones are skipped. Returns
        how many advanced a shard or confirmed it."""
        applied = 0
        for name, pairs in positions.items():
            if name not in self._datasets:
                continue
            for shard_id, consumed in pairs:
                try:
                    self.report(name, holder, [(shard_id, consumed)])
                    applied += 1
                except LedgerError:  # handed back, finished, or not this holder's
                    continue
        return applied

    def release(self, name: str, holder: int) -> int:
        """Re-queue the unconsumed remainder of the holder's shards of one dataset."""
        entry = self._entry(name)
        with entry.cond:
            n = entry.ledger.release(holder)
            if entry.pacer is not None:
                entry.pacer.forget(holder)
            entry.changed()
            entry.cond.notify_all()
        return n

    def retire(self, holder: int) -> dict[str, int]:
        """The holder's incarnation ended: its remainders go back (as `release_everywhere`),
        and an ask it sent before it died, still waiting here, can never take them."""
        self._retired.add(holder)
        return self.release_everywhere(holder)

    def release_everywhere(self, holder: int) -> dict[str, int]:
        """Re-queue the holder's remainders in every dataset (the node died or hung)."""
        out = {}
        for name in self.names():
            n = self.release(name, holder)
            if n:
                out[name] = n
        return out

    def holds_shards(self, holder: int) -> bool:
        """Whether the holder has a shard of any dataset in doing."""
        for entry in list(self._datasets.values()):
            with entry.cond:
                if entry.ledger.holds(holder):
                    return True
        return False

    def datasets_held_by(self, holders: Collection[int]) -> set[str]:
        """The datasets of which any of `holders` has a shard in doing."""
        out = set()
        for name, entry in list(self._datasets.items()):
            with entry.cond:
                if any(entry.ledger.holds(h) for h in holders):
                    out.add(name)
        return out

    def holders(self) -> set[int]:
        """Every holder with a shard of some dataset in doing (one lock per dataset, not per
        node: the control loop asks this for all nodes at every tick)."""
        out: set[int] = set()
        for entry in list(self._datasets.values()):
            with entry.cond:
                out |= entry.ledger.holders()
        return out

    # -- ledger snapshots ---------------------------------------------------

    def save_snapshot(self, name: str, global_step: int) -> dict:
        """Store the ledger as of `global_step` (saved together with a model checkpoint)."""
        entry = self._entry(name)
        with entry.cond:
            data = entry.ledger.snapshot()
        data["global_step"] = global_step
        self._store.put(SNAPSHOT_TABLE, snapshot_key(name, global_step), json.dumps(data).encode())
        return data

    def restore_snapshot(self, name: str, global_step: int) -> dict:
        """Roll the ledger back to the latest snapshot saved at or before `global_step`.

        A snapshot is saved just before its model checkpoint, so the restored ledger never
        counts a record the restored model has not trained on.
        """
        entry = self._entry(name)
        steps = [s for s in self.snapshot_steps(name) if s <= global_step]
        if not steps:
            raise UnknownDatasetError(
                f"no ledger snapshot of dataset {name!r} at or before global step {global_step} "
                f"(saved steps: {self.snapshot_steps(name) or 'none'})"
            )
        raw = self._store.get(SNAPSHOT_TABLE, snapshot_key(name, steps[-1]))
        data = json.loads(raw)
        with entry.cond:
            # New shard ids continue past every id handed out, so late reports stay stale.
            entry.ledger = DatasetLedger.from_snapshot(
                data, requeue_doing=True, first_shard_id=entry.ledger.next_shard_id
            )
            entry.rewrite_all = True
            version = entry.changed()
            entry.cond.notify_all()
        self._commit(entry, version)
        return data

    def snapshot_steps(self, name: str) -> list[int]:
        prefix = f"{name}@"
        return sorted(
            int(k[len(prefix) :]) for k in self._store.scan(SNAPSHOT_TABLE) if k.startswith(prefix)
        )

    # -- status and persistence --------------------------------------------

    def stats(self) -> list[DatasetStats]:
        out = []
        for name in self.names():
            entry = self._datasets[name]
            with entry.cond:
                led = entry.ledger
                out.append(
                    DatasetStats(
                        name=name,
                        size=led.spec.size,
                        epochs=led.spec.epochs,
                        current_epoch=max(led.epoch, 0),
                        records_done=led.records_done,
                        records_redone=led.records_redone,
                        records_todo=led.records_todo(),
                        records_doing=led.records_doing(),
                        finished=led.finished,
                    )
                )
        return out

    def deferred_commits(self) -> _Deferred:
        """Inside, this thread's shard grants and ends do not write: each leaves its
        (entry, version) in the list `with` yields, and the caller must make them durable
        (`commit`, or `master.sharding.group_commit`) before it answers the node."""
        return _Deferred(self._deferring)

    def commit(self, entry: _Entry, version: int | None = None) -> None:
        """Make the ledger durable as of `version` (default: every change so far)."""
        self._commit(entry, entry.version if version is None else version)

    def _commit(self, entry: _Entry, version: int) -> None:
        """Return once the store holds the ledger as of `version` (or later); inside
        `deferred_commits`, note it for the caller instead.

        Group commit: one thread at a time writes the ledger as it is then, which covers every
        change made so far; the threads that wait meanwhile are woken together once it is
        stored and return without writing (no lock to pass from one to the next: under load
        each hand-off of a lock costs a context switch). Alone, a call costs one write.
        """
        if entry.durable >= version:
            return
        pending = getattr(self._deferring, "pending", None)
        if pending is not None:
            pending.append((entry, version))
            return
        with entry.durable_cond:
            while entry.durable < version:
                if not entry.writing:
                    entry.writing = True
                    break
                entry.durable_cond.wait()
            else:
                return
        covered = 0
        try:
            covered = self._write(entry)
        finally:
            with entry.durable_cond:
                entry.writing = False
                entry.durable = max(entry.durable, covered)
                # On a failed write too: a waiter becomes the writer and tries again.
                entry.durable_cond.notify_all()

    def _write(self, entry: _Entry) -> int:
        """Store the ledger as it is now (head and changed lease rows in one transaction);
        returns the version written. Only the thread that set `entry.writing` calls this."""
        with entry.cond:
            covered = entry.version
            ledger = entry.ledger
            touched = ledger.take_touched()
            rewrite_all = entry.rewrite_all
            rows = touched | entry.stored | ledger.doing_ids() if rewrite_all else touched
            if self._store.max_writes_per_transaction is None or (
                len(rows) <= MAX_LEASE_ROWS_PER_WRITE
            ):
                head = ledger.head()
                leases = {sid: ledger.lease_record(sid) for sid in rows}
                entry.rewrite_all = False
            else:
                # Too many rows for one transaction (etcd caps its ops): the whole ledger
                # goes in the head row, which a restarted master reads without the lease
                # rows; those are stale now, so a later small write rewrites them all, and
                # meanwhile each write drops a batch of rows of shards no longer held.
                head = ledger.snapshot()
                stale = sorted(entry.stored - ledger.doing_ids())
                leases = dict.fromkeys(stale[:MAX_LEASE_ROWS_PER_WRITE])
                entry.rewrite_all = True
        name = head["spec"]["name"]
        try:
            with self._store.transaction():
                self._store.put(LEDGER_TABLE, name, json.dumps(head).encode())
                for sid, record in leases.items():
                    key = _lease_key(name, sid)
                    if record is None:
                        if sid in entry.stored:
                            self._store.delete(LEASE_TABLE, key)
                    else:
                        self._store.put(LEASE_TABLE, key, json.dumps(record).encode())
        except BaseException:
            with entry.cond:
                if entry.ledger is ledger:
                    ledger.retouch(touched)
                entry.rewrite_all = rewrite_all or entry.ledger is not ledger
            raise
        for sid, record in leases.items():
            if record is None:
                entry.stored.discard(sid)
            else:
                entry.stored.add(sid)
        return covered

    def _persist(self, entry: _Entry, force: bool = False) -> None:
        """Write the ledger if it changed since the last write (always, with `force`)."""
        with entry.cond:
            version = entry.changed() if force else entry.version
        self._commit(entry, version)

    def flush(self) -> None:
        """Write every changed ledger to the state store now."""
        with self._lock:
            entries = list(self._datasets.values())
        for entry in entries:
            self._persist(entry)

    def _flush_loop(self) -> None:
        while not self._closed.wait(self._flush_seconds):
            try:
                self.flush()
            except Exception:
                log.exception("writing the shard ledgers to the state store failed")

    def close(self) -> None:
        """Wake every waiter, stop the flusher, and write the ledgers a last time."""
        self._closed.set()
        for entry in list(self._datasets.values()):
            with entry.cond:
                entry.cond.notify_all()
        self._flusher.join(timeout=5)
        self.flush()


def _spec_diff(old: DatasetSpec, new: DatasetSpec) -> str:
    a, b = asdict(old), asdict(new)
    return ", ".join(f"{k}: {a[k]!r} != {b[k]!r}" for k in a if a[k] != b[k])


__all__ = [
    "DatasetConflictError",
    "DatasetStats",
    "LedgerError",
    "ShardGrant",
    "ShardStatus",
    "ShardingService",
    "UnknownDatasetError",
]
