"""A job's nodes hold server threads in long calls (progress streams, KV waits): the master
sizes its thread pool from the job, so heartbeats and shard asks are still answered."""

from __future__ import annotations

import threading
import time

from master.cli.submit import THREADS_PER_NODE, rpc_threads
from master.client import KVClient, MasterClient, NodeIdentity, ProgressStream
from master.config import parse_job_spec
from master.job.master import JobMaster, JobRuntime
from master.platform.local import LocalPlatform
from master.rpc.server import start_server
from master.state.sqlite import SQLiteStateStore

from .conftest import TOKEN
from .test_progress_stream import make_dataset

WORKERS = 120
CONFIGURED = 64  # a pool this small would be filled by the long calls below


def test_long_calls_of_every_node_leave_threads_for_heartbeats(tmp_path):
    spec = parse_job_spec(
        {"name": "threads", "command": ["true"], "worker": {"replicas": WORKERS}},
        source="test",
        base_dir=str(tmp_path),
    )
    threads = rpc_threads(CONFIGURED, spec)
    assert threads >= THREADS_PER_NODE * (WORKERS + 2)
    store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
    platform = LocalPlatform()
    job = JobMaster(spec, platform, store, JobRuntime(str(tmp_path), "", ""))
    server, port = start_server(job, "127.0.0.1", 0, TOKEN, threads, 1000)
    clients, streams, waiters = [], [], []
    stop = threading.Event()

    def hold_a_wait(kv: KVClient) -> None:
        try:
            kv.wait([b"never"], 30.0)
        except Exception:
            if not stop.is_set():  # the test ends its waits by stopping the master under them
                raise

    try:
        for rank in range(WORKERS):
            node = job.nodes.new_incarnation("worker", rank, 0, 0)
            job.nodes.mark_running(node.id, f"127.0.0.1:{20000 + rank}", "")
            identity = NodeIdentity("worker", rank, node.id)
            clients.append(MasterClient(f"127.0.0.1:{port}", TOKEN, identity))
        make_dataset(clients[0], size=10**6)
        for c in clients:
            # Each node: an open progress stream and a KV wait, both held on the server.
            stream = ProgressStream(c)
            stream.send("d", [(10**9, 1)])  # a stale shard id: ignored, the stream stays open
            streams.append(stream)
            kv = KVClient(c)
            t = threading.Thread(target=hold_a_wait, args=(kv,), daemon=True)
            t.start()
            waiters.append(t)
        time.sleep(1.0)  # every wait has reached the server
        started = time.monotonic()
        for c in clients[:10]:
            c.heartbeat()
        shard = clients[-1].get_shard("d").shard
        assert shard.end - shard.start == 100
        assert time.monotonic() - started < 10.0, "heartbeats waited for a free server thread"
    finally:
        stop.set()
        server.stop(grace=0).wait()
        for c in clients:
            c.close()
        for t in waiters:  # none may outlive the test and fail in a later one
            t.join(timeout=30)
        assert not any(t.is_alive() for t in waiters)
        job.sharding.close()
        platform.shutdown(1)
        store.close()
