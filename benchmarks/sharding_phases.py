"""The phases of benchmarks/sharding.py: client processes (a thread and a connection per
simulated node) running shard round trips from one common start, and the parent's side that
drives them and measures a phase's figures."""

from __future__ import annotations

import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from common import Child, CpuMeter, percentile, sleep_until

CLIENT_PROCESSES = 2
DATASET_SIZE = 10**9  # never runs out: a phase uses well under 0.1% of it
BATCH_SIZE = 64
RECORDS_PER_SHARD = BATCH_SIZE * 16
MODES = ("coalesced", "worker", "unary")
# Each simulated node gets its own TCP connection (by default gRPC shares one per process).
PRIVATE_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
START_MARGIN_S = 0.3  # between "every client connected" and the common start time
CLIENT_READY_TIMEOUT_S = 60.0
RESULT_GRACE_S = 60.0  # how long past a phase's end its results may take

# -- clients (two processes, one thread per client) ------------------------------------------


@dataclass(frozen=True)
class Phase:
    """What one client process runs in one phase."""

    kind: str  # "master" or "echo"
    mode: str  # "coalesced", "worker" or "unary" (see benchmarks/sharding.py's docstring)
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


def client_main(conn: multiprocessing.connection.Connection) -> None:
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
    """One phase's measured figures (of our master, the echo server, or DLRover's master)."""

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


def create_dataset(addr: str, token: str, node_id: int, name: str) -> None:
    """Declare the benchmark's dataset `name` on the master at `addr`, as node `node_id`."""
    from master.client import MasterClient, NodeIdentity

    client = MasterClient(addr, token, NodeIdentity("worker", 0, node_id))
    try:
        client.create_dataset(_dataset_spec(name))
    finally:
        client.close()


def run_phase(
    server: Child,
    client_procs: list[Child],
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
    meter = CpuMeter(server, client_procs)
    sleep_until(start_at + warmup)
    cpu0 = meter.sample()
    sleep_until(start_at + warmup + seconds)
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
