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

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass

TARGET_CLIENTS = 64
TARGET_RATIO = 3.0  # worker mode against DLRover's master (get_task + report_task_result)
TARGET_P99_MS = 10.0
TARGET_ECHO_CPU_RATIO = 1.5  # our master's CPU per round trip against the echo server's
TARGET_RATIO_TO_DLROVER = 1.7  # issue 16: worker-mode round trips against DLRover's master

WORKER_REPLICAS = 64
SERVER_THREADS = 512  # as `dlrover submit` (MasterConfig.max_workers)
CLIENT_PROCESSES = 2
DATASET_SIZE = 10**9  # never runs out: a phase uses well under 0.1% of it
BATCH_SIZE = 64
RECORDS_PER_SHARD = BATCH_SIZE * 16
MODES = ("coalesced", "worker", "unary")
BENCH_RATE_PER_SECOND = 100_000.0  # the master's per-connection rate limit in this benchmark
# Each simulated node gets its own TCP connection (by default gRPC shares one per process).
PRIVATE_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
START_MARGIN_S = 0.3  # between "every client connected" and the common start time
SERVER_START_TIMEOUT_S = 60.0
CLIENT_READY_TIMEOUT_S = 60.0
RESULT_GRACE_S = 60.0  # how long past a phase's end its results may take
OTHER_LOAD_WARN_PCT = 20.0  # foreign CPU use (100 = one core) that makes a run suspect

log = logging.getLogger("bench.sharding")

# This checkout's code, also where the environment's editable install points at another one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import anchors  # noqa: E402
from anchor_sharding import DLRoverPhase, DLRoverShardPhases  # noqa: E402

# -- servers (each in its own process) -------------------------------------------------------


def _start_master(
    tmp_dir: str, workers: int, server_kind: str
) -> tuple[Callable[[], None], int, str, list[int]]:
    """A JobMaster as `dlrover submit` builds it, without job.run(): no node is launched."""
    from master.config import parse_job_spec
    from master.job.master import JobMaster, JobRuntime
    from master.observability.metrics import JobMetrics
    from master.platform.local import LocalPlatform
    from master.rpc.aio_server import start_aio_server
    from master.rpc.server import start_server
    from master.state.sqlite import SQLiteStateStore

    spec = parse_job_spec(
        {"name": "bench-sharding", "command": ["true"], "worker": {"replicas": workers}},
        source="bench",
        base_dir=tmp_dir,
    )
    store = SQLiteStateStore(os.path.join(tmp_dir, "state.sqlite"))
    platform = LocalPlatform()
    runtime = JobRuntime(run_dir=tmp_dir, master_addr="", token_file="")
    job = JobMaster(spec, platform, store, runtime)
    node_ids = []
    for rank in range(workers):
        node = job.nodes.new_incarnation("worker", rank, 0, 0)
        job.nodes.mark_running(node.id, platform.address_for("worker", rank), "")
        node_ids.append(node.id)
    token = secrets.token_urlsafe(32)
    # As `dlrover submit`: the RPC timing interceptor (Observability) before the rate limit and
    # the token check. The rate limit checks every call, at a rate one simulated node here never
    # reaches (one client alone makes more calls per second than a real node's 500/s budget).
    start = start_aio_server if server_kind == "aio" else start_server
    server, port = start(
        job,
        "127.0.0.1",
        0,
        token,
        max_workers=SERVER_THREADS,
        heartbeat_interval_ms=2000,
        interceptors=[JobMetrics(job).interceptor()],
        requests_per_second=BENCH_RATE_PER_SECOND,
    )
    runtime.master_addr = f"127.0.0.1:{port}"

    def stop() -> None:
        server.stop(grace=0).wait()
        job.sharding.close()
        platform.shutdown(0)
        store.close()

    return stop, port, token, node_ids


def _start_echo(server_kind: str) -> tuple[Callable[[], None], int, str, list[int]]:
    """The Master service's shard methods on a bare gRPC server of `server_kind` (the master's),
    answering without any work: GetShard a pre-encoded shard of RECORDS_PER_SHARD records
    (without indices: the nodes compute them), the progress calls nothing."""
    from concurrent import futures

    import grpc

    from master.pb import data_pb2
    from master.rpc.server import server_options

    shard_reply = data_pb2.GetShardReply(
        status=data_pb2.GetShardReply.SHARD,
        shard=data_pb2.Shard(shard_id=1, start=0, end=RECORDS_PER_SHARD),
    ).SerializeToString()
    created_reply = data_pb2.CreateDatasetReply(created=False).SerializeToString()

    def get_shard(request: bytes, context: grpc.ServicerContext) -> bytes:
        return shard_reply

    def create(request: bytes, context: grpc.ServicerContext) -> bytes:
        return created_reply

    def report(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""

    def stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        for _ in requests:
            pass
        return b""

    async def get_shard_async(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return shard_reply

    async def create_async(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return created_reply

    async def report_async(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b""

    async def stream_async(requests, context: grpc.aio.ServicerContext) -> bytes:
        async for _ in requests:
            pass
        return b""

    async def asks_async(requests, context: grpc.aio.ServicerContext):
        async for _ in requests:
            yield shard_reply

    if server_kind == "aio":
        from master.rpc.aio_server import AioServer

        aio_handler = grpc.method_handlers_generic_handler(
            "dlrover.v1.Master",
            {
                "GetShard": grpc.unary_unary_rpc_method_handler(get_shard_async),
                "CreateDataset": grpc.unary_unary_rpc_method_handler(create_async),
                "ReportProgress": grpc.unary_unary_rpc_method_handler(report_async),
                "StreamProgress": grpc.stream_unary_rpc_method_handler(stream_async),
                # Shard asks on a stream, as the aio master serves them (the sync one does not).
                "ShardStream": grpc.stream_stream_rpc_method_handler(asks_async),
            },
        )
        bound = [0]

        def build() -> grpc.aio.Server:
            aio = grpc.aio.server(handlers=[aio_handler], options=server_options(SERVER_THREADS))
            bound[0] = aio.add_insecure_port("127.0.0.1:0")
            return aio

        handle = AioServer()
        handle.run(build, 4)
        return (lambda: handle.stop(0).wait()), bound[0], "", []

    handler = grpc.method_handlers_generic_handler(
        "dlrover.v1.Master",
        {
            "GetShard": grpc.unary_unary_rpc_method_handler(get_shard),
            "CreateDataset": grpc.unary_unary_rpc_method_handler(create),
            "ReportProgress": grpc.unary_unary_rpc_method_handler(report),
            "StreamProgress": grpc.stream_unary_rpc_method_handler(stream),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="rpc"),
        handlers=[handler],
        options=server_options(SERVER_THREADS),  # as the master's server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        raise OSError("echo server: cannot listen on 127.0.0.1")
    server.start()
    return (lambda: server.stop(grace=0).wait()), port, "", []


def _server_main(
    conn: multiprocessing.connection.Connection, kind: str, tmp_dir: str, server_kind: str
) -> None:
    """Entry of a server process: start, report (port, token, node ids), serve until told to stop.

    Any message from the parent, or the parent going away (EOF on the pipe), stops the server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    logging.basicConfig(level=logging.WARNING, format=f"[{kind}] %(levelname)s %(message)s")
    try:
        if kind == "master":
            stop, port, token, node_ids = _start_master(tmp_dir, WORKER_REPLICAS, server_kind)
        else:
            stop, port, token, node_ids = _start_echo(server_kind)
    except BaseException as e:
        conn.send(("error", f"{kind} server did not start: {e!r}"))
        raise
    conn.send(("ready", port, token, node_ids))
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    finally:
        stop()


# -- clients (two processes, one thread per client) ------------------------------------------


@dataclass(frozen=True)
class Phase:
    """What one client process runs in one phase."""

    kind: str  # "master" or "echo"
    mode: str  # "coalesced", "worker" or "unary" (see the module docstring)
    steps: int  # progress messages per shard in worker mode
    addr: str
    token: str
    dataset: str
    clients: tuple[tuple[int, int], ...]  # (rank, node id) per client thread
    warmup: float
    seconds: float


def _round_trip(phase: Phase, rank: int, node_id: int) -> tuple[Callable, Callable]:
    """(one round trip, close) for one simulated node; close returns the seconds its progress
    stream took to drain (worker mode) or 0."""
    import grpc

    from master.client import MasterClient, NodeIdentity, ProgressStream
    from master.pb import data_pb2

    client = MasterClient(
        phase.addr,
        phase.token,
        NodeIdentity("worker", rank, node_id),
        channel_options=PRIVATE_CONNECTION,
        shard_asks_on_stream=phase.mode != "unary",  # the two-unary form asks by GetShard
    )
    # Connect before the common start (the channel is private to MasterClient, fine here).
    grpc.channel_ready_future(client._channel).result(timeout=CLIENT_READY_TIMEOUT_S)
    dataset = phase.dataset
    # As ShardedDataset does: each node declares the dataset, and so computes its shards'
    # record indices itself.
    client.create_dataset(_dataset_spec(dataset))
    shard_status = data_pb2.GetShardReply.SHARD
    steps = phase.steps
    # Coalescing, as ShardedDataset does where the platform reads a dead trainer's position
    # file back: each step's position into the file, the steps of each second in one report.
    positions = tempfile.mkdtemp(prefix="bench-positions-") if phase.mode == "coalesced" else ""
    progress = ProgressStream(
        client, position_file=os.path.join(positions, "position") if positions else ""
    )

    def take() -> tuple[int, int]:
        reply = client.get_shard(dataset, wait_ms=0)
        if reply.status != shard_status:
            raise RuntimeError(f"get_shard answered status {reply.status}, not SHARD")
        return reply.shard.shard_id, reply.shard.end - reply.shard.start

    def worker() -> None:
        shard_id, size = take()
        for step in range(1, steps + 1):
            progress.send(dataset, [(shard_id, size * step // steps)])

    def unary() -> None:
        shard_id, size = take()
        client.report_progress(dataset, [(shard_id, size)])

    def close() -> float:
        start = time.monotonic()
        try:
            progress.close(timeout=RESULT_GRACE_S)
            return time.monotonic() - start
        finally:
            client.close()
            if positions:
                shutil.rmtree(positions, ignore_errors=True)

    return (unary if phase.mode == "unary" else worker), close


class _ClientThread(threading.Thread):
    """Connects, waits for the common start, then runs round trips back to back until the end."""

    def __init__(self, phase: Phase, rank: int, node_id: int, ready: threading.Barrier) -> None:
        super().__init__(name=f"client-{rank}", daemon=True)
        self.phase = phase
        self.rank = rank
        self.node_id = node_id
        self.ready = ready
        self.start_at = 0.0  # set by the process before the barrier's second round
        self.latencies = array("d")  # seconds, of round trips ending inside the window
        self.drain = 0.0  # seconds the progress stream took to flush after the window
        self.error = ""

    def run(self) -> None:
        try:
            round_trip, close = _round_trip(self.phase, self.rank, self.node_id)
        except Exception as e:
            self.error = f"client {self.rank}: cannot connect: {e!r}"
            self.ready.abort()
            return
        try:
            self.ready.wait()  # every client of this process is connected
            self.ready.wait()  # the parent has set the common start time
            self._loop(round_trip)
        except threading.BrokenBarrierError:
            self.error = self.error or f"client {self.rank}: aborted before the start"
        except Exception as e:
            self.error = f"client {self.rank}: {e!r}"
        finally:
            try:
                self.drain = close()
            except Exception as e:
                self.error = self.error or f"client {self.rank}: flushing progress: {e!r}"

    def _loop(self, round_trip: Callable[[], None]) -> None:
        # time.monotonic is CLOCK_MONOTONIC on Linux: one clock for every process of the machine.
        begin = self.start_at + self.phase.warmup
        end = begin + self.phase.seconds
        clock = time.monotonic
        delay = self.start_at - clock()
        if delay > 0:
            time.sleep(delay)
        append = self.latencies.append
        while True:
            t0 = clock()
            if t0 >= end:
                return
            round_trip()
            t1 = clock()
            if begin <= t1 < end:
                append(t1 - t0)


def _run_phase(conn: multiprocessing.connection.Connection, phase: Phase) -> None:
    ready = threading.Barrier(len(phase.clients) + 1)
    threads = [_ClientThread(phase, rank, node_id, ready) for rank, node_id in phase.clients]
    for t in threads:
        t.start()
    try:
        ready.wait(timeout=CLIENT_READY_TIMEOUT_S)
        conn.send(("ready",))
        start_at = conn.recv()
        for t in threads:
            t.start_at = start_at
        ready.wait(timeout=CLIENT_READY_TIMEOUT_S)
    except threading.BrokenBarrierError:
        ready.abort()
    except (EOFError, OSError):  # the parent went away: stop without measuring
        ready.abort()
        return
    for t in threads:
        t.join()
    errors = [t.error for t in threads if t.error]
    if errors:
        conn.send(("error", "; ".join(errors[:3])))
        return
    latencies = array("d")
    for t in threads:
        latencies.extend(t.latencies)
    conn.send(("done", latencies.tobytes(), max(t.drain for t in threads)))


def _client_main(conn: multiprocessing.connection.Connection) -> None:
    """Entry of a client process: run the phases the parent sends until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import grpc  # noqa: F401  (imported once here, not inside the first measured phase)

    import master.client  # noqa: F401

    while True:
        try:
            phase = conn.recv()
        except (EOFError, OSError):
            return
        if phase is None:
            return
        _run_phase(conn, phase)


# -- parent ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    round_trips_per_s: float
    p50_ms: float
    p99_ms: float
    count: int
    server_cpu_us: float  # server process CPU time (user + system) per round trip
    client_cpu_us: float  # client processes' CPU time per round trip
    # CPU the machine used outside the server and client processes (other work, unattributed
    # kernel time); 100 = one core.
    other_cpu_pct: float
    drain_ms: float  # worker mode: the slowest client's progress-stream flush after the window


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class _Child:
    """A spawned process and the parent's end of its pipe; stop() never leaves it running."""

    def __init__(
        self,
        ctx: multiprocessing.context.SpawnContext,
        name: str,
        target: Callable[..., None],
        *args: object,
    ) -> None:
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), name=name, daemon=True)
        self.proc.start()
        child_conn.close()

    def recv(self, timeout: float, what: str) -> tuple:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout:.0f}s while {what}")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"{self.name} exited (code {self.proc.exitcode}) while {what}"
            ) from None
        if msg[0] == "error":
            raise RuntimeError(f"{self.name}: {msg[1]}")
        return msg

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.proc.join(3)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(3)
        self.conn.close()


def _dataset_spec(name: str):
    """The benchmark's dataset, as every simulated node declares it."""
    from master.pb import data_pb2

    return data_pb2.DatasetSpec(
        name=name,
        size=DATASET_SIZE,
        batch_size=BATCH_SIZE,
        records_per_shard=RECORDS_PER_SHARD,
        epochs=1,
        shuffle=False,
    )


def _create_dataset(addr: str, token: str, node_id: int, name: str) -> None:
    from master.client import MasterClient, NodeIdentity

    client = MasterClient(addr, token, NodeIdentity("worker", 0, node_id))
    try:
        client.create_dataset(_dataset_spec(name))
    finally:
        client.close()


class _CpuMeter:
    """CPU seconds used by the server, by the client processes, and by everything else."""

    def __init__(self, server: _Child, client_procs: list[_Child]) -> None:
        import psutil

        self._psutil = psutil
        self._server = psutil.Process(server.proc.pid)
        self._clients = [psutil.Process(c.proc.pid) for c in client_procs]

    def sample(self) -> tuple[float, float, float]:
        def used(p) -> float:
            t = p.cpu_times()
            return t.user + t.system

        machine = self._psutil.cpu_times()
        busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        server = used(self._server)
        clients = sum(used(p) for p in self._clients)
        return server, clients, busy - server - clients


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def run_phase(
    server: _Child,
    client_procs: list[_Child],
    kind: str,
    mode: str,
    steps: int,
    addr: str,
    token: str,
    dataset: str,
    clients: list[tuple[int, int]],
    warmup: float,
    seconds: float,
) -> Figures:
    """Drive `clients` (spread round-robin over the client processes) from one common start."""
    shares = [clients[i :: len(client_procs)] for i in range(len(client_procs))]
    busy = [(proc, share) for proc, share in zip(client_procs, shares, strict=True) if share]
    for proc, share in busy:
        proc.conn.send(
            Phase(kind, mode, steps, addr, token, dataset, tuple(share), warmup, seconds)
        )
    for proc, _ in busy:
        proc.recv(CLIENT_READY_TIMEOUT_S + 5, f"connecting {kind} clients")
    start_at = time.monotonic() + START_MARGIN_S
    for proc, _ in busy:
        proc.conn.send(start_at)
    # CPU use inside the measured window (the parent is idle meanwhile, so it samples it).
    meter = _CpuMeter(server, client_procs)
    _sleep_until(start_at + warmup)
    cpu0 = meter.sample()
    _sleep_until(start_at + warmup + seconds)
    cpu1 = meter.sample()
    server_cpu, client_cpu, other_cpu = (b - a for a, b in zip(cpu0, cpu1, strict=True))
    latencies = array("d")
    drain = 0.0
    wait = START_MARGIN_S + warmup + seconds + RESULT_GRACE_S
    for proc, _ in busy:
        msg = proc.recv(wait, f"running {kind} round trips")
        latencies.frombytes(msg[1])
        drain = max(drain, msg[2])
    values = sorted(latencies)
    return Figures(
        round_trips_per_s=len(values) / seconds,
        p50_ms=percentile(values, 50) * 1000,
        p99_ms=percentile(values, 99) * 1000,
        count=len(values),
        server_cpu_us=server_cpu / max(1, len(values)) * 1e6,
        client_cpu_us=client_cpu / max(1, len(values)) * 1e6,
        other_cpu_pct=max(0.0, other_cpu) / seconds * 100,
        drain_ms=drain * 1000,
    )


def _dlrover_figures(phase: DLRoverPhase) -> Figures:
    values = phase.latencies
    return Figures(
        round_trips_per_s=len(values) / phase.seconds,
        p50_ms=percentile(values, 50) * 1000,
        p99_ms=percentile(values, 99) * 1000,
        count=len(values),
        server_cpu_us=phase.server_cpu / max(1, len(values)) * 1e6,
        client_cpu_us=phase.client_cpu / max(1, len(values)) * 1e6,
        other_cpu_pct=0.0,  # not sampled for this phase
        drain_ms=0.0,
    )


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _figures(f: Figures) -> dict:
    return {
        "round_trips_per_s": round(f.round_trips_per_s, 1),
        "p50_ms": round(f.p50_ms, 3),
        "p99_ms": round(f.p99_ms, 3),
        "server_cpu_us_per_rt": round(f.server_cpu_us, 1),
        "client_cpu_us_per_rt": round(f.client_cpu_us, 1),
        "drain_ms": round(f.drain_ms, 1),
    }


def median_pair(pairs: list[tuple[Figures, Figures]]) -> tuple[Figures, Figures]:
    """The (master, echo) pair whose CPU ratio is the median (the upper middle of an even
    count, the less flattering one): the machine's speed drifts between minutes, and a pair is
    measured minutes apart from the next."""
    ranked = sorted(pairs, key=lambda p: p[0].server_cpu_us / max(p[1].server_cpu_us, 1e-9))
    return ranked[len(ranked) // 2]


def build_results(
    measured: dict[int, dict[tuple[str, str], list[Figures]]], steps: int, modes: list[str]
) -> dict:
    """The JSON document: per client count, master, echo and (when measured) DLRover figures of
    each mode (of the median pair where several master/echo pairs ran), and whether the
    64-client target is met (by the worker mode: what real workers do; against DLRover measured
    in this run, None when it was not)."""
    results = []
    for n, by in measured.items():
        ref = by[("dlrover", "get+report")][0] if ("dlrover", "get+report") in by else None
        entry: dict = {"clients": n, "dlrover": _figures(ref) if ref else None}
        for mode in modes:
            pairs = list(zip(by[("master", mode)], by[("echo", mode)], strict=True))
            ours, echo = median_pair(pairs)
            entry[mode] = _figures(ours)
            entry[f"echo_{mode}"] = _figures(echo)
            entry[f"{mode}_ratio_to_echo"] = _ratio(ours.round_trips_per_s, echo.round_trips_per_s)
            entry[f"{mode}_cpu_ratio_to_echo"] = _ratio(ours.server_cpu_us, echo.server_cpu_us)
            entry[f"{mode}_cpu_ratios_to_echo"] = [
                _ratio(m.server_cpu_us, e.server_cpu_us) for m, e in pairs
            ]
            entry[f"{mode}_ratio_to_dlrover"] = (
                _ratio(ours.round_trips_per_s, ref.round_trips_per_s) if ref else None
            )
            # The ceiling of that ratio in this run: a server that does no work, same clients.
            entry[f"echo_{mode}_ratio_to_dlrover"] = (
                _ratio(echo.round_trips_per_s, ref.round_trips_per_s) if ref else None
            )
        entry["other_load_cpu_pct"] = round(
            max(f.other_cpu_pct for figures in by.values() for f in figures), 1
        )
        results.append(entry)
    top = next((r for r in results if r["clients"] == TARGET_CLIENTS), None)
    ref_figures = top["dlrover"] if top else None
    met = (
        None
        if not (top and ref_figures and "worker" in modes)
        else bool(
            top["worker"]["round_trips_per_s"] >= TARGET_RATIO * ref_figures["round_trips_per_s"]
            and top["worker"]["p99_ms"] < TARGET_P99_MS
        )
    )
    doc = {
        "benchmark": "sharding",
        "steps_per_shard": steps,
        "modes": modes,
        "results": results,
        "target_met_64": met,
    }
    # Issue 16's targets, per stream mode ("" for the worker mode: the keys it always had).
    for mode, prefix in (("coalesced", "coalesced_"), ("worker", "")):
        judged = top is not None and mode in modes
        ratio = top[f"{mode}_ratio_to_dlrover"] if judged else None
        doc[f"{prefix}cpu_within_1_5x_echo_64"] = (
            top[f"{mode}_cpu_ratio_to_echo"] <= TARGET_ECHO_CPU_RATIO if judged else None
        )
        doc[f"{prefix}at_least_1_7x_dlrover_64"] = (
            ratio >= TARGET_RATIO_TO_DLROVER if ratio is not None else None
        )
    return doc


def print_table(doc: dict, seconds: float, out=sys.stdout) -> None:
    w = out.write
    steps = doc["steps_per_shard"]
    w(
        f"\nshard round trips, {seconds:g}s per phase, {CLIENT_PROCESSES} client processes "
        f"(a connection per client), loopback gRPC, {os.cpu_count()} cores\n"
        "coalesced: an ask on the shard stream + the shard's end in the position file, the steps "
        "of each second "
        "in one stream message\n           (what ShardedDataset does where a dead trainer's file "
        "is read back: local, Ray, Kubernetes pods under the guard)\n"
        f"worker: an ask + {steps} progress message(s) per shard on the progress stream "
        "(ShardedDataset reporting every step)\n"
        "unary:  GetShard + report_progress (two unary calls)\n\n"
    )
    head = (
        f"{'clients':>7} | {'mode':>9} | {'master rt/s':>11} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'drain ms':>8} | {'echo rt/s':>9} {'p50 ms':>7} {'p99 ms':>7} | {'x echo':>6} | "
        f"{'DLRover rt/s':>12} {'p99 ms':>7} {'x DLR':>6}"
    )
    w(head + "\n" + "-" * len(head) + "\n")
    for r in doc["results"]:
        ref = r["dlrover"]
        for mode in doc["modes"]:
            ours, echo = r[mode], r[f"echo_{mode}"]
            ratio = r[f"{mode}_ratio_to_dlrover"]
            ref_cols = (
                f"{ref['round_trips_per_s']:>12,.0f} {ref['p99_ms']:>7.2f} {ratio:>5.2f}x"
                if ref
                else f"{'-':>12} {'-':>7} {'-':>6}"
            )
            drain = f"{ours['drain_ms']:>8.1f}" if mode != "unary" else f"{'-':>8}"
            w(
                f"{r['clients']:>7} | {mode:>9} | {ours['round_trips_per_s']:>11,.0f} "
                f"{ours['p50_ms']:>7.2f} {ours['p99_ms']:>7.2f} {drain} | "
                f"{echo['round_trips_per_s']:>9,.0f} {echo['p50_ms']:>7.2f} "
                f"{echo['p99_ms']:>7.2f} | {r[f'{mode}_ratio_to_echo']:>5.2f}x | {ref_cols}\n"
            )
    w(
        "\n'echo': the same clients against the Master service's shard methods on a bare gRPC "
        "server (same thread pool)\nanswering pre-encoded replies: the transport-only ceiling, "
        "measured in this run.\n'drain': time to flush the progress streams after the window "
        "(the master applies every report).\n'DLRover': DLRover 0.6.1's master with its own "
        "client (get_task + report_task_result per shard), measured in\nthis run "
        "(- where the anchors environment is missing: make anchors).\n\n"
    )
    head = (
        f"{'clients':>7} | {'mode':>9} | {'CPU us per round trip: master':>29} {'clients':>7} | "
        f"{'echo server':>11} {'clients':>7} | {'x echo':>6} | {'DLRover':>7} | "
        f"{'other load %CPU':>15}"
    )
    w(head + "\n" + "-" * len(head) + "\n")
    for r in doc["results"]:
        for mode in doc["modes"]:
            ours, echo = r[mode], r[f"echo_{mode}"]
            ref = r["dlrover"]
            ref_cpu = f"{ref['server_cpu_us_per_rt']:>7,.0f}" if ref else f"{'-':>7}"
            w(
                f"{r['clients']:>7} | {mode:>9} | {ours['server_cpu_us_per_rt']:>29,.0f} "
                f"{ours['client_cpu_us_per_rt']:>7,.0f} | {echo['server_cpu_us_per_rt']:>11,.0f} "
                f"{echo['client_cpu_us_per_rt']:>7,.0f} | "
                f"{r[f'{mode}_cpu_ratio_to_echo']:>5.2f}x | {ref_cpu} | "
                f"{r['other_load_cpu_pct']:>15.0f}\n"
            )
    worst = max((r["other_load_cpu_pct"] for r in doc["results"]), default=0.0)
    if worst > OTHER_LOAD_WARN_PCT:
        w(
            f"WARNING: processes outside this benchmark used up to {worst:.0f}% of a core during "
            "a measured window;\nthe figures above are lower and noisier than on an idle machine.\n"
        )
    w("\n")
    target = next((r for r in doc["results"] if r["clients"] == TARGET_CLIENTS), None)
    if target is not None and target["dlrover"] is not None and "worker" in doc["modes"]:
        ref_tp = target["dlrover"]["round_trips_per_s"] * TARGET_RATIO
        verdict = "MET" if doc["target_met_64"] else "NOT MET"
        w(
            f"target at {TARGET_CLIENTS} clients (worker mode): >= {ref_tp:,.0f} rt/s "
            f"({TARGET_RATIO:g}x DLRover's, measured above) and p99 < {TARGET_P99_MS:g} ms: "
            f"{verdict}\n"
        )
    for mode in (m for m in ("coalesced", "worker") if m in doc["modes"]):
        if target is None or target["dlrover"] is None:
            why = "no 64-client phase" if target is None else "DLRover not measured"
            w(f"round trips at {TARGET_CLIENTS} clients ({mode} mode): not judged ({why})\n")
        else:
            ratio = target[f"{mode}_ratio_to_dlrover"]
            verdict = "MET" if ratio >= TARGET_RATIO_TO_DLROVER else "NOT MET"
            w(
                f"round trips at {TARGET_CLIENTS} clients ({mode} mode) >= "
                f"{TARGET_RATIO_TO_DLROVER:g}x DLRover's: {ratio:.2f}x: {verdict} (the echo "
                f"server with the same clients: {target[f'echo_{mode}_ratio_to_dlrover']:.2f}x, "
                "the most any master could reach)\n"
            )
        if target is not None:
            ratio = target[f"{mode}_cpu_ratio_to_echo"]
            verdict = "MET" if ratio is not None and ratio <= TARGET_ECHO_CPU_RATIO else "NOT MET"
            each = target[f"{mode}_cpu_ratios_to_echo"]
            pairs = (
                f" (median of {len(each)} pairs: {', '.join(f'{r:.2f}' for r in each)})"
                if len(each) > 1
                else ""
            )
            w(
                f"master CPU per round trip at {TARGET_CLIENTS} clients ({mode} mode): "
                f"{ratio:.2f}x the echo server's{pairs} (target <= {TARGET_ECHO_CPU_RATIO:g}x): "
                f"{verdict}\n"
            )
    w("\n")
    out.flush()


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
    children: list[_Child] = []
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
            master = _Child(ctx, "master", _server_main, "master", tmp, args.server)
            children.append(master)
            echo = _Child(ctx, "echo", _server_main, "echo", tmp, args.server)
            children.append(echo)
            client_procs = [
                _Child(ctx, f"clients-{i}", _client_main) for i in range(CLIENT_PROCESSES)
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
                    _create_dataset(addr, token, node_ids[0], dataset)
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
                    ref = _dlrover_figures(
                        dlrover.phase(f"bench-{n}", n, args.warmup, args.seconds)
                    )
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
