"""What the gRPC server itself costs per message: a synchronous `grpc.server` against a
`grpc.aio` server, both answering raw bytes with no handler work.

For each server kind and client count, clients (asyncio gRPC, a connection each, spread over
client processes) either make unary calls or write to a client stream, each client at a fixed
rate, for a measured window; the server's CPU time over the window divided by the messages it
answered is its cost per message. Prints a table and the aio/sync ratio of each row.

    python benchmarks/grpc_echo.py --clients 64 1000 --rate 3 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time

from common import cpu_seconds

UNARY = "/echo.Echo/Unary"
STREAM = "/echo.Echo/Stream"
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


def _identity(b: bytes) -> bytes:
    return b


def _sync_server(conn, threads: int) -> None:
    from concurrent import futures

    import grpc

    def unary(request: bytes, context) -> bytes:
        return request

    def stream(requests, context) -> bytes:
        n = 0
        for _ in requests:
            n += 1
        return n.to_bytes(8, "little")

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
        "Stream": grpc.stream_unary_rpc_method_handler(stream, _identity, _identity),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    conn.recv()  # "stop"
    server.stop(0)


def _aio_server(conn, threads: int) -> None:
    import grpc

    async def unary(request: bytes, context) -> bytes:
        return request

    async def stream(requests, context) -> bytes:
        n = 0
        async for _ in requests:
            n += 1
        return n.to_bytes(8, "little")

    async def main() -> None:
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
            "Stream": grpc.stream_unary_rpc_method_handler(stream, _identity, _identity),
        }
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("echo.Echo", handlers),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(0)

    asyncio.run(main())


def _clients(conn, port: int, n: int, mode: str, rate: float, warmup: float, seconds: float):
    import grpc

    async def one(i: int, t0: float, counts: list[int]) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            await ch.channel_ready()
            period = 1.0 / rate
            nxt = t0 + (i / n) * period
            end = t0 + warmup + seconds
            if mode == "unary":
                call = ch.unary_unary(UNARY, _identity, _identity)
                while True:
                    await asyncio.sleep(max(0.0, nxt - time.monotonic()))
                    if time.monotonic() >= end:
                        return
                    await call(b"x" * 32)
                    if time.monotonic() >= t0 + warmup:
                        counts[0] += 1
                    nxt += period
            else:
                queue: asyncio.Queue = asyncio.Queue()

                async def gen():
                    while True:
                        item = await queue.get()
                        if item is None:
                            return
                        yield item

                call = ch.stream_unary(STREAM, _identity, _identity)(gen())
                while True:
                    await asyncio.sleep(max(0.0, nxt - time.monotonic()))
                    if time.monotonic() >= end:
                        break
                    await queue.put(b"x" * 32)
                    if time.monotonic() >= t0 + warmup:
                        counts[0] += 1
                    nxt += period
                await queue.put(None)
                await call

    async def main() -> None:
        counts = [0]
        t0 = time.monotonic() + 2.0
        await asyncio.gather(*(one(i, t0, counts) for i in range(n)))
        conn.send(counts[0])

    asyncio.run(main())


def run(kind: str, clients: int, mode: str, rate: float, seconds: float, procs: int) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = _sync_server if kind == "sync" else _aio_server
    server = ctx.Process(target=target, args=(child, max(64, clients + 16)), daemon=True)
    server.start()
    port = parent.recv()
    warmup = 3.0
    pipes, workers = [], []
    for p in range(procs):
        n = clients // procs + (1 if p < clients % procs else 0)
        a, b = ctx.Pipe()
        w = ctx.Process(target=_clients, args=(b, port, n, mode, rate, warmup, seconds))
        w.start()
        pipes.append(a)
        workers.append(w)
    time.sleep(2.0 + warmup)  # the clients start 2 s after they are up; roughly aligned
    c0, t0 = cpu_seconds(server.pid), time.monotonic()
    time.sleep(seconds)
    c1, t1 = cpu_seconds(server.pid), time.monotonic()
    messages = sum(p.recv() for p in pipes)
    for w in workers:
        w.join()
    parent.send("stop")
    server.join(10)
    cpu = c1 - c0
    return {
        "kind": kind,
        "mode": mode,
        "clients": clients,
        "messages_per_s": messages / seconds,
        "server_cores": cpu / (t1 - t0),
        "cpu_us_per_message": 1e6 * cpu / max(1, messages),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[64, 1000])
    ap.add_argument("--rate", type=float, default=3.0, help="messages per client per second")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--modes", nargs="+", default=["unary", "stream"])
    args = ap.parse_args()
    print(f"# {time.strftime('%H:%M:%S')} load {os.getloadavg()}", flush=True)
    print(
        f"{'mode':>6} {'clients':>7} | {'sync msg/s':>10} {'cores':>5} {'us/msg':>6} | "
        f"{'aio msg/s':>9} {'cores':>5} {'us/msg':>6} | aio/sync"
    )
    for mode in args.modes:
        for n in args.clients:
            s = run("sync", n, mode, args.rate, args.seconds, args.procs)
            a = run("aio", n, mode, args.rate, args.seconds, args.procs)
            print(
                f"{mode:>6} {n:>7} | {s['messages_per_s']:>10,.0f} {s['server_cores']:>5.2f} "
                f"{s['cpu_us_per_message']:>6.0f} | {a['messages_per_s']:>9,.0f} "
                f"{a['server_cores']:>5.2f} {a['cpu_us_per_message']:>6.0f} | "
                f"{a['cpu_us_per_message'] / s['cpu_us_per_message']:.2f}",
                flush=True,
            )
    print(f"# {time.strftime('%H:%M:%S')} load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
