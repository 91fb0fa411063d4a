"""DLRover 0.6.1's job master in benchmarks/sharding.py, measured in the same run: the same
client counts taking and finishing shards with DLRover's own client (`get_task`, then
`report_task_result`: two unary calls per shard), from the anchors environment
(benchmarks/anchors.py; `make anchors` builds it)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import anchors

CLIENT_PROCESSES = 2
READY_TIMEOUT_S = 120.0
START_MARGIN_S = 1.0
DATASET_SIZE = 1024 * 200_000  # 200,000 shards of 1,024 records: more than any phase takes
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchor_shard_clients.py")


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def available() -> bool:
    """Whether the anchors environment (DLRover 0.6.1) is there."""
    return anchors.python() is not None


def _read_line(proc: subprocess.Popen, what: str) -> str:
    """The next protocol line of a client process (DLRover's own log lines are skipped)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"DLRover client process exited (code {proc.poll()}) while {what}")
        line = line.strip()
        if line == "ready" or line.startswith("{"):
            return line


class DLRoverShards:
    """DLRover's local job master, started once; measure() runs one phase against it."""

    def __init__(self, log_path: str, max_clients: int) -> None:
        self._log_path = log_path
        self.master = anchors.DLRoverMaster("bench-sharding", log_path, nodes=max_clients)

    def stop(self) -> None:
        self.master.stop()

    def measure(
        self, clients: int, warmup: float, seconds: float
    ) -> tuple[list[float], tuple[float, float, float]]:
        """(latencies of the round trips ending in the window, (server, clients, other) CPU
        seconds in the window)."""
        import psutil

        dataset = f"bench-{clients}-clients"
        procs: list[subprocess.Popen] = []
        first = 0
        try:
            for i in range(CLIENT_PROCESSES):
                count = clients // CLIENT_PROCESSES + (1 if i < clients % CLIENT_PROCESSES else 0)
                if not count:
                    continue
                cmd = [anchors.python(), SCRIPT, self.master.addr, dataset, str(first), str(count)]
                cmd += [str(warmup), str(seconds)]
                if first == 0:
                    cmd += ["--create", str(DATASET_SIZE)]
                first += count
                with open(self._log_path, "ab") as log:
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=log,
                            text=True,
                        )
                    )
                if len(procs) == 1:  # the dataset exists before the other process asks
                    line = _read_line(procs[0], "connecting")
                    if line != "ready":
                        raise RuntimeError(f"DLRover clients: {line}")
            for p in procs[1:]:
                line = _read_line(p, "connecting")
                if line != "ready":
                    raise RuntimeError(f"DLRover clients: {line}")
            start_at = time.monotonic() + START_MARGIN_S
            for p in procs:
                p.stdin.write(f"{start_at}\n")
                p.stdin.flush()
            server = psutil.Process(self.master.proc.pid)
            client_ps = [psutil.Process(p.pid) for p in procs]

            def sample() -> tuple[float, float, float]:
                def used(ps: list) -> float:
                    total = 0.0
                    for q in ps:
                        t = q.cpu_times()
                        total += t.user + t.system
                    return total

                machine = psutil.cpu_times()
                busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
                s = used([server, *server.children(recursive=True)])
                c = used(client_ps)
                return s, c, busy - s - c

            _sleep_until(start_at + warmup)
            cpu0 = sample()
            _sleep_until(start_at + warmup + seconds)
            cpu1 = sample()
            latencies: list[float] = []
            for p in procs:
                doc = json.loads(_read_line(p, "running round trips"))
                if doc.get("errors") or doc.get("error"):
                    raise RuntimeError(f"DLRover clients: {doc.get('errors') or doc['error']}")
                latencies.extend(doc["latencies"])
            cpu = tuple(b - a for a, b in zip(cpu0, cpu1, strict=True))
            return latencies, cpu
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
