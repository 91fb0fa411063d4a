"""The master process of benchmarks/scale.py: a real JobMaster on a simulated platform, and
the standalone rendezvous master of its 256-node rendezvous."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import signal
import threading
import time
from array import array

LAG_TICK_S = 0.01  # the loop-lag probe sleeps this long at a time
HEARTBEAT_INTERVAL_MS = 1000  # what the master tells nodes (they beat at 1 Hz here anyway)
READY_TIMEOUT_S = 180.0


def simulated_platform():
    """A platform whose nodes are simulated elsewhere: launching does nothing, a kill ends the
    incarnation at once (its exit event), as a real platform reports a killed process."""
    from master.platform.api import NodeEvent, Platform

    class SimulatedPlatform(Platform):
        def __init__(self) -> None:
            super().__init__()
            self._running: dict[int, tuple[str, int]] = {}
            self._lock = threading.Lock()

        def address_for(self, node_type: str, rank: int) -> str:
            return f"sim-{node_type}-{rank}:2222"

        def launch(self, spec) -> None:
            with self._lock:
                self._running[spec.id] = (spec.type, spec.rank)

        def signal_node(self, node_id: int, sig: int = signal.SIGKILL) -> bool:
            with self._lock:
                node = self._running.pop(node_id, None)
            if node is None:
                return False
            self.events.put(NodeEvent(node[0], node[1], node_id, exit_code=-sig))
            return True

        def stop_node(self, node_id: int, grace_seconds: float) -> None:
            self.signal_node(node_id, signal.SIGTERM)

        def shutdown(self, grace_seconds: float) -> None:
            with self._lock:
                self._running.clear()

    return SimulatedPlatform()


def thread_group(name: str) -> str:
    """A Python thread's name without its indices ("rpc-wait_3" -> "rpc-wait", "Thread-2
    (_poll_wrapper)" -> "Thread (_poll_wrapper)", gRPC's poller)."""
    return re.sub(r"[_-]?\d+", "", name)


def thread_cpu(me) -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed per Python thread name (pool
    indices dropped); threads Python did not start (gRPC's core, SQLite's) are "native"."""
    names = {t.native_id: thread_group(t.name) for t in threading.enumerate()}
    out: dict[str, float] = {}
    for t in me.threads():
        group = names.get(t.id, "native")
        out[group] = out.get(group, 0.0) + t.user_time + t.system_time
    return out


def watch_loop_lag(loop, lags: array) -> None:
    """On `loop`, sleep LAG_TICK_S again and again and append how late each wake-up came: how
    long a ready callback waits for the loop (its iterations' length)."""

    async def probe() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(LAG_TICK_S)
            lags.append(time.monotonic() - t - LAG_TICK_S)

    asyncio.run_coroutine_threadsafe(probe(), loop)


def handler_seconds(histogram) -> dict[str, tuple[float, float]]:
    """Per RPC method: (calls, seconds) its handlers took so far (the timing interceptor's
    histogram: from the handler's start to its end, not counting the wait to be accepted)."""
    out: dict[str, list[float]] = {}
    for metric in histogram.collect():
        for sample in metric.samples:
            kind = sample.name.rsplit("_", 1)[-1]
            if kind in ("count", "sum"):
                slot = out.setdefault(sample.labels["method"], [0.0, 0.0])
                slot[kind == "sum"] += sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def master_main(
    conn, tmp_dir: str, workers: int, ps: int, timeout_s: float, server_kind: str = "aio"
) -> None:
    """Run a job of `workers` + `ps` simulated nodes; answer the parent's requests until "stop".

    Requests: "cpu" -> (CPU seconds of this process, monotonic time, RSS MB, peak RSS MB,
    threads, CPU seconds per thread group, loop-lag samples so far, handler (calls, seconds)
    per method, per collector generation (collections so far, longest pause since the last
    request)); "lags" -> the aio server's loop-lag samples (seconds, array "d" bytes);
    "detected" -> [(node id, monotonic time of its heartbeat_lost event)]."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="[master] %(levelname)s %(message)s")
    import psutil

    from master.cli.submit import rpc_threads
    from master.config import parse_job_spec
    from master.job.master import JobMaster, JobRuntime
    from master.observability.endpoint import Observability
    from master.rpc.aio_server import start_aio_server
    from master.rpc.server import start_server
    from master.rpc.serving_gc import serving_gc
    from master.state.sqlite import SQLiteStateStore

    detected: list[tuple[int, float]] = []

    def on_event(event) -> None:
        if event.kind == "heartbeat_lost":
            detected.append((event.node_id, time.monotonic()))

    spec = parse_job_spec(
        {
            "name": "bench-scale",
            "command": ["true"],
            "worker": {"replicas": workers, "max_relaunches": 100_000},
            "ps": {"replicas": ps, "max_relaunches": 100_000},
            "heartbeat_timeout_seconds": timeout_s,
            # A node falsely declared lost is counted (false_lost_nodes); its relaunch must
            # not end the job and take every other node's figures with it.
            "max_relaunches": 100_000,
        },
        source="bench",
        base_dir=tmp_dir,
    )
    store = SQLiteStateStore(os.path.join(tmp_dir, "state.sqlite"))
    platform = simulated_platform()
    runtime = JobRuntime(run_dir=tmp_dir, master_addr="", token_file="")
    job = JobMaster(spec, platform, store, runtime, on_event=on_event)
    observability = Observability(job, "127.0.0.1", 0)
    token = secrets.token_urlsafe(32)
    start = start_aio_server if server_kind == "aio" else start_server
    server, port = start(
        job,
        "127.0.0.1",
        0,
        token,
        rpc_threads(512, spec),  # as `dlrover submit` with the default MasterConfig
        HEARTBEAT_INTERVAL_MS,
        interceptors=observability.interceptors(),
    )
    runtime.master_addr = f"127.0.0.1:{port}"
    with serving_gc():  # as `dlrover submit` runs the job
        runner = threading.Thread(target=job.run, name="job", daemon=True)
        runner.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:  # every node launched (marked running)
            current = job.nodes.all_current()
            if len(current) == workers + ps and all(n.state.value == "running" for n in current):
                break
            time.sleep(0.05)
        nodes = [(n.type, n.rank, n.id) for n in job.nodes.all_current()]
        conn.send(("ready", port, token, nodes))
        observability.gc_pauses.start()  # what Observability.start() starts in `dlrover submit`
        me = psutil.Process()
        peak = [0.0]
        lags = array("d")
        if server_kind == "aio":
            watch_loop_lag(server.loop, lags)

        def sample_rss() -> None:
            while runner.is_alive():
                peak[0] = max(peak[0], me.memory_info().rss / 2**20)
                time.sleep(0.1)

        threading.Thread(target=sample_rss, name="rss", daemon=True).start()
        try:
            while True:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    break
                if request == "cpu":
                    t = os.times()
                    rss = me.memory_info().rss / 2**20
                    peak[0] = max(peak[0], rss)
                    conn.send(
                        (
                            "cpu",
                            t.user + t.system,
                            time.monotonic(),
                            rss,
                            peak[0],
                            me.num_threads(),
                            thread_cpu(me),
                            len(lags),
                            handler_seconds(observability.metrics.rpc_seconds),
                            observability.gc_pauses.take_worst(),
                        )
                    )
                elif request == "lags":
                    conn.send(("lags", lags.tobytes()))
                elif request == "detected":
                    conn.send(("detected", list(detected)))
                else:
                    break
        finally:
            job.request_stop("benchmark done")
            runner.join(10)
            server.stop(grace=0).wait()
            observability.stop()
            store.close()


def serve_rendezvous(conn, state_path: str) -> None:
    from master.rpc.standalone import start_standalone_master

    logging.basicConfig(level=logging.WARNING)
    server, port, token = start_standalone_master(max_workers=2048, state_path=state_path)
    conn.send(("ready", port, token))
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    server.stop(grace=0).wait()
