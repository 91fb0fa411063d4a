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
that ledger waits a little: until nine tenths as many changes as the last one covered have
been made, or `WRITE_SPACING_SECONDS` after the last one began, whichever comes first. Each
write then covers more changes, and the fixed cost of a write is paid fewer times (the
transaction, the writer taking the interpreter lock back from the loop after each statement,
the loop woken to answer its waiters). Nodes that ask back to back, each waiting for its
answer, are not held back: their changes reach the count at once. A ledger whose writes cover
a change or two is written at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from master.sharding.service import ShardingService

log = logging.getLogger(__name__)

# Measured at 64 clients (benchmarks/sharding.py, 2026-11-28): the master's CPU per round trip
# fell as the spacing grew (6 ms: 11% less than writes back to back, 20 ms: 20%); without the
# count, a spacing of 6 ms held 4 clients to 4 shards per 6 ms.
WRITE_SPACING_SECONDS = 0.02
SPACE_AFTER_CHANGES = 4
BATCH_SHARE = 0.9  # of the last write's changes: the count that starts the next write early


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
        self._wanted: dict[Any, int] = {}  # per ledger entry: the version `soon` asked for
        # Per busy ledger entry (its last write covered `space_after` changes or more): when its
        # next write starts at the latest, and the changes that start it sooner.
        self._busy: dict[Any, tuple[float, int]] = {}
        self._sleeping: Any = None  # the entry whose write waits for its batch or spacing
        self._wake = threading.Event()  # set by the loop once that batch is there

    async def durable(self, pending: list[tuple[Any, int]]) -> None:
        """Return once every (entry, version) is stored; raises what a failed write raised."""
        for entry, version in pending:
            self._nudge(entry)
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
            self._nudge(entry)
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

    def _nudge(self, entry: Any) -> None:
        """On the loop, after a change: start a waiting write whose batch is complete."""
        busy = self._busy.get(entry)
        if self._sleeping is entry and busy and entry.version - entry.durable >= busy[1]:
            self._wake.set()

    def _write(self, entry: Any) -> None:
        """In the writer thread: store the ledger as it is once its batch is there or its
        spacing has passed (so with every change made meanwhile)."""
        deadline, batch = self._busy.get(entry, (0.0, 0))
        while (delay := deadline - time.monotonic()) > 0:
            self._sleeping = entry  # before the check: a change made after it wakes us
            if entry.version - entry.durable >= batch:
                break
            self._wake.wait(delay)
            self._wake.clear()
        self._sleeping = None
        started = time.monotonic()
        before = entry.durable
        self._sharding.commit(entry)
        covered = entry.durable - before
        if covered >= self._space_after:
            batch = max(self._space_after, int(covered * BATCH_SHARE))
            self._busy[entry] = (started + self._spacing, batch)
        else:
            self._busy.pop(entry, None)

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
