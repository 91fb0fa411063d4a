"""Thread-safe rendezvous rounds for every run of a job, with blocking waits and durable state.

Blocking calls wait on a condition variable and wake when something they wait for may have
changed, or the state machine's next deadline (end of a last call, a lease) passes: no polling.
A member watching for nodes waiting to join wakes when a node joins or leaves; a node waiting
for its round wakes when a round closes or a node leaves, dies or is replaced, not at every
join (at 256 nodes, waking every waiter at every join was 65,000 wake-ups per round).

Each run's state (round number, closed flag, the current round's members and ranks, the nodes
waiting for the next round, the incarnation ids that fence stale calls, lost and departed
members) is one record in the state store, replaced in a transaction whenever it changes and
before the call that changed it answers. A restarted master loads it and, once `resume()` is
called (after the job has re-adopted its nodes), serves the same rounds: members keep their
ranks and their workers, and each live node gets a fresh lease (plus RESUME_GRACE_SECONDS to
reconnect), so a node that died while the master was away is lost when that lease runs out and
the others re-rendezvous as usual. Until then, calls from nodes the job has not re-adopted yet
are answered UNAVAILABLE (retry), not as stale.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from master.rendezvous.rounds import (
    NodeKey,
    Participant,
    Round,
    RoundConfig,
    RoundStateMachine,
    WaitResult,
    WaitStatus,
)
from master.state.api import StateStore

log = logging.getLogger(__name__)

TABLE = "rendezvous"
# After a restart, a live node's first lease is this much longer than lease_seconds: its client
# retries an unreachable master with a backoff of up to about 3 s, then has to reconnect.
RESUME_GRACE_SECONDS = 5.0
MAX_RUN_ID_CHARS = 256


def _always_active() -> bool:
    return True


class RendezvousService:
    """Rendezvous rounds keyed by run id; safe to call from many RPC threads."""

    def __init__(
        self,
        store: StateStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_round: Callable[[str, Round], None] | None = None,
        describe_silent: Callable[[NodeKey], str] | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self._on_round = on_round  # told of every round that closes (job events)
        # What a node whose lease lapsed is doing (e.g. busy: its process runs at 97% CPU).
        self._describe_silent = describe_silent
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # every change (watchers wait on it)
        self._rounds = threading.Condition(lock)  # a round closed, or a member left or died
        self._runs: dict[str, RoundStateMachine] = {}
        self._saved: dict[str, int] = {}  # per run, the version of the last record written
        # Group commit of joins and leaves (see _commit): one writer at a time, outside the
        # state lock; `_store_lock` keeps an older record from overwriting a newer one.
        self._durable = threading.Condition(threading.Lock())
        self._writing = False
        self._store_lock = threading.Lock()
        # Until resume(): the nodes of the loaded rounds are not known to the job yet.
        self._resuming = False
        if store is not None:
            now = clock()
            for run_id, raw in store.scan(TABLE).items():
                run = RoundStateMachine.restore(json.loads(raw), now)
                self._runs[run_id] = run
                self._saved[run_id] = run.version
                self._resuming = self._resuming or run.in_progress
                log.info(
                    "rendezvous %r loaded at round %d: %d member(s), %d waiting%s",
                    run_id,
                    run.number,
                    len(run.current.members) if run.current else 0,
                    run.joining_count,
                    " (closed)" if run.closed else "",
                )

    @property
    def resuming(self) -> bool:
        """True from loading a previous master's rounds until resume(): calls should retry."""
        return self._resuming

    def resume(self) -> None:
        """The job has re-adopted its nodes: serve the loaded rounds, every live node's lease
        starting now plus RESUME_GRACE_SECONDS (its agent's client may be backing off)."""
        with self._cond:
            now = self._clock()
            for run in self._runs.values():
                run.renew_leases(now, RESUME_GRACE_SECONDS)
            self._resuming = False
            self._notify_all()
        for run_id, run in self._runs.items():
            if run.in_progress:
                log.info(
                    "rendezvous %r resumed in round %d (%s)",
                    run_id,
                    run.number,
                    ", ".join(m.name for m in run.current.members) if run.current else "forming",
                )

    def join(self, run_id: str, config: RoundConfig, participant: Participant) -> int:
        """Join the round being formed; returns its number. RendezvousClosedError when closed."""
        _check_run_id(run_id)
        with self._cond:
            run = self._runs.get(run_id)
            if run is None:
                run = self._runs[run_id] = RoundStateMachine(config)
            elif run.config != config:
                raise ValueError(
                    f"rendezvous {run_id!r} was started with {run.config}, this node asks for "
                    f"{config}; start every node with the same settings (or another run id)"
                )
            previous = run.id_of(participant.key)
            number = run.join(participant, self._clock())
            self._advance(run_id, run)
            version = run.version
        # Stored before the node learns its round, and before a watcher learns of the join.
        self._commit(run_id, run, version)
        with self._cond:
            self._cond.notify_all()
            if previous is not None and previous != participant.id:
                self._rounds.notify_all()  # the old incarnation's wait must end
        return number

    def wait_round(
        self,
        run_id: str,
        key: NodeKey,
        node_id: int,
        round_number: int,
        timeout: float,
        is_active: Callable[[], bool] = _always_active,
    ) -> WaitResult:
        """Block until the awaited round closes (or timeout); PENDING when it has not."""
        run = self._run(run_id)
        deadline = self._clock() + timeout
        with self._cond:
            while True:
                # A node blocked in a live call is alive: its lease runs from now.
                run.touch(key, node_id, self._clock())
                self._advance(run_id, run)
                result = run.wait_status(key, node_id, round_number)
                if result.status != WaitStatus.PENDING or not self._sleep(
                    run, deadline, is_active, self._rounds
                ):
                    return result

    def watch(
        self,
        run_id: str,
        key: NodeKey,
        node_id: int,
        round_number: int,
        known_waiting: int,
        timeout: float,
        is_active: Callable[[], bool] = _always_active,
    ) -> tuple[int, bool]:
        """Block until a member's (waiting, closed) differs from what it knows, or timeout."""
        run = self._run(run_id)
        deadline = self._clock() + timeout
        with self._cond:
            while True:
                run.touch(key, node_id, self._clock())
                self._advance(run_id, run)
                waiting = run.waiting(key, node_id, round_number)
                if (
                    waiting != known_waiting
                    or run.closed
                    or not self._sleep(run, deadline, is_active, self._cond)
                ):
                    return waiting, run.closed

    def leave(self, run_id: str, key: NodeKey, node_id: int) -> None:
        run = self._run(run_id)
        with self._cond:
            run.leave(key, node_id)
            self._advance(run_id, run)
            version = run.version
        self._commit(run_id, run, version)
        with self._cond:
            self._notify_all()

    def set_closed(self, run_id: str) -> None:
        run = self._run(run_id)
        with self._cond:
            run.set_closed()
            self._save(run_id, run)
            self._notify_all()
        log.info("rendezvous %r closed", run_id)

    def is_closed(self, run_id: str) -> bool:
        with self._cond:
            run = self._runs.get(run_id)
            return run is not None and run.closed

    def current_round(self, run_id: str) -> int:
        """The number of the last closed round of a run (0 before the first)."""
        with self._cond:
            run = self._runs.get(run_id)
            return run.number if run else 0

    def node_died(self, key: NodeKey, node_id: int) -> None:
        """A node's process ended abnormally: every run it is part of learns it at once."""
        with self._cond:
            for run_id, run in self._runs.items():
                run.lose(key, node_id)
                self._advance(run_id, run)
                self._save(run_id, run)
            self._notify_all()

    def wake(self) -> None:
        """Wake every blocked call so it re-checks its state (e.g. its RPC was cancelled)."""
        with self._cond:
            self._notify_all()

    # -- internals ----------------------------------------------------------

    def _run(self, run_id: str) -> RoundStateMachine:
        with self._cond:
            run = self._runs.get(run_id)
        if run is None:
            raise ValueError(f"no rendezvous named {run_id!r}; join it first")
        return run

    def _advance(self, run_id: str, run: RoundStateMachine) -> None:
        """Apply time to a run (leases, last call); persist and wake waiters on a change."""
        before = (run.number, run.joining_count)
        version = run.version
        closed_round = run.advance(self._clock(), self._describe_silent)
        # A lease that ran out or a round that closed changes the record: saved before any
        # caller learns of the change. (A join or leave that comes with it is saved with it;
        # alone, it is saved by its own call's group commit.)
        if run.version != version:
            self._save(run_id, run)
        if closed_round is not None:
            if self._on_round is not None:
                self._on_round(run_id, closed_round)
        if closed_round is not None or (run.number, run.joining_count) != before:
            self._notify_all()

    def _notify_all(self) -> None:
        """Wake every blocked call, watchers and round waiters (call under the lock)."""
        self._cond.notify_all()
        self._rounds.notify_all()

    def _sleep(
        self,
        run: RoundStateMachine,
        deadline: float,
        is_active: Callable,
        cond: threading.Condition,
    ) -> bool:
        """Wait for a change or the run's next deadline; False when the call should return."""
        now = self._clock()
        if now >= deadline or not is_active():
            return False
        wake_at = deadline
        next_deadline = run.next_deadline()
        if next_deadline is not None:
            wake_at = min(wake_at, next_deadline)
        # A tiny floor keeps a deadline that is due "now" from spinning on float rounding.
        cond.wait(max(wake_at - now, 0.001))
        return True

    def _save(self, run_id: str, run: RoundStateMachine) -> None:
        """Write the run's record if it changed since the last write (called under the lock)."""
        if self._store is None or self._saved.get(run_id) == run.version:
            return
        self._write(run_id, run.version, json.dumps(run.snapshot(), sort_keys=True).encode())

    def _write(self, run_id: str, version: int, raw: bytes) -> None:
        """Store the record of `version` unless a later one is stored; wake who it covers."""
        with self._store_lock:
            if self._saved.get(run_id, -1) >= version:
                return
            with self._store.transaction():
                self._store.put(TABLE, run_id, raw)
            with self._durable:
                self._saved[run_id] = version
                self._durable.notify_all()

    def _commit(self, run_id: str, run: RoundStateMachine, version: int) -> None:
        """Return once the run's record of `version` (or later) is stored: group commit.

        Called without the state lock. One caller at a time writes the run as it is then,
        which covers every change made so far; the others wait and are woken together. At
        256 joining nodes that is a handful of writes instead of one per join, each of which
        made a JSON record of every node while holding the lock every call needs."""
        if self._store is None:
            return
        with self._durable:
            while self._saved.get(run_id, -1) < version:
                if not self._writing:
                    self._writing = True
                    break
                self._durable.wait()
            else:
                return
        try:
            with self._cond:
                latest = run.version
                raw = (
                    None
                    if self._saved.get(run_id) == latest
                    else json.dumps(run.snapshot(), sort_keys=True).encode()
                )
            if raw is not None:
                self._write(run_id, latest, raw)
        finally:
            with self._durable:
                self._writing = False
                self._durable.notify_all()  # a waiter not covered becomes the writer


def _check_run_id(run_id: str) -> None:
    if not run_id or len(run_id) > MAX_RUN_ID_CHARS:
        raise ValueError(
            f"run_id must be 1 to {MAX_RUN_ID_CHARS} characters, got {run_id!r}; "
            "give every node of a job the same non-empty run id"
        )
