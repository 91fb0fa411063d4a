"""DLRover 0.6.1's master under the sharding benchmark's load, driven by its own client.

Run by the anchors' Python (see anchors.py). ``anchor_sharding.py create ADDR NAME`` declares a
dataset as a DLRover worker does (``report_dataset_shard_params``: batch 64, 16 batches a shard,
the size of ours). ``anchor_sharding.py run ADDR NAME RANKS WARMUP SECONDS`` starts one thread
per rank, each a ``GrpcMasterClient`` with a connection of its own, prints ``ready`` once every
one is connected, reads the common start (a monotonic time) from stdin, then takes a shard
(``get_task``) and reports it done (``report_task_result``) back to back; it ends with one JSON
line: the round-trip latencies that ended inside the measured window.

``DLRoverShardPhases`` is the parent's side (our venv): it runs DLRover's master and these
client processes, and measures the master's CPU as benchmarks/sharding.py measures ours.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import threading
import time
from array import array
from dataclasses import dataclass

BATCH_SIZE = 64
BATCHES_PER_SHARD = 16
DATASET_SIZE = 10**9  # as benchmarks/sharding.py: never runs out
READY_TIMEOUT_S = 60.0
START_MARGIN_S = 0.3
RESULT_GRACE_S = 60.0
HERE = os.path.abspath(__file__)


@dataclass
class DLRoverPhase:
    """One measured window against DLRover's master (times in seconds, CPU in seconds)."""

    latencies: list[float]  # ascending
    seconds: float
    server_cpu: float
    client_cpu: float


class DLRoverShardPhases:
    """DLRover 0.6.1's master (started once) and phases of shard round trips against it."""

    def __init__(self, log_path: str, processes: int) -> None:
        import anchors

        self._exe = anchors.python()
        if self._exe is None:
            raise RuntimeError(anchors.MISSING)
        self.master = anchors.DLRoverMaster("bench-sharding", log_path)
        self.processes = processes
        self.version = anchors.DLROVER_VERSION

    def phase(self, name: str, clients: int, warmup: float, seconds: float) -> DLRoverPhase:
        """Declare dataset `name`, then run `clients` DLRover clients for one window."""
        import psutil

        addr = self.master.addr
        subprocess.run([self._exe, HERE, "create", addr, name], check=True, timeout=120)
        shares = [list(range(clients))[i :: self.processes] for i in range(self.processes)]
        procs = [
            subprocess.Popen(
                [self._exe, HERE, "run", addr, name, ",".join(map(str, share))]
                + [str(warmup), str(seconds)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for share in shares
            if share
        ]
        try:
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("a DLRover client process did not connect")
            start = time.monotonic() + START_MARGIN_S
            for p in procs:
                p.stdin.write(f"{start}\n")
                p.stdin.flush()
            server = psutil.Process(self.master.proc.pid)
            clients_ps = [psutil.Process(p.pid) for p in procs]

            def cpu(ps: list) -> float:
                return sum(t.user + t.system for t in (q.cpu_times() for q in ps))

            time.sleep(max(0.0, start + warmup - time.monotonic()))
            s0, c0 = cpu([server, *server.children(recursive=True)]), cpu(clients_ps)
            time.sleep(max(0.0, start + warmup + seconds - time.monotonic()))
            s1, c1 = cpu([server, *server.children(recursive=True)]), cpu(clients_ps)
            latencies = array("d")
            for p in procs:
                out, _ = p.communicate(timeout=RESULT_GRACE_S)
                doc = json.loads(out.splitlines()[-1])
                if doc["errors"]:
                    raise RuntimeError("DLRover clients failed: " + "; ".join(doc["errors"]))
                latencies.frombytes(base64.b64decode(doc["latencies"]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return DLRoverPhase(sorted(latencies), seconds, s1 - s0, c1 - c0)

    def stop(self) -> None:
        self.master.stop()


def _private_connections() -> None:
    """Every channel gets a TCP connection of its own (by default gRPC shares one per process)."""
    import grpc

    shared = grpc.insecure_channel

    def private(target, options=None, *args, **kwargs):
        options = [*(options or []), ("grpc.use_local_subchannel_pool", 1)]
        return shared(target, options, *args, **kwargs)

    grpc.insecure_channel = private


def _client(addr: str, rank: int):
    """A DLRover worker's master client, as its training processes build it."""
    from dlrover.python.elastic_agent.master_client import GrpcMasterClient

    return GrpcMasterClient(addr, rank, "worker", timeout=60)


def create(addr: str, name: str) -> None:
    client = _client(addr, 0)
    client.report_dataset_shard_params(
        batch_size=BATCH_SIZE,
        num_epochs=1,
        dataset_size=DATASET_SIZE,
        shuffle=False,
        num_minibatches_per_shard=BATCHES_PER_SHARD,
        dataset_name=name,
        task_type=0,  # elastic_training_pb2.TRAINING
    )
    ok, task = client.get_task(name)
    if not ok or task.shard.end <= task.shard.start:
        raise SystemExit(f"DLRover's master gave no shard of {name}: {task}")
    client.report_task_result(name, task.task_id, "")


def run(addr: str, name: str, ranks: list[int], warmup: float, seconds: float) -> None:
    latencies = array("d")
    errors: list[str] = []
    lock = threading.Lock()
    connected = threading.Barrier(len(ranks) + 1)
    window: list[float] = []  # the common start, set before the barrier's second round

    def loop(rank: int) -> None:
        try:
            client = _client(addr, rank)
            connected.wait()
            connected.wait()
            start = window[0]
            begin, end = start + warmup, start + warmup + seconds
            mine = array("d")
            time.sleep(max(0.0, start - time.monotonic()))
            while (t0 := time.monotonic()) < end:
                ok, task = client.get_task(name)
                if not ok or task.shard.end <= task.shard.start:
                    raise RuntimeError(f"no shard: {task}")
                client.report_task_result(name, task.task_id, "")
                t1 = time.monotonic()
                if begin <= t1 < end:
                    mine.append(t1 - t0)
            with lock:
                latencies.extend(mine)
        except threading.BrokenBarrierError:
            pass
        except Exception as e:  # reported, never hidden
            with lock:
                errors.append(f"rank {rank}: {e!r}")
            connected.abort()

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    try:
        connected.wait(timeout=READY_TIMEOUT_S)
        print("ready", flush=True)
        window.append(float(sys.stdin.readline()))
        connected.wait(timeout=READY_TIMEOUT_S)
    except threading.BrokenBarrierError:
        connected.abort()
    for t in threads:
        t.join()
    print(
        json.dumps(
            {"latencies": base64.b64encode(latencies.tobytes()).decode(), "errors": errors[:3]}
        ),
        flush=True,
    )


def main() -> None:
    logging.disable(logging.WARNING)
    _private_connections()
    verb, addr, name = sys.argv[1:4]
    if verb == "create":
        create(addr, name)
    else:
        ranks = [int(r) for r in sys.argv[4].split(",")]
        run(addr, name, ranks, float(sys.argv[5]), float(sys.argv[6]))


if __name__ == "__main__":
    main()
