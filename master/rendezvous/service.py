"""Thread-safe rendezvous rounds for every run of a job, with blocking waits and durable numbers.

Blocking calls wait on one condition variable and wake when a round closes, a node joins or
leaves, or the state machine's next deadline (end of a last call, a lease) passes: no polling.
Round numbers and closed flags go to the state store, so a restarted master keeps fencing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

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
    ) -> None:
        self._store = store
        self._clock = clock
        self._on_round = on_round  # told of every round that closes (job events)
        self._cond = threading.Condition()
        self._runs: dict[str, RoundStateMachine] = {}
        if store is not None:
            for run_id, raw in store.scan(TABLE).items():
                saved = json.loads(raw)
                self._runs[run_id] = RoundStateMachine(
                    RoundConfig(**saved["config"]),
                    number=int(saved["round"]),
                    closed=bool(saved["closed"]),
                )
                log.info("rendezvous %r resumes after round %d", run_id, saved["round"])

    def join(self, run_id: str, config: RoundConfig, participant: Participant) -> int:
        """Join the round being formed; returns its number. RendezvousClosedError when closed."""
        _check_run_id(run_id)
        with self._cond:
            run = self._runs.get(run_id)
            if run is None:
                run = self._runs[run_id] = RoundStateMachine(config)
                self._save(run_id, run)
            elif run.config != config:
                raise ValueError(
                    f"rendezvous {run_id!r} was started with {run.config}, this node asks for "
                    f"{config}; start every node with the same settings (or another run id)"
                )
            number = run.join(participant, self._clock())
            self._advance(run_id, run)
            self._cond.notify_all()
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
                if result.status != WaitStatus.PENDING or not self._sleep(run, deadline, is_active):
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
                    or not self._sleep(run, deadline, is_active)
                ):
                    return waiting, run.closed

    def leave(self, run_id: str, key: NodeKey, node_id: int) -> None:
        run = self._run(run_id)
        with self._cond:
            run.leave(key, node_id)
            self._advance(run_id, run)
            self._cond.notify_all()

    def set_closed(self, run_id: str) -> None:
        run = self._run(run_id)
        with self._cond:
            run.set_closed()
            self._save(run_id, run)
            self._cond.notify_all()
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
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every blocked call so it re-checks its state (e.g. its RPC was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    # -- internals ----------------------------------------------------------

    def _run(self, run_id: str) -> RoundStateMachine:
        with self._cond:
            run = self._runs.get(run_id)
        if run is None:
            raise ValueError(f"no rendezvous named {run_id!r}; join it first")
        return run

    def _advance(self, run_id: str, run: RoundStateMachine) -> None:
        """Apply time to a run (leases, last call); persist and wake waiters on a new round."""
        before = (run.number, run.joining_count)
        closed_round = run.advance(self._clock())
        if closed_round is not None:
            self._save(run_id, run)
            if self._on_round is not None:
                self._on_round(run_id, closed_round)
        if closed_round is not None or (run.number, run.joining_count) != before:
            self._cond.notify_all()

    def _sleep(self, run: RoundStateMachine, deadline: float, is_active: Callable) -> bool:
        """Wait for a change or the run's next deadline; False when the call should return."""
        now = self._clock()
        if now >= deadline or not is_active():
            return False
        wake_at = deadline
        next_deadline = run.next_deadline()
        if next_deadline is not None:
            wake_at = min(wake_at, next_deadline)
        # A tiny floor keeps a deadline that is due "now" from spinning on float rounding.
        self._cond.wait(max(wake_at - now, 0.001))
        return True

    def _save(self, run_id: str, run: RoundStateMachine) -> None:
        if self._store is None:
            return
        data = {"round": run.number, "closed": run.closed, "config": asdict(run.config)}
        self._store.put(TABLE, run_id, json.dumps(data).encode())


def _check_run_id(run_id: str) -> None:
    if not run_id or len(run_id) > MAX_RUN_ID_CHARS:
        raise ValueError(
            f"run_id must be 1 to {MAX_RUN_ID_CHARS} characters, got {run_id!r}; "
            "give every node of a job the same non-empty run id"
        )
