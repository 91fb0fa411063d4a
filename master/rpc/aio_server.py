"""The master's services on a `grpc.aio` server (`rpc_server: aio`).

The calls every node makes all the time (heartbeats, shard asks alone or on a node's shard
stream, progress stream messages) run on the server's event loop: their handler work is short
and in memory (a shard's grant or end is one state-store write), so they cost no hand-off
between a polling thread and a pool thread and hold no thread per open stream. Every other
call, and a shard ask that must wait, runs the sync servicer's method in a thread pool, as the
sync server does."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent import futures
from concurrent.futures import Future

import grpc

from master.client.tls import ServerTLS
from master.job.master import JobMaster
from master.pb import data_pb2
from master.rpc.aio_blocking import AioKVServicer, AioRendezvousServicer
from master.rpc.guard import MAX_WAIT_MS, answer_error
from master.rpc.ratelimit import DEFAULT_RATE_PER_SECOND, RateLimitInterceptor, TokenBuckets
from master.rpc.rewrap import InterceptedHandlers
from master.rpc.server import (
    MasterServicer,
    ProgressStreamState,
    TokenInterceptor,
    add_services,
    bind_port,
    server_options,
)
from master.sharding.group_commit import GroupCommitter

log = logging.getLogger(__name__)

START_TIMEOUT_SECONDS = 30.0


class AioMasterServicer(MasterServicer):
    """The Master service with its hot calls as coroutines on the event loop."""

    def __init__(self, job: JobMaster, heartbeat_interval_ms: int) -> None:
        super().__init__(job, heartbeat_interval_ms)
        self.commits = GroupCommitter(job.sharding)

    async def _inline(self, method: Callable, request: object, context: grpc.ServicerContext):
        """Run the sync servicer's `method` (unguarded: its body never uses the context) here,
        its ledger writes group-committed before it answers (what it changed before failing
        too); domain errors become statuses."""
        result = error = None
        with self.job.sharding.deferred_commits() as pending:
            try:
                result = method(self, request, context)
            except Exception as e:
                error = e
        try:
            if pending:
                await self.commits.durable(pending)
            if error is not None:
                raise error
        except Exception as e:
            await answer_error(context, e)
        return result

    async def Heartbeat(self, request, context):  # noqa: N802
        return await self._inline(MasterServicer.Heartbeat.__wrapped__, request, context)

    async def GetShard(self, request, context):  # noqa: N802
        if not 0 < request.wait_ms <= MAX_WAIT_MS:  # no wait, or refused as out of range
            return await self._inline(MasterServicer.GetShard.__wrapped__, request, context)
        # First without waiting (the common case: a shard is there); only a wait takes a thread.
        now = data_pb2.GetShardRequest()
        now.CopyFrom(request)
        now.wait_ms = 0
        reply = await self._inline(MasterServicer.GetShard.__wrapped__, now, context)
        if reply.status != data_pb2.GetShardReply.PENDING:
            return reply
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                None, MasterServicer.GetShard.__wrapped__, self, request, context
            )
        except Exception as e:
            await answer_error(context, e)

    async def ShardStream(self, request_iterator: AsyncIterator, context):  # noqa: N802
        async for request in request_iterator:
            yield await self.GetShard(request, context)

    async def StreamProgress(self, request_iterator: AsyncIterator, context):  # noqa: N802
        stream = ProgressStreamState(self)
        sharding = self.job.sharding
        written: dict = {}  # per ledger entry: the latest version this stream changed
        try:
            failure: Exception | None = None
            try:
                # No message is acknowledged: each one's ledger changes go to the next group
                # write, and the stream reads on meanwhile; its reply waits for them all.
                async for request in request_iterator:
                    with sharding.deferred_commits() as pending:
                        stream.apply(request)  # what it changed before failing is written too
                    if pending:
                        self.commits.soon(pending)
                        written.update(pending)
            except Exception as e:
                failure = e
            await self.commits.durable(list(written.items()))
            if failure is not None:
                raise failure
        except Exception as e:
            await answer_error(context, e)
        finally:
            stream.close()
        return stream.reply()


class AioServer:
    """A running aio server on its own event-loop thread, stopped as a sync server is:
    `stop(grace)` returns something whose `wait()` returns once it has stopped."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None

    def run(self, build: Callable[[], grpc.aio.Server], pool_threads: int) -> None:
        """Start the loop thread and the server `build` makes on it; raises what building or
        starting raised."""
        started: Future = Future()

        async def start() -> None:
            self.server = build()
            await self.server.start()

        def loop_thread() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.set_default_executor(
                futures.ThreadPoolExecutor(pool_threads, thread_name_prefix="rpc-wait")
            )
            try:
                self.loop.run_until_complete(start())
            except BaseException as e:
                started.set_exception(e)
                return
            started.set_result(None)
            self.loop.run_forever()  # until stop() has stopped the server

        self._thread = threading.Thread(target=loop_thread, name="rpc-loop", daemon=True)
        self._thread.start()
        started.result(START_TIMEOUT_SECONDS)

    def stop(self, grace: float | None) -> _Waitable:
        """Stop the server (calls still running get `grace` seconds), then its loop."""
        assert self.server is not None
        stopped = asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop)
        stopped.add_done_callback(lambda _: self.loop.call_soon_threadsafe(self.loop.stop))
        return _Waitable(stopped)


class _Waitable:
    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.result(timeout)
        except futures.TimeoutError:
            return False
        return True


def start_aio_server(
    job: JobMaster,
    host: str,
    port: int,
    token: str,
    max_workers: int,
    heartbeat_interval_ms: int,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: ServerTLS | None = None,
    requests_per_second: float = DEFAULT_RATE_PER_SECOND,
) -> tuple[AioServer, int]:
    """`master.rpc.server.start_server` on a `grpc.aio` server: the same services, checks and
    interceptors (sync interceptors built on `rewrap`); `max_workers` threads run the calls
    that do not run on the event loop."""
    buckets = TokenBuckets(requests_per_second, 2 * requests_per_second)
    handle = AioServer()
    bound = [0]

    def build() -> grpc.aio.Server:
        # The interceptors run when a call's handler is looked up, not as aio interceptors.
        services = InterceptedHandlers(
            [*interceptors, RateLimitInterceptor(buckets), TokenInterceptor(token)]
        )
        add_services(
            services,
            AioMasterServicer(job, heartbeat_interval_ms),
            AioKVServicer,
            AioRendezvousServicer,
        )
        server = grpc.aio.server(
            migration_thread_pool=futures.ThreadPoolExecutor(
                max_workers=max_workers, thread_name_prefix="rpc"
            ),
            handlers=[services],
            options=server_options(max_workers),
        )
        bound[0] = bind_port(server, host, port, tls)
        return server

    handle.run(build, max_workers)
    log.info("master listening on %s:%d (grpc.aio)%s", host, bound[0], " (TLS)" if tls else "")
    return handle, bound[0]
