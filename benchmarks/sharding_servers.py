"""The servers of benchmarks/sharding.py, each in its own process: our master (a JobMaster as
`dlrover submit` builds it, no node launched) and the "echo" (the Master service's shard methods
answering pre-encoded replies without any work: the transport-only ceiling)."""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import secrets
import signal
from collections.abc import Callable, Iterator

from sharding_phases import RECORDS_PER_SHARD

WORKER_REPLICAS = 64
SERVER_THREADS = 512  # as `dlrover submit` (MasterConfig.max_workers)
BENCH_RATE_PER_SECOND = 100_000.0  # the master's per-connection rate limit in this benchmark


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


def server_main(
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
