"""Simulated nodes of benchmarks/scale.py: asyncio gRPC clients, one connection per node.

Every node registers, then heartbeats at 1 Hz from its registration on; every worker, from the
common start, takes shards and steps at 10 steps/s, reporting progress per step or coalesced
(one report per second with its steps' count), on its stream or (an experiment) unary; coalesced
reports may carry the heartbeat (HeartbeatThread then calls only every few seconds).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from array import array
from dataclasses import dataclass

from master.client.heartbeat import CARRIED_FRESH_INTERVALS, COMMAND_POLL_SECONDS

HEARTBEAT_HZ = 1.0
STEPS_PER_S = 10.0
BATCH_SIZE = 64
RECORDS_PER_SHARD = BATCH_SIZE * 16
DATASET = "scale"
UNARY_KINDS = ("heartbeat", "get_shard")
# A connection per simulated node (by default gRPC shares one per process), keepalive as
# MasterClient sets it.
CHANNEL_OPTIONS = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


@dataclass(frozen=True)
class SimPlan:
    """What one simulator process runs."""

    addr: str
    token: str
    nodes: tuple[tuple[str, int, int], ...]  # (type, rank, id)
    silent_id: int  # the node that goes silent at the window's start (0: none here)
    warmup: float
    seconds: float
    coalesce_s: float  # 0: a progress message per step; else one per this many seconds
    unary: bool = False  # coalesced reports as unary calls instead of on a stream
    # Coalesced reports carry the worker's heartbeat, which then calls Heartbeat only when no
    # report did or every COMMAND_POLL_SECONDS for commands (as HeartbeatThread does).
    carried_beats: bool = False
    # Shard asks as messages on the node's ShardStream instead of unary GetShard calls.
    shard_stream: bool = False
    # The worker computes its shards' record indices (the master sends none); not simulated.
    indices_local: bool = False


# What the real clients retry (MasterClient._call) or survive (HeartbeatThread logs and beats on,
# ProgressStream reopens): a simulated node does the same, so a lost node measures the master.
RETRY_SECONDS = 60


class _Stats:
    """Latencies (seconds, of calls ending in the window) and counts of one process."""

    def __init__(self) -> None:
        self.latency = {k: array("d") for k in (*UNARY_KINDS, "stream_write")}
        self.call_errors: dict[str, int] = {}  # "kind: CODE" -> calls that failed (and went on)
        self.steps = 0  # steps taken in the window
        self.messages = 0  # progress messages sent in the window
        self.shards = 0  # shards whose last step was reported in the window
        self.late = array("d")  # how late each step started against its schedule
        self.drain = 0.0
        self.silent_last_beat = 0.0
        self.errors: list[str] = []
        self.registered = 0
        self.all_registered: asyncio.Event | None = None


class _Window:
    """The measured window of a simulator process, known once the parent gives the start."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.begin = self.end = float("inf")

    def open(self, start_at: float, warmup: float, seconds: float) -> None:
        self.begin = start_at + warmup
        self.end = self.begin + seconds
        self.started.set()


async def _sim_node(stub_cls, pb, plan: SimPlan, node, window: _Window, sem, stats) -> None:
    """One node: registers and heartbeats from then on (so no node looks lost while the others
    register); a worker starts taking shards and stepping at the common start."""
    import grpc

    from master.client import TOKEN_METADATA_KEY
    from master.client.master import RETRYABLE_CODES
    from master.client.progress import REOPEN_DELAY_SECONDS

    common_pb2, data_pb2, nodes_pb2 = pb
    node_type, rank, node_id = node
    md = ((TOKEN_METADATA_KEY, plan.token),)
    ref = common_pb2.NodeRef(type=node_type, rank=rank, id=node_id)
    channel = grpc.aio.insecure_channel(plan.addr, options=CHANNEL_OPTIONS)
    stub = stub_cls(channel)
    clock = time.monotonic
    silent = node_id == plan.silent_id
    upcoming = None
    stat = nodes_pb2.ResourceStats(cpu_percent=50.0, memory_rss_bytes=2**30)
    carried_at = float("-inf")  # when a progress report last carried this node's beat
    asks = [random.getrandbits(40)]

    def stop_at() -> float:  # the window's end; the silent node's silence starts with it
        return window.begin if silent else window.end

    def failed(kind: str, e: Exception) -> None:
        code = (
            f"{e.code().name} ({(e.details() or '')[:60]})"
            if isinstance(e, grpc.aio.AioRpcError)
            else type(e).__name__
        )
        key = f"{kind}: {code}"
        stats.call_errors[key] = stats.call_errors.get(key, 0) + 1

    def timed(kind: str, t0: float) -> None:
        t1 = clock()
        if window.begin <= t1 < window.end:
            stats.latency[kind].append(t1 - t0)

    async def heartbeats() -> None:
        request = nodes_pb2.HeartbeatRequest(node=ref, stats=stat)
        t = clock() + random.random() / HEARTBEAT_HZ
        called = float("-inf")
        while t < stop_at():
            await asyncio.sleep(max(0.0, t - clock()))
            t0 = clock()
            t += 1 / HEARTBEAT_HZ
            fresh = t0 - carried_at < CARRIED_FRESH_INTERVALS / HEARTBEAT_HZ
            if fresh and t0 - called < COMMAND_POLL_SECONDS:
                continue  # a progress report carried this second's beat
            called = t0
            try:
                await stub.Heartbeat(request, metadata=md, timeout=30)
            except grpc.aio.AioRpcError as e:
                failed("heartbeat", e)
                continue
            if silent:
                stats.silent_last_beat = t0
            timed("heartbeat", t0)

    shard_stream = [None]  # the open ShardStream call, in stream mode

    def unary(request):
        return stub.GetShard(request, metadata=md, timeout=30)

    async def ask_on_stream(request):
        if shard_stream[0] is None:
            shard_stream[0] = stub.ShardStream(metadata=md)
        call = shard_stream[0]
        await call.write(request)
        reply = await asyncio.wait_for(call.read(), 30)
        if reply is grpc.aio.EOF:
            raise RuntimeError("the master ended the shard stream")
        return reply

    async def get_shard():
        t0 = clock()
        asks[0] += 1  # one id per ask, the same for its retries (as MasterClient.get_shard)
        request = data_pb2.GetShardRequest(
            node=ref,
            dataset=DATASET,
            wait_ms=0,
            request_id=asks[0],
            indices_local=plan.indices_local,
        )
        delay = 0.05
        while True:
            try:
                reply = await (ask_on_stream(request) if plan.shard_stream else unary(request))
                break
            except grpc.aio.AioRpcError as e:
                failed("get_shard", e)
                shard_stream[0] = None  # a stream that failed is opened again
                if e.code() not in RETRYABLE_CODES or clock() - t0 > RETRY_SECONDS:
                    raise
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)
        timed("get_shard", t0)
        if reply.status != data_pb2.GetShardReply.SHARD:
            raise RuntimeError(f"GetShard answered status {reply.status}, not SHARD")
        return reply.shard

    async def write_or_reopen(call, request):
        """Write on the progress stream; one the master ended is reopened (as ProgressStream)."""
        for _ in range(int(RETRY_SECONDS / REOPEN_DELAY_SECONDS)):
            try:
                await call.write(request)
                return call
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                failed("stream", e)
                call.cancel()
                await asyncio.sleep(REOPEN_DELAY_SECONDS)
                call = stub.StreamProgress(metadata=md)
        raise RuntimeError("the progress stream could not be reopened")

    async def steps() -> None:
        nonlocal upcoming, carried_at
        await window.started.wait()
        begin, end = window.begin, window.end
        call = None if plan.unary else stub.StreamProgress(metadata=md)
        shard = await get_shard()
        step = 0
        done = 0  # records consumed in the current shard
        pending: dict[int, int] = {}  # shard id -> records consumed, not reported yet
        unsent = 0
        next_flush = begin - plan.warmup + random.random() * plan.coalesce_s
        t = begin - plan.warmup + random.random() / STEPS_PER_S
        while t < stop_at():
            now = clock()
            await asyncio.sleep(max(0.0, t - now))
            started = clock()
            size = shard.end - shard.start
            done = min(size, done + BATCH_SIZE)  # shards are of any size (paced by the master)
            step += 1
            pending[shard.shard_id] = done
            unsent += 1
            if started >= next_flush:  # per step, or once per interval when coalescing
                request = data_pb2.ReportProgressRequest(
                    node=ref,
                    dataset=DATASET,
                    reports=[
                        data_pb2.ProgressReport(shard_id=s, records_consumed=c)
                        for s, c in pending.items()
                    ],
                    global_step=step,
                )
                if plan.coalesce_s:
                    request.steps = unsent
                    if plan.carried_beats:
                        request.heartbeat_stats.CopyFrom(stat)
                pending.clear()
                unsent = 0
                next_flush = started + plan.coalesce_s
                if plan.unary:
                    await stub.ReportProgress(request, metadata=md, timeout=30)
                else:
                    call = await write_or_reopen(call, request)
                timed("stream_write", started)
                if request.HasField("heartbeat_stats"):
                    carried_at = clock()
                    if silent:
                        stats.silent_last_beat = started
                if begin <= started < end:
                    stats.messages += 1
            if begin <= started < end:
                stats.steps += 1
                stats.late.append(max(0.0, started - t))
            if done >= size - BATCH_SIZE and upcoming is None:
                upcoming = asyncio.ensure_future(get_shard())  # prefetch, a step ahead
            if done >= size:
                if begin <= started < end:
                    stats.shards += 1
                shard, upcoming = await upcoming, None
                done = 0
            t += 1 / STEPS_PER_S
        if silent:
            await asyncio.sleep(max(0.0, end - clock()))  # connected, silent, to the end
            if call is not None:
                call.cancel()
            return
        if upcoming is not None:
            await upcoming
        t0 = clock()
        if pending:
            reports = [
                data_pb2.ProgressReport(shard_id=s, records_consumed=c) for s, c in pending.items()
            ]
            last = data_pb2.ReportProgressRequest(node=ref, dataset=DATASET, reports=reports)
            if call is None:
                await stub.ReportProgress(last, metadata=md, timeout=30)
            else:
                call = await write_or_reopen(call, last)
        if call is not None:
            await call.done_writing()
            await call
        stats.drain = max(stats.drain, clock() - t0)

    try:
        async with sem:
            await stub.RegisterNode(
                nodes_pb2.RegisterRequest(node=ref, host="sim", pid=os.getpid()),
                metadata=md,
                timeout=60,
            )
        stats.registered += 1
        if stats.registered == len(plan.nodes):
            stats.all_registered.set()
        tasks = [heartbeats()]
        if node_type == "worker":
            tasks.append(steps())
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        pass
    except Exception as e:
        stats.errors.append(f"{node_type}-{rank}: {e!r}"[:300])
        stats.all_registered.set()  # a node that cannot register must not hang the start
    finally:
        if upcoming is not None:
            upcoming.cancel()
        await channel.close(grace=None)


async def _sim_run(conn, plan: SimPlan, stats: _Stats) -> None:
    from master.pb import common_pb2, data_pb2, master_pb2_grpc, nodes_pb2

    stats.all_registered = asyncio.Event()
    window = _Window()
    sem = asyncio.Semaphore(64)  # registrations under way at once
    pb = (common_pb2, data_pb2, nodes_pb2)
    nodes = asyncio.gather(
        *(
            _sim_node(master_pb2_grpc.MasterStub, pb, plan, n, window, sem, stats)
            for n in plan.nodes
        )
    )
    await stats.all_registered.wait()
    conn.send(("ready",))
    start_at = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    window.open(start_at, plan.warmup, plan.seconds)
    await nodes


def sim_main(conn, plan: SimPlan) -> None:
    """Entry of a simulator process: register its nodes, run them, send the figures."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="[sim] %(levelname)s %(message)s")
    from master.rpc.serving_gc import serving_gc

    stats = _Stats()
    try:
        # A few hundred nodes share this process: collected as the master is, so a full scan
        # of all their objects does not pause them together (and count as the master's latency).
        with serving_gc():
            asyncio.run(_sim_run(conn, plan, stats))
    except Exception as e:
        stats.errors.append(repr(e))
    conn.send(
        (
            "done",
            {
                "latency": {k: v.tobytes() for k, v in stats.latency.items()},
                "steps": stats.steps,
                "messages": stats.messages,
                "shards": stats.shards,
                "late": stats.late.tobytes(),
                "drain": stats.drain,
                "silent_last_beat": stats.silent_last_beat,
                "errors": stats.errors,
                "call_errors": stats.call_errors,
            },
        )
    )
