"""How a busy event loop slows a `grpc.aio` server's unary calls, against messages on open streams.

The master answers its hot calls on one event loop, so at 1,000 nodes the loop is busy a large
part of the time. This measures what that does to the two ways a node can ask the master for
something: a unary call each time (how `GetShard` is asked today), or a message on a
long-lived bidirectional stream, answered on the same stream (ping-pong).

One server process (`grpc.aio`, raw bytes, no handler work) and one client process (asyncio
gRPC, 64 requests in flight over 16 connections). The server's loop is either idle, or kept
busy by a task that blocks it for `--slice-ms` at a time and then yields (`--block sleep`
blocks without holding the GIL, `--block spin` holds it): a stand-in for the handler work of
other calls. Each case runs for `--seconds`; the idle case is the baseline of the same run.

    python benchmarks/aio_busy_loop.py [--seconds 4] [--slice-ms 0.5] [--block sleep]

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time

from common import percentile

SERVICE = "bench.Busy"
UNARY = f"/{SERVICE}/Unary"
PINGPONG = f"/{SERVICE}/PingPong"
CONNECTIONS = 16
IN_FLIGHT = 64
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)  # a connection per channel


def _server_main(conn, slice_s: float, block: str) -> None:
    """Serve Unary and PingPong; with slice_s > 0 keep the loop blocked slice_s at a time."""
    import grpc

    async def unary(request: bytes, context) -> bytes:
        return request

    async def pingpong(requests, context):
        async for request in requests:
            yield request

    async def keep_busy() -> None:
        while True:
            if block == "sleep":
                time.sleep(slice_s)  # blocks the loop, GIL released
            else:
                end = time.perf_counter() + slice_s
                while time.perf_counter() < end:  # blocks the loop, GIL held
                    pass
            await asyncio.sleep(0)

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Unary": grpc.unary_unary_rpc_method_handler(unary),
                        "PingPong": grpc.stream_stream_rpc_method_handler(pingpong),
                    },
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        busy = asyncio.get_running_loop().create_task(keep_busy()) if slice_s > 0 else None
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        if busy is not None:
            busy.cancel()
        await server.stop(0)

    asyncio.run(serve())


def _client_main(conn, port: int, kind: str, seconds: float) -> None:
    """IN_FLIGHT requests at a time for `seconds`; sends (requests/s, latencies in ms)."""
    import grpc

    async def run() -> tuple[float, list[float]]:
        channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
            for _ in range(CONNECTIONS)
        ]
        for c in channels:
            await c.channel_ready()
        latencies: list[float] = []
        end = time.monotonic() + seconds

        async def by_unary(channel) -> None:
            call = channel.unary_unary(UNARY)
            while time.monotonic() < end:
                t = time.perf_counter()
                await call(b"ask")
                latencies.append((time.perf_counter() - t) * 1000)

        async def by_stream(channel) -> None:
            stream = channel.stream_stream(PINGPONG)()
            while time.monotonic() < end:
                t = time.perf_counter()
                await stream.write(b"ask")
                await stream.read()
                latencies.append((time.perf_counter() - t) * 1000)
            await stream.done_writing()

        asker = by_unary if kind == "unary" else by_stream
        started = time.monotonic()
        await asyncio.gather(*(asker(channels[i % CONNECTIONS]) for i in range(IN_FLIGHT)))
        elapsed = time.monotonic() - started
        for c in channels:
            await c.close()
        return len(latencies) / elapsed, latencies

    conn.send(asyncio.run(run()))


def measure(kind: str, slice_s: float, block: str, seconds: float) -> dict:
    """One case: a fresh server and client; the client's requests/s and latency percentiles."""
    ctx = mp.get_context("spawn")
    server_end, server_conn = ctx.Pipe()
    server = ctx.Process(target=_server_main, args=(server_conn, slice_s, block), daemon=True)
    server.start()
    try:
        port = server_end.recv()
        client_end, client_conn = ctx.Pipe()
        client = ctx.Process(target=_client_main, args=(client_conn, port, kind, seconds))
        client.start()
        rate, latencies = client_end.recv()
        client.join()
    finally:
        server_end.send("stop")
        server.join(10)
    ordered = sorted(latencies)
    return {
        "kind": kind,
        "loop": f"busy {slice_s * 1000:g} ms slices ({block})" if slice_s > 0 else "idle",
        "requests_per_s": round(rate, 1),
        "p50_ms": round(percentile(ordered, 50), 2),
        "p99_ms": round(percentile(ordered, 99), 2),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0, help="measured time per case")
    p.add_argument("--slice-ms", type=float, default=0.5, help="how long the loop is blocked")
    p.add_argument("--block", choices=("sleep", "spin"), default="sleep")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.slice_ms <= 0:
        p.error("--seconds and --slice-ms must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    slice_s = args.slice_ms / 1000
    rows = [
        measure(kind, s, args.block, args.seconds)
        for s in (0.0, slice_s)
        for kind in ("unary", "stream")
    ]
    print(f"{IN_FLIGHT} requests in flight, {CONNECTIONS} connections, {args.seconds:g} s a case")
    header = ("asked by", "server loop", "req/s", "p50 ms", "p99 ms")
    print("{:>8} | {:<28} | {:>8} | {:>8} | {:>8} | vs idle".format(*header))
    idle = {r["kind"]: r["requests_per_s"] for r in rows if r["loop"] == "idle"}
    for r in rows:
        share = r["requests_per_s"] / idle[r["kind"]] if idle[r["kind"]] else float("nan")
        print(
            f"{r['kind']:>8} | {r['loop']:<28} | {r['requests_per_s']:>8,.0f} | "
            f"{r['p50_ms']:>8.1f} | {r['p99_ms']:>8.1f} | {share:.2f}x"
        )
    busy = {r["kind"]: r["requests_per_s"] for r in rows if r["loop"] != "idle"}
    ratio = busy["stream"] / busy["unary"] if busy["unary"] else None
    print(f"busy loop: {ratio:.1f}x as many answers by messages on open streams as by unary calls")
    print(json.dumps({"benchmark": "aio_busy_loop", "rows": rows, "busy_stream_to_unary": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
