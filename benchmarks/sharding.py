"""Shard round trips per second and latency against a real master over gRPC on loopback.

One round trip is one shard, taken and reported consumed, in three ways:

- "coalesced" (the headline): what a real worker does (`dlrover_tf.ShardedDataset`) where its
  platform reads a dead trainer's position file back (local processes, Ray, and Kubernetes
  trainer pods in the job's image, under the pod guard): `MasterClient.get_shard(dataset,
  wait_ms=0)` (an ask on the node's open `ShardStream` on the aio server, a unary `GetShard` on
  the sync server, which serves no such stream), then the shard's progress through the node's
  `ProgressStream` with a position file: each step's position written to the file (one
  `pwrite`), the steps of each second sent as one message on the stream.
- "worker": the same with a report per step on the stream (a node whose platform reads no file
  back: a Kubernetes pod in an image of its own), `--steps-per-shard` messages per shard
  (default 1: the report of the step that finishes the shard).
In both the master applies stream messages in order, each one's shard ends written by the next
group write while it reads on, and answers the stream once all are stored; each client flushes
its stream at the end of a phase (the time that takes is reported as the drain, so a backlog
could not hide).
- "unary": the older two-call form, a unary `GetShard`, then a unary `report_progress` of the
  whole shard.

The master runs in its own process (a JobMaster built as `dlrover submit` builds it: SQLite state
file, token check, per-connection rate limit, RPC timing interceptor; 64 registered worker
incarnations, no node launched). The clients are `MasterClient`s, one per thread, each with its
own connection (as separate nodes have), spread over two client processes. The same clients then
drive an "echo" server in the same run: the Master service's methods answering pre-encoded
replies of the same size (a 1,024-record shard) without any work, the transport-only ceiling
(on the aio server asks on a stream too, as the master answers them).
Where the anchors environment exists (`make anchors`), DLRover 0.6.1's master is measured in the
same run with its own client, as many clients, one shard taken and reported per round trip
(benchmarks/anchor_sharding.py); no figure of it is ever written here.

    python benchmarks/sharding.py [--clients 1,16,64] [--seconds 5] [--steps-per-shard 1]
                                  [--pairs 1]

Prints a table, then one JSON line with every figure. The parts: sharding_servers.py (master
and echo), sharding_phases.py (clients, one phase), sharding_results.py (figures, table).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import sys
import tempfile

from common import Child, use_checkout

# This checkout's code, also where the environment's editable install points at another one.
use_checkout()

import anchors  # noqa: E402
from anchor_sharding import DLRoverShardPhases  # noqa: E402
from sharding_phases import (  # noqa: E402
    CLIENT_PROCESSES,
    MODES,
    RECORDS_PER_SHARD,
    Figures,
    client_main,
    create_dataset,
    run_phase,
)
from sharding_results import build_results, dlrover_figures, print_table  # noqa: E402
from sharding_servers import WORKER_REPLICAS, server_main  # noqa: E402

SERVER_START_TIMEOUT_S = 60.0

log = logging.getLogger("bench.sharding")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,16,64", help="comma-separated client counts")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase")
    p.add_argument(
        "--server",
        choices=("aio", "sync"),
        default="aio",
        help="gRPC server of the master and of the echo (the master's --rpc-server)",
    )
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per phase")
    p.add_argument(
        "--steps-per-shard",
        type=int,
        default=1,
        help="worker mode: progress messages per shard (a real worker sends one per step)",
    )
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated: coalesced, worker, unary (all)"
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="master and echo phases run alternately this many times per client count and "
        "mode; the figures are the pair with the median CPU ratio (the machine's speed drifts)",
    )
    p.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        p.error(f"--clients: {args.clients!r} is not a comma-separated list of integers")
    if not args.clients or not all(1 <= c <= WORKER_REPLICAS for c in args.clients):
        p.error(f"--clients: every count must be between 1 and {WORKER_REPLICAS}")
    if args.seconds <= 0 or args.warmup < 0:
        p.error("--seconds must be > 0 and --warmup >= 0")
    if args.pairs < 1:
        p.error(f"--pairs must be >= 1, got {args.pairs}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or not set(args.modes) <= set(MODES):
        p.error(f"--modes: {args.modes!r}: choose among {', '.join(MODES)}")
    if not 1 <= args.steps_per_shard <= RECORDS_PER_SHARD:
        p.error(f"--steps-per-shard must be between 1 and {RECORDS_PER_SHARD}")
    return args


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.json_only else logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so the finally below always runs
    ctx = multiprocessing.get_context("spawn")
    children: list[Child] = []
    measured: dict[int, dict[tuple[str, str], list[Figures]]] = {}
    dlrover = None
    with tempfile.TemporaryDirectory(prefix="bench-sharding-") as tmp:
        try:
            if anchors.python() is None:
                log.warning("%s", anchors.MISSING)
            else:
                dlrover = DLRoverShardPhases(
                    os.path.join(tmp, "dlrover-master.log"), CLIENT_PROCESSES
                )
            master = Child(ctx, "master", server_main, "master", tmp, args.server)
            children.append(master)
            echo = Child(ctx, "echo", server_main, "echo", tmp, args.server)
            children.append(echo)
            client_procs = [
                Child(ctx, f"clients-{i}", client_main) for i in range(CLIENT_PROCESSES)
            ]
            children.extend(client_procs)
            _, port, token, node_ids = master.recv(SERVER_START_TIMEOUT_S, "starting")
            _, echo_port, _, _ = echo.recv(SERVER_START_TIMEOUT_S, "starting")
            addr, echo_addr = f"127.0.0.1:{port}", f"127.0.0.1:{echo_port}"
            log.info("master pid %d at %s, echo pid %d", master.proc.pid, addr, echo.proc.pid)
            for n in args.clients:
                clients = list(enumerate(node_ids[:n]))
                by: dict[tuple[str, str], list[Figures]] = {}
                for mode in args.modes:
                    dataset = f"bench-{n}-clients-{mode}"
                    create_dataset(addr, token, node_ids[0], dataset)
                    for kind, server, server_addr in (
                        ("master", master, addr),
                        ("echo", echo, echo_addr),
                    ) * args.pairs:
                        f = run_phase(
                            server,
                            client_procs,
                            kind,
                            mode,
                            args.steps_per_shard,
                            server_addr,
                            token,
                            dataset,
                            clients,
                            args.warmup,
                            args.seconds,
                        )
                        log.info(
                            "%2d clients, %-6s %-6s: %7.0f rt/s, p50 %.2f ms, p99 %.2f ms, "
                            "drain %.0f ms, CPU us/rt server %.0f clients %.0f, other load %.0f%%",
                            n,
                            mode,
                            kind,
                            f.round_trips_per_s,
                            f.p50_ms,
                            f.p99_ms,
                            f.drain_ms,
                            f.server_cpu_us,
                            f.client_cpu_us,
                            f.other_cpu_pct,
                        )
                        by.setdefault((kind, mode), []).append(f)
                if dlrover is not None:
                    ref = dlrover_figures(dlrover.phase(f"bench-{n}", n, args.warmup, args.seconds))
                    by[("dlrover", "get+report")] = [ref]
                    log.info(
                        "%2d clients, DLRover %s get+report: %7.0f rt/s, p99 %.2f ms",
                        n,
                        dlrover.version,
                        ref.round_trips_per_s,
                        ref.p99_ms,
                    )
                measured[n] = by
        finally:
            for child in reversed(children):
                child.stop()
            if dlrover is not None:
                dlrover.stop()
    doc = build_results(measured, args.steps_per_shard, args.modes)
    doc["rpc_server"] = args.server
    if not args.json_only:
        print_table(doc, args.seconds)
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.stderr.write("interrupted; the master, echo and client processes were stopped\n")
        sys.exit(130)
    except (RuntimeError, TimeoutError, OSError) as e:
        sys.stderr.write(f"benchmark failed: {e}\n")
        sys.exit(1)
