"""Ledger durability for calls answered on an event loop: group commit in a writer thread.

The aio server answers shard asks and progress messages on its loop, one at a time, so each
would pay a state-store transaction of its own. Instead a call's grant or shard end waits here
(`ShardingService.deferred_commits` collects them): one write at a time runs in a thread of
its own, each storing the ledger as it then is, so it covers every change made before it
began, and the loop answers other calls meanwhile. A node still hears of its grant, or moves
past its shard's end, only once the store holds it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from master.sharding.service import ShardingService


class GroupCommitter:
    """Waits, on the event loop, until deferred ledger changes are in the state store."""

    def __init__(self, sharding: ShardingService) -> None:
        self._sharding = sharding
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ledger-write")
        self._writing: dict[Any, asyncio.Future] = {}  # per ledger entry: the write running

    async def durable(self, pending: list[tuple[Any, int]]) -> None:
        """Return once every (entry, version) is stored; raises what a failed write raised."""
        for entry, version in pending:
            while entry.durable < version:
                write = self._writing.get(entry)
                # A write done but not yet forgotten (its callback has not run) covered older
                # changes only: awaiting it again would return at once, never yielding.
                if write is None or write.done():
                    write = asyncio.get_running_loop().run_in_executor(
                        self._pool, self._sharding.commit, entry
                    )
                    self._writing[entry] = write
                    # Registered before any waiter's wake-up: runs first when it is done.
                    write.add_done_callback(lambda f, e=entry: self._finished(e, f))
                # A waiter whose call is cancelled must not cancel the write others wait on.
                await asyncio.shield(write)

    def _finished(self, entry: Any, write: asyncio.Future) -> None:
        if self._writing.get(entry) is write:
            del self._writing[entry]
        if not write.cancelled():
            write.exception()  # retrieved: each waiter raises it; nobody must log it as lost

    def close(self) -> None:
        self._pool.shutdown(wait=True)
