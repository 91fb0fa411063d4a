"""Ledger durability for calls answered on an event loop: group commit in a writer thread.

The aio server answers shard asks and progress messages on its loop, one at a time, so each
would pay a state-store transaction of its own. Instead a call's grant or shard end waits here
(`ShardingService.deferred_commits` collects them): one write at a time runs in a thread of
its own, each storing the ledger as it then is, so it covers every change made before it
began, and the loop answers other calls meanwhile. A node hears of its grant only once the
store holds it (`durable`). A progress stream's messages are not acknowledged one by one: their
changes go to the next write (`soon`) while the stream reads on, and its reply waits for them
all; a master that dies first learns them again from the node, which re-sends its latest
progress on its next stream.

When the calls come fast (a write covered `SPACE_AFTER_CHANGES` or more), the next write of
that ledger starts `WRITE_SPACING_SECONDS` after the last one began, not at once: each then
covers more changes, and the fixed cost of a write is paid fewer times (the transaction, the
writer taking the interpreter lock back from the loop after each statement, the loop woken to
answer its waiters). A ledger whose writes cover a change or two (a few nodes) is written at
once, so one node's shard asks are never slowed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from master.sharding.service import ShardingService

log = logging.getLogger(__name__)

# Measured at 64 clients (benchmarks/sharding.py, 2026-11-28): 6 ms cut the master's CPU per
# round trip by 11% (at 16 clients 23%) against writes back to back; 2 ms by 4%.
WRITE_SPACING_SECONDS = 0.006
SPACE_AFTER_CHANGES = 4


class GroupCommitter:
    """Waits, on the event loop, until deferred ledger changes are in the state store."""

    def __init__(
        self,
        sharding: ShardingService,
        spacing_seconds: float = WRITE_SPACING_SECONDS,
        space_after: int = SPACE_AFTER_CHANGES,
    ) -> None:
        self._sharding = sharding
        self._spacing = spacing_seconds
        self._space_after = space_after
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ledger-write")
        self._writing: dict[Any, asyncio.Future] = {}  # per ledger entry: the write running
        # Per ledger entry, used by the writer thread only: when its next write may start.
        self._next_start: dict[Any, float] = {}
        self._wanted: dict[Any, int] = {}  # per ledger entry: the version `soon` asked for

    async def durable(self, pending: list[tuple[Any, int]]) -> None:
        """Return once every (entry, version) is stored; raises what a failed write raised."""
        for entry, version in pending:
            while entry.durable < version:
                write = self._writing.get(entry)
                # A write done but not yet forgotten (its callback has not run) covered older
                # changes only: awaiting it again would return at once, never yielding.
                if write is None or write.done():
                    write = self._start(entry)
                # A waiter whose call is cancelled must not cancel the write others wait on.
                await asyncio.shield(write)

    def soon(self, pending: list[tuple[Any, int]]) -> None:
        """Have every (entry, version) stored by the write running or the next one, without
        waiting. A failed write is logged, and retried by the next write or the ledger's
        periodic flush."""
        for entry, version in pending:
            if entry.durable >= version:
                continue
            if self._wanted.get(entry, 0) < version:
                self._wanted[entry] = version
            write = self._writing.get(entry)
            if write is None or write.done():
                self._start(entry)

    def _start(self, entry: Any) -> asyncio.Future:
        write = asyncio.get_running_loop().run_in_executor(self._pool, self._write, entry)
        self._writing[entry] = write
        # Registered before any waiter's wake-up: runs first when it is done.
        write.add_done_callback(lambda f, e=entry: self._finished(e, f))
        return write

    def _write(self, entry: Any) -> None:
        """In the writer thread: store the ledger as it is once its spacing has passed (so
        with every change made meanwhile)."""
        delay = self._next_start.get(entry, 0.0) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        started = time.monotonic()
        before = entry.durable
        self._sharding.commit(entry)
        busy = entry.durable - before >= self._space_after
        self._next_start[entry] = started + self._spacing if busy else 0.0

    def _finished(self, entry: Any, write: asyncio.Future) -> None:
        if self._writing.get(entry) is write:
            del self._writing[entry]
        if write.cancelled():
            return
        error = write.exception()  # retrieved: each waiter raises it
        if error is not None:
            if self._wanted.get(entry, 0) > entry.durable:
                log.warning("a shard ledger write failed (retried by the next one): %s", error)
        elif self._wanted.get(entry, 0) > entry.durable and entry not in self._writing:
            self._start(entry)  # changes made while it ran, that nobody waits for

    def close(self) -> None:
        self._pool.shutdown(wait=True)
