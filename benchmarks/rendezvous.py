"""Rendezvous completion time: the master's rounds vs torch's c10d dynamic rendezvous.

N simulated nodes (threads of this process) call `next_rendezvous()` at one common instant; the
completion time is from that instant until the last node has its RendezvousInfo (rank, world
size, store, MASTER_ADDR/MASTER_PORT for the workers). min_nodes = max_nodes = N, so a round
closes as soon as every node joined and no last-call window is waited out.

- **master**: `MasterRendezvousHandler` per node (its own `MasterClient`, node identity
  worker-i), against a standalone master (`master.rpc.standalone`) in its own process.
- **torch c10d**: torch's `DynamicRendezvousHandler` per node with a `C10dRendezvousBackend` on
  its own `TCPStore` client; the TCPStore server (C++, libuv) runs in this process. Rendezvous
  store sharing is off (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, as DESIGN.md recommends), so both
  sides publish a fresh MASTER_ADDR/MASTER_PORT through their store.

    python benchmarks/rendezvous.py [--nodes 2,4,...,256] [--repeats 3] [--json-only]

Prints a table (median over repeats), then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from common import use_checkout

use_checkout()
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (  # noqa: E402
    C10dRendezvousBackend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from dlrover_torch.rendezvous import MasterRendezvousHandler  # noqa: E402
from master.client import KVClient, MasterClient, NodeIdentity, RendezvousClient  # noqa: E402

log = logging.getLogger("bench.rendezvous")

DEFAULT_NODES = (2, 4, 8, 16, 32, 64, 128, 256)
JOIN_TIMEOUT_S = 120.0
# torch's c10d rendezvous of many nodes in one process can take minutes: it is given this long
# (--torch-timeout), and a size it cannot finish in time is reported as timed out.
TORCH_TIMEOUT_S = 25.0
CONNECT_THREADS = 32
SMALL_N = 64  # sizes up to this are repeated --repeats times, larger ones --large-repeats
LAST_CALL_S = 1.0  # never waited out: min_nodes = max_nodes, a round closes when all joined
SERVER_START_TIMEOUT_S = 60.0
MASTER_RPC_THREADS = 2048


# -- the master, in its own process -----------------------------------------------------------


def _serve_master(conn) -> None:
    from master.rpc.standalone import start_standalone_master

    logging.basicConfig(level=logging.WARNING)
    server, port, token = start_standalone_master(max_workers=MASTER_RPC_THREADS)
    conn.send((port, token))
    conn.recv()  # run until the parent says stop
    server.stop(grace=0).wait()


# -- one measurement ----------------------------------------------------------------------------


def _run_round(handlers: list, limit_s: float = JOIN_TIMEOUT_S) -> float:
    """Seconds from a common start until every handler's next_rendezvous() has returned."""
    n = len(handlers)
    start: list[float] = []
    finished: list[float] = [0.0] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n, action=lambda: start.append(time.perf_counter()))

    def node(i: int) -> None:
        barrier.wait()
        try:
            info = handlers[i].next_rendezvous()
            finished[i] = time.perf_counter()
            if info.world_size != n:
                raise RuntimeError(f"node {i}: world size {info.world_size}, expected {n}")
        except BaseException as e:  # reported below: one failed node fails the measurement
            errors.append(e)

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s + 30)
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} nodes failed; first: {errors[0]!r}")
    return max(finished) - start[0]


def measure_master(addr: str, token: str, n: int, tag: str) -> float:
    clients = [MasterClient(addr, token, NodeIdentity("worker", i, i + 1)) for i in range(n)]
    handlers = [
        MasterRendezvousHandler(
            RendezvousClient(c),
            KVClient(c),
            run_id=f"bench-{tag}",
            node_rank_hint=i,
            local_world_size=1,
            min_nodes=n,
            max_nodes=n,
            last_call_seconds=LAST_CALL_S,
            join_timeout_seconds=JOIN_TIMEOUT_S,
            local_addr="127.0.0.1",
        )
        for i, c in enumerate(clients)
    ]
    try:
        return _run_round(handlers)
    finally:
        for h in handlers:
            h.shutdown()
        for c in clients:
            c.close()


def connect_tcp_stores(port: int, count: int) -> list[dist.TCPStore]:
    """TCPStore clients for the torch nodes, made once and reused by every measurement.

    Connecting hundreds of clients takes tens of seconds here (some connects stall for
    seconds), so they connect in parallel, once, before any clock starts."""
    with ThreadPoolExecutor(CONNECT_THREADS) as pool:
        return list(
            pool.map(
                lambda _: dist.TCPStore(
                    "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)
                ),
                range(count),
            )
        )


def measure_torch(clients: list[dist.TCPStore], n: int, tag: str, limit_s: float) -> float | None:
    """Completion time of torch's c10d dynamic rendezvous, or None if it timed out."""
    stores = clients[:n]  # a fresh run id per measurement: nothing of earlier runs is reused
    timeout = RendezvousTimeout(
        join=timedelta(seconds=limit_s), last_call=timedelta(seconds=LAST_CALL_S)
    )
    handlers = [
        DynamicRendezvousHandler.from_backend(
            run_id=f"bench-{tag}",
            store=s,
            backend=C10dRendezvousBackend(s, f"bench-{tag}"),
            min_nodes=n,
            max_nodes=n,
            local_addr="127.0.0.1",
            timeout=timeout,
        )
        for s in stores
    ]
    try:
        seconds = _run_round(handlers, limit_s)
    except RuntimeError as e:
        log.warning("torch c10d rendezvous of %d nodes failed: %s", n, e)
        return None  # no shutdown: closing a failed rendezvous of many nodes takes long too
    for h in handlers:
        h.shutdown()
    return seconds


# -- driver -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default=",".join(map(str, DEFAULT_NODES)))
    parser.add_argument("--repeats", type=int, default=3, help=f"per N <= {SMALL_N} (median)")
    parser.add_argument("--large-repeats", type=int, default=1, help=f"per N > {SMALL_N}")
    parser.add_argument("--torch-timeout", type=float, default=TORCH_TIMEOUT_S)
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args(argv)
    nodes = [int(x) for x in args.nodes.split(",") if x]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    # The handlers log every round at INFO: keep the output to the table.
    for name in ("dlrover_torch", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.ERROR)

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    master = ctx.Process(target=_serve_master, args=(child,), daemon=True)
    master.start()
    if not parent.poll(SERVER_START_TIMEOUT_S):
        raise SystemExit("the master process did not start")
    port, token = parent.recv()
    addr = f"127.0.0.1:{port}"
    tcp_server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )

    tcp_clients = connect_tcp_stores(tcp_server.port, max(nodes))
    results = []
    if not args.json_only:
        print(f"{'nodes':>6} {'master_s':>10} {'torch_c10d_s':>13} {'speedup':>8}")
    t_all = time.perf_counter()
    try:
        for n in nodes:
            ours, theirs = [], []
            repeats = args.repeats if n <= SMALL_N else args.large_repeats
            for r in range(repeats):
                ours.append(measure_master(addr, token, n, f"{n}-{r}"))
                theirs.append(measure_torch(tcp_clients, n, f"{n}-{r}", args.torch_timeout))
            done = [x for x in theirs if x is not None]
            row = {
                "nodes": n,
                "master_s": round(statistics.median(ours), 4),
                # None: torch did not finish within --torch-timeout in any repeat
                "torch_c10d_s": round(statistics.median(done), 4) if done else None,
                "torch_timed_out": len(theirs) - len(done),
                "master_all_s": [round(x, 4) for x in ours],
                "torch_c10d_all_s": [None if x is None else round(x, 4) for x in theirs],
            }
            # With a timeout, the ratio is a lower bound: torch needed more than the limit.
            torch_s = row["torch_c10d_s"] or args.torch_timeout
            row["speedup"] = round(torch_s / row["master_s"], 2)
            results.append(row)
            if not args.json_only:
                shown = f"{row['torch_c10d_s']:.3f}" if done else f">{args.torch_timeout:g}"
                bound = "" if done else " (lower bound)"
                print(
                    f"{n:>6} {row['master_s']:>10.3f} {shown:>13} {row['speedup']:>7.1f}x{bound}",
                    flush=True,
                )
    finally:
        parent.send("stop")
        master.join(10)
    print(
        json.dumps(
            {
                "benchmark": "rendezvous",
                "repeats": args.repeats,
                "large_repeats": args.large_repeats,
                "torch_timeout_s": args.torch_timeout,
                "wall_seconds": round(time.perf_counter() - t_all, 1),
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
