"""Shard round trips per second and latency against a real master over gRPC on loopback.

One round trip is what a worker does per shard: `get_shard(dataset, wait_ms=0)`, then
`report_progress(dataset, [(shard_id, shard_size)])` reporting the whole shard consumed. The master
runs in its own process (a JobMaster built as `dlrover submit` builds it, with 64 registered worker
incarnations but no node launched); the clients are `MasterClient`s, one per thread, spread over
two client processes. The same client layout then drives an "echo" server (two trivial unary calls
per round trip, same thread pool size) in the same run: the transport-only cost, which the master
cannot beat.

    python benchmarks/sharding.py [--clients 1,16,64] [--seconds 5] [--json-only]

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
import signal
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

# DLRover 0.6.1 with its own client on this machine, as given in the issue (not measured here):
# clients -> (round trips per second, p99 latency in ms).
DLROVER_REF = {1: (1316.0, 1.3), 16: (2241.0, 11.0), 64: (1695.0, 102.0)}
TARGET_CLIENTS = 64
TARGET_RATIO = 3.0
TARGET_P99_MS = 10.0

WORKER_REPLICAS = 64
SERVER_THREADS = 128  # as `dlrover submit` (SubmitOptions.max_rpc_workers)
CLIENT_PROCESSES = 2
DATASET_SIZE = 10**9  # never runs out: a phase uses well under 0.1% of it
BATCH_SIZE = 64
RECORDS_PER_SHARD = BATCH_SIZE * 16
ECHO_SERVICE = "bench.Echo"
ECHO_PAYLOAD = b"\x0a\x08\x08\x01\x10\x02\x18\x03" * 4  # about a GetShardRequest's size
CALL_TIMEOUT_S = 30.0  # MasterClient's default per-call deadline, used by the echo client too
START_MARGIN_S = 0.3  # between "every client connected" and the common start time
SERVER_START_TIMEOUT_S = 60.0
CLIENT_READY_TIMEOUT_S = 60.0
RESULT_GRACE_S = 60.0  # how long past a phase's end its results may take
OTHER_LOAD_WARN_PCT = 20.0  # foreign CPU use (100 = one core) that makes a run suspect

log = logging.getLogger("bench.sharding")


# -- servers (each in its own process) -------------------------------------------------------


def _start_master(tmp_dir: str, workers: int) -> tuple[Callable[[], None], int, str, list[int]]:
    """A JobMaster as `dlrover submit` builds it, without job.run(): no node is launched."""
    from master.config import parse_job_spec
    from master.job import JobMaster, JobRuntime
    from master.platform.local import LocalPlatform
    from master.server import start_server
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
    server, port = start_server(
        job, "127.0.0.1", 0, token, max_workers=SERVER_THREADS, heartbeat_interval_ms=2000
    )
    runtime.master_addr = f"127.0.0.1:{port}"

    def stop() -> None:
        server.stop(grace=0).wait()
        job.sharding.close()
        platform.shutdown(0)
        store.close()

    return stop, port, token, node_ids


def _start_echo() -> tuple[Callable[[], None], int, str, list[int]]:
    """A minimal gRPC server: two unary methods that return their request bytes."""
    from concurrent import futures

    import grpc

    from master.client import MAX_MESSAGE_BYTES

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        ECHO_SERVICE,
        {
            "GetShard": grpc.unary_unary_rpc_method_handler(echo),
            "ReportProgress": grpc.unary_unary_rpc_method_handler(echo),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="rpc"),
        handlers=[handler],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        raise OSError("echo server: cannot listen on 127.0.0.1")
    server.start()
    return (lambda: server.stop(grace=0).wait()), port, "", []


def _server_main(conn: multiprocessing.connection.Connection, kind: str, tmp_dir: str) -> None:
    """Entry of a server process: start, report (port, token, node ids), serve until told to stop.

    Any message from the parent, or the parent going away (EOF on the pipe), stops the server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    logging.basicConfig(level=logging.WARNING, format=f"[{kind}] %(levelname)s %(message)s")
    try:
        if kind == "master":
            stop, port, token, node_ids = _start_master(tmp_dir, WORKER_REPLICAS)
        else:
            stop, port, token, node_ids = _start_echo()
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
    addr: str
    token: str
    dataset: str
    clients: tuple[tuple[int, int], ...]  # (rank, node id) per client thread
    warmup: float
    seconds: float


def _master_round_trip(phase: Phase, rank: int, node_id: int) -> tuple[Callable, Callable]:
    import grpc

    from master.client import MasterClient, NodeIdentity
    from master.pb import data_pb2

    client = MasterClient(phase.addr, phase.token, NodeIdentity("worker", rank, node_id))
    # Connect before the common start (the channel is private to MasterClient, fine here).
    grpc.channel_ready_future(client._channel).result(timeout=CLIENT_READY_TIMEOUT_S)
    dataset = phase.dataset
    shard_status = data_pb2.GetShardReply.SHARD

    def round_trip() -> None:
        reply = client.get_shard(dataset, wait_ms=0)
        if reply.status != shard_status:
            raise RuntimeError(f"get_shard answered status {reply.status}, not SHARD")
        shard = reply.shard
        client.report_progress(dataset, [(shard.shard_id, shard.end - shard.start)])

    return round_trip, client.close


def _echo_round_trip(phase: Phase, rank: int, node_id: int) -> tuple[Callable, Callable]:
    import grpc

    from master.client import MAX_MESSAGE_BYTES, TOKEN_METADATA_KEY

    # The same channel options, metadata and deadline as MasterClient uses.
    channel = grpc.insecure_channel(
        phase.addr,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 10_000),
        ],
    )
    grpc.channel_ready_future(channel).result(timeout=CLIENT_READY_TIMEOUT_S)
    get_shard = channel.unary_unary(f"/{ECHO_SERVICE}/GetShard")
    report = channel.unary_unary(f"/{ECHO_SERVICE}/ReportProgress")
    metadata = ((TOKEN_METADATA_KEY, phase.token),)

    def round_trip() -> None:
        get_shard(ECHO_PAYLOAD, timeout=CALL_TIMEOUT_S, metadata=metadata)
        report(ECHO_PAYLOAD, timeout=CALL_TIMEOUT_S, metadata=metadata)

    return round_trip, channel.close


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
        self.error = ""

    def run(self) -> None:
        make = _master_round_trip if self.phase.kind == "master" else _echo_round_trip
        try:
            round_trip, close = make(self.phase, self.rank, self.node_id)
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
            close()

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
    conn.send(("done", latencies.tobytes()))


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


def _create_dataset(addr: str, token: str, node_id: int, name: str) -> None:
    from master.client import MasterClient, NodeIdentity
    from master.pb import data_pb2

    client = MasterClient(addr, token, NodeIdentity("worker", 0, node_id))
    try:
        client.create_dataset(
            data_pb2.DatasetSpec(
                name=name,
                size=DATASET_SIZE,
                batch_size=BATCH_SIZE,
                records_per_shard=RECORDS_PER_SHARD,
                epochs=1,
                shuffle=False,
            )
        )
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
        proc.conn.send(Phase(kind, addr, token, dataset, tuple(share), warmup, seconds))
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
    wait = START_MARGIN_S + warmup + seconds + RESULT_GRACE_S
    for proc, _ in busy:
        msg = proc.recv(wait, f"running {kind} round trips")
        latencies.frombytes(msg[1])
    values = sorted(latencies)
    return Figures(
        round_trips_per_s=len(values) / seconds,
        p50_ms=percentile(values, 50) * 1000,
        p99_ms=percentile(values, 99) * 1000,
        count=len(values),
        server_cpu_us=server_cpu / max(1, len(values)) * 1e6,
        client_cpu_us=client_cpu / max(1, len(values)) * 1e6,
        other_cpu_pct=max(0.0, other_cpu) / seconds * 100,
    )


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def build_results(measured: dict[int, tuple[Figures, Figures]]) -> dict:
    """The JSON document: one entry per client count, and whether the 64-client target is met."""
    results = []
    for n, (ours, echo) in measured.items():
        ref = DLROVER_REF.get(n)
        results.append(
            {
                "clients": n,
                "round_trips_per_s": round(ours.round_trips_per_s, 1),
                "p50_ms": round(ours.p50_ms, 3),
                "p99_ms": round(ours.p99_ms, 3),
                "echo_round_trips_per_s": round(echo.round_trips_per_s, 1),
                "echo_p50_ms": round(echo.p50_ms, 3),
                "echo_p99_ms": round(echo.p99_ms, 3),
                "ratio_to_echo": _ratio(ours.round_trips_per_s, echo.round_trips_per_s),
                "ratio_to_dlrover_ref": _ratio(ours.round_trips_per_s, ref[0]) if ref else None,
                "server_cpu_us_per_rt": round(ours.server_cpu_us, 1),
                "client_cpu_us_per_rt": round(ours.client_cpu_us, 1),
                "echo_server_cpu_us_per_rt": round(echo.server_cpu_us, 1),
                "echo_client_cpu_us_per_rt": round(echo.client_cpu_us, 1),
                "other_load_cpu_pct": round(max(ours.other_cpu_pct, echo.other_cpu_pct), 1),
            }
        )
    target = measured.get(TARGET_CLIENTS)
    met = bool(
        target
        and target[0].round_trips_per_s >= TARGET_RATIO * DLROVER_REF[TARGET_CLIENTS][0]
        and target[0].p99_ms < TARGET_P99_MS
    )
    return {"benchmark": "sharding", "results": results, "target_met_64": met}


def print_table(doc: dict, seconds: float, out=sys.stdout) -> None:
    w = out.write
    w(
        f"\nshard round trips (get_shard + report_progress), {seconds:g}s per phase, "
        f"{CLIENT_PROCESSES} client processes, loopback gRPC, {os.cpu_count()} cores\n\n"
    )
    head = (
        f"{'clients':>7} | {'master rt/s':>11} {'p50 ms':>7} {'p99 ms':>7} | "
        f"{'echo rt/s':>10} {'p50 ms':>7} {'p99 ms':>7} | {'x echo':>6} | "
        f"{'DLRover ref rt/s':>16} {'ref p99':>7} {'x ref':>6}"
    )
    w(head + "\n" + "-" * len(head) + "\n")
    for r in doc["results"]:
        ref = DLROVER_REF.get(r["clients"])
        ref_cols = (
            f"{ref[0]:>16,.0f} {ref[1]:>7g} {r['ratio_to_dlrover_ref']:>5.2f}x"
            if ref
            else f"{'-':>16} {'-':>7} {'-':>6}"
        )
        w(
            f"{r['clients']:>7} | {r['round_trips_per_s']:>11,.0f} {r['p50_ms']:>7.2f} "
            f"{r['p99_ms']:>7.2f} | {r['echo_round_trips_per_s']:>10,.0f} "
            f"{r['echo_p50_ms']:>7.2f} {r['echo_p99_ms']:>7.2f} | {r['ratio_to_echo']:>5.2f}x | "
            f"{ref_cols}\n"
        )
    w(
        "\n'echo': two trivial unary calls per round trip on a bare gRPC server, same thread "
        "pool and client layout,\nmeasured in this run: the transport-only ceiling.\n"
        "'DLRover ref': DLRover 0.6.1 figures from the issue, measured earlier on this machine "
        "with its own client;\nNOT measured in this run.\n\n"
    )
    head = (
        f"{'clients':>7} | {'CPU us per round trip: master':>29} {'clients':>7} | "
        f"{'echo server':>11} {'clients':>7} | {'other load %CPU':>15}"
    )
    w(head + "\n" + "-" * len(head) + "\n")
    for r in doc["results"]:
        w(
            f"{r['clients']:>7} | {r['server_cpu_us_per_rt']:>29,.0f} "
            f"{r['client_cpu_us_per_rt']:>7,.0f} | {r['echo_server_cpu_us_per_rt']:>11,.0f} "
            f"{r['echo_client_cpu_us_per_rt']:>7,.0f} | {r['other_load_cpu_pct']:>15.0f}\n"
        )
    worst = max((r["other_load_cpu_pct"] for r in doc["results"]), default=0.0)
    if worst > OTHER_LOAD_WARN_PCT:
        w(
            f"WARNING: processes outside this benchmark used up to {worst:.0f}% of a core during "
            "a measured window;\nthe figures above are lower and noisier than on an idle machine.\n"
        )
    w("\n")
    ref_tp = DLROVER_REF[TARGET_CLIENTS][0] * TARGET_RATIO
    measured = any(r["clients"] == TARGET_CLIENTS for r in doc["results"])
    verdict = ("MET" if doc["target_met_64"] else "NOT MET") if measured else "not measured (no 64)"
    w(
        f"target at {TARGET_CLIENTS} clients: >= {ref_tp:,.0f} rt/s "
        f"({TARGET_RATIO:g}x DLRover ref) and p99 < {TARGET_P99_MS:g} ms: {verdict}\n\n"
    )
    out.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,16,64", help="comma-separated client counts")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per phase")
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
    measured: dict[int, tuple[Figures, Figures]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sharding-") as tmp:
        try:
            master = _Child(ctx, "master", _server_main, "master", tmp)
            children.append(master)
            echo = _Child(ctx, "echo", _server_main, "echo", tmp)
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
                dataset = f"bench-{n}-clients"
                _create_dataset(addr, token, node_ids[0], dataset)
                ours = run_phase(
                    master,
                    client_procs,
                    "master",
                    addr,
                    token,
                    dataset,
                    clients,
                    args.warmup,
                    args.seconds,
                )
                log.info(
                    "%2d clients, master: %7.0f rt/s, p50 %.2f ms, p99 %.2f ms, "
                    "CPU us/rt server %.0f clients %.0f, other load %.0f%%",
                    n,
                    ours.round_trips_per_s,
                    ours.p50_ms,
                    ours.p99_ms,
                    ours.server_cpu_us,
                    ours.client_cpu_us,
                    ours.other_cpu_pct,
                )
                base = run_phase(
                    echo,
                    client_procs,
                    "echo",
                    echo_addr,
                    token,
                    "",
                    clients,
                    args.warmup,
                    args.seconds,
                )
                log.info(
                    "%2d clients, echo:   %7.0f rt/s, p50 %.2f ms, p99 %.2f ms, "
                    "CPU us/rt server %.0f clients %.0f, other load %.0f%%",
                    n,
                    base.round_trips_per_s,
                    base.p50_ms,
                    base.p99_ms,
                    base.server_cpu_us,
                    base.client_cpu_us,
                    base.other_cpu_pct,
                )
                measured[n] = (ours, base)
        finally:
            for child in reversed(children):
                child.stop()
    doc = build_results(measured)
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
