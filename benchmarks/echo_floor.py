"""The latency floor of the master's message mix: a `grpc.aio` server that does no work.

A `grpc.aio` echo server (K servers sharing one port with SO_REUSEPORT when K > 1; options as
the master's: keepalive pings allowed every second) and N clients, a connection each (2 s
keepalive pings, as `MasterClient`), spread over client processes (`PROCS`, default 4). Each
client writes one message a second on an open client stream (a coalesced progress report) and
makes unary calls at `UNARY_RATE` a second (default 1.4; the master's mix at 1,000 workers is
about 0.43: paced shard asks and command polls), each call waiting for the previous one. After
3 s of warm-up it prints the unary calls' rate and latency percentiles, the stream messages a
second, and the server's and the clients' CPU in cores: what no handler work at all gives on
this machine, to set the master's figures of `benchmarks/scale.py` against.

    python benchmarks/echo_floor.py K N SECONDS STREAMS(0|1) WORK_US
    UNARY_RATE=0.43 python benchmarks/echo_floor.py 1 1000 15 1 0
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import socket
import sys
import time

from common import percentile

WARMUP_S = 3.0
SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]
CLIENT_OPTIONS = (
    ("grpc.use_local_subchannel_pool", 1),  # a connection per client
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
)


def _spin(work_us: float) -> None:
    end = time.perf_counter() + work_us / 1e6
    while time.perf_counter() < end:
        pass


def server_main(conn, k: int, work_us: float) -> None:
    """Serve /e.E/U (unary echo) and /e.E/S (a client stream) on k servers sharing a port."""
    import grpc

    async def unary(request: bytes, context) -> bytes:
        if work_us:
            _spin(work_us)
        return request

    async def stream(requests, context) -> bytes:
        async for _ in requests:
            if work_us:
                _spin(work_us)
        return b""

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(
            "e.E",
            {
                "U": grpc.unary_unary_rpc_method_handler(unary),
                "S": grpc.stream_unary_rpc_method_handler(stream),
            },
        )
        port = 0
        if k > 1:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        servers = []
        for _ in range(k):
            server = grpc.aio.server(options=[("grpc.so_reuseport", int(k > 1)), *SERVER_OPTIONS])
            server.add_generic_rpc_handlers((handler,))
            port = server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            servers.append(server)
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop

    asyncio.run(main())


def client_main(conn, port: int, n: int, seconds: float, streams: bool) -> None:
    """n clients for `seconds`; sends (unary latencies after the warm-up, stream messages)."""
    import grpc

    unary_rate = float(os.environ.get("UNARY_RATE", 1.4))

    async def main() -> None:
        channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS) for _ in range(n)
        ]
        for c in channels:
            await c.channel_ready()
        latencies: list[float] = []
        sent = [0]
        start = time.monotonic() + 1
        end = start + seconds

        async def one(channel) -> None:
            call_unary = channel.unary_unary("/e.E/U")

            async def calls() -> None:
                t = start + random.random()
                while t < end:
                    await asyncio.sleep(max(0.0, t - time.monotonic()))
                    t0 = time.monotonic()
                    t += 1 / unary_rate
                    await call_unary(b"x" * 100, timeout=60)
                    if t0 > start + WARMUP_S:
                        latencies.append(time.monotonic() - t0)

            async def stream() -> None:
                call = channel.stream_unary("/e.E/S")()
                t = start + random.random()
                while t < end:
                    await asyncio.sleep(max(0.0, t - time.monotonic()))
                    t += 1.0
                    await call.write(b"y" * 200)
                    sent[0] += 1
                await call.done_writing()
                await call

            await asyncio.gather(calls(), *([stream()] if streams else []))

        await asyncio.gather(*(one(c) for c in channels))
        conn.send((latencies, sent[0]))

    asyncio.run(main())


def run(k: int, n: int, seconds: float, streams: bool, work_us: float, procs: int) -> None:
    import psutil

    ctx = mp.get_context("spawn")
    server_end, server_conn = ctx.Pipe()
    server = ctx.Process(target=server_main, args=(server_conn, k, work_us), daemon=True)
    server.start()
    port = server_end.recv()
    clients = []
    for _ in range(procs):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(
            target=client_main, args=(theirs, port, n // procs, seconds, streams), daemon=True
        )
        p.start()
        clients.append((mine, p))
    time.sleep(WARMUP_S)
    server_ps = psutil.Process(server.pid)
    client_ps = [psutil.Process(p.pid) for _, p in clients]

    def cpu() -> tuple[float, float]:
        return (
            sum(server_ps.cpu_times()[:2]),
            sum(sum(c.cpu_times()[:2]) for c in client_ps),
        )

    (s0, c0), t0 = cpu(), time.monotonic()
    time.sleep(seconds - 4)
    (s1, c1), t1 = cpu(), time.monotonic()
    results = [mine.recv() for mine, _ in clients]
    server_end.send("stop")
    latencies = sorted(x for r in results for x in r[0])
    sent = sum(r[1] for r in results)
    p50, p99 = (percentile(latencies, q) * 1000 for q in (50, 99))
    print(
        f"K={k} N={n} streams={streams} work={work_us}us: unary "
        f"{len(latencies) / (seconds - WARMUP_S):.0f}/s p50 {p50:.1f} ms p99 {p99:.1f} ms; "
        f"stream msgs {sent / seconds:.0f}/s; server {(s1 - s0) / (t1 - t0):.2f} cores, "
        f"clients {(c1 - c0) / (t1 - t0):.2f}",
        flush=True,
    )


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    run(
        int(sys.argv[1]),
        int(sys.argv[2]),
        float(sys.argv[3]),
        sys.argv[4] == "1",
        float(sys.argv[5]),
        int(os.environ.get("PROCS", 4)),
    )
