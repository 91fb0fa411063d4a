"""The master's gRPC endpoint: token check, request validation, and the Master service."""

from __future__ import annotations

import dataclasses
import errno
import hmac
import logging
import socket
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
import numpy as np

from master.client import MAX_MESSAGE_BYTES, TOKEN_METADATA_KEY
from master.client.tls import ServerTLS
from master.job.checkpoints import Checkpoint
from master.job.master import JobMaster
from master.nodes.manager import MasterResumingError, StaleNodeError
from master.nodes.model import ExitReason, Node, ReportedExit
from master.pb import cluster_pb2, common_pb2, data_pb2, master_pb2_grpc, nodes_pb2
from master.rpc.guard import check_wait_ms, guard
from master.rpc.ratelimit import DEFAULT_RATE_PER_SECOND, RateLimitInterceptor, TokenBuckets
from master.rpc.rewrap import InterceptedHandlers
from master.sharding.ledger import DatasetSpec, StaleShardError
from master.sharding.service import ShardStatus

log = logging.getLogger(__name__)

# Calls the server may hold before a thread picks them up, per server thread (the thread count
# grows with the job: master.cli.submit.rpc_threads); never fewer than gRPC's own default.
PENDING_CALLS_PER_THREAD = 2
MIN_PENDING_CALLS = 1_000
_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(DatasetSpec))
_EXIT_REASONS = {
    nodes_pb2.SUCCEEDED: ExitReason.SUCCEEDED,
    nodes_pb2.OOM: ExitReason.OOM,
    nodes_pb2.KILLED: ExitReason.KILLED,
    nodes_pb2.USER_ERROR: ExitReason.USER_ERROR,
    nodes_pb2.HARDWARE: ExitReason.HARDWARE,
    nodes_pb2.HEARTBEAT_LOST: ExitReason.HEARTBEAT_LOST,
}


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects every call whose x-dlrover-token does not match the job token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        def deny(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong job token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._token):
                    return continuation(handler_call_details)
                break
        return self._deny


def check_node(job: JobMaster, ref: common_pb2.NodeRef) -> Node:
    """The node behind a request. While a restarted master restores its nodes, one it does
    not know yet may be one it is about to adopt: the request is to be retried, not refused."""
    try:
        return job.nodes.check(ref.type, ref.rank, ref.id)
    except StaleNodeError:
        # The job's own flag, or rendezvous rounds loaded from a previous master and not yet
        # resumed (a master whose resume was not announced when it was built).
        if job.resuming or job.rendezvous.resuming:
            raise MasterResumingError("the master is resuming its job; retry") from None
        raise


class MasterServicer(master_pb2_grpc.MasterServicer):
    """Implements the Master service on top of a JobMaster."""

    def __init__(self, job: JobMaster, heartbeat_interval_ms: int) -> None:
        self.job = job
        self.heartbeat_interval_ms = heartbeat_interval_ms

    def _node(self, ref: common_pb2.NodeRef) -> Node:
        if not ref.type:
            raise ValueError("the request names no node (node.type is empty)")
        return check_node(self.job, ref)

    def _cluster(self) -> cluster_pb2.ClusterSpec:
        cluster = self.job.tf_cluster()
        return cluster_pb2.ClusterSpec(
            version=self.job.cluster_version,
            ps=cluster.get("ps", []),
            chief=cluster.get("chief", []),
            worker=cluster.get("worker", []),
        )

    # -- nodes --------------------------------------------------------------

    @guard
    def RegisterNode(self, request, context):  # noqa: N802 (gRPC method names)
        node = self._node(request.node)
        self.job.nodes.on_register(node)
        return nodes_pb2.RegisterReply(
            cluster=self._cluster(), heartbeat_interval_ms=self.heartbeat_interval_ms
        )

    @guard
    def Heartbeat(self, request, context):  # noqa: N802
        node = self._node(request.node)
        if request.global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {request.global_step}")
        commands = self.job.nodes.on_heartbeat(node, request.stats, request.global_step)
        if request.global_step:
            self.job.note_global_step(request.global_step)
        return nodes_pb2.HeartbeatReply(commands=commands)

    @guard
    def ReportExit(self, request, context):  # noqa: N802
        node = self._node(request.node)
        if request.reason not in nodes_pb2.ExitReason.values():
            raise ValueError(f"unknown exit reason {request.reason}")
        # Applied when the platform sees the process end (master.job.exits.ExitHandler).
        node.reported_exit = ReportedExit(
            _EXIT_REASONS.get(request.reason, ExitReason.UNKNOWN), request.message[-4000:]
        )
        return common_pb2.Empty()

    @guard
    def GetJobStatus(self, request, context):  # noqa: N802
        return job_status_pb(self.job)

    @guard
    def Scale(self, request, context):  # noqa: N802
        result = self.job.request_scale(
            request.node_type, request.replicas, request.reason or "by command"
        )
        return nodes_pb2.ScaleReply(
            previous=result.previous,
            replicas=result.replicas,
            cluster_version=result.cluster_version,
        )

    @guard
    def MigrateNode(self, request, context):  # noqa: N802
        result = self.job.request_migrate(
            request.node_type,
            request.rank,
            request.memory_mb,
            request.cpu,
            request.reason or "by command",
        )
        return nodes_pb2.MigrateReply(
            node_id=result.node_id, checkpoint_step=result.checkpoint_step
        )

    @guard
    def GetClusterSpec(self, request, context):  # noqa: N802
        self._node(request)
        return self._cluster()

    # -- data ---------------------------------------------------------------

    @guard
    def CreateDataset(self, request, context):  # noqa: N802
        self._node(request.node)
        spec = DatasetSpec(**{f: getattr(request.spec, f) for f in _SPEC_FIELDS})
        return data_pb2.CreateDatasetReply(created=self.job.sharding.create(spec))

    @guard
    def GetShard(self, request, context):  # noqa: N802
        node = self._node(request.node)
        wait = check_wait_ms(request.wait_ms)
        if request.request_id < 0:
            raise ValueError(f"request_id must be >= 0, got {request.request_id}")
        grant = self.job.sharding.get_shard(
            request.dataset,
            node.id,
            wait,
            request.request_id,
            indices=not request.indices_local,
        )
        if grant.status == ShardStatus.SHARD:
            self.job.nodes.note_progress(node, stepped=False)
            s = grant.shard
            return data_pb2.GetShardReply(
                status=data_pb2.GetShardReply.SHARD,
                shard=data_pb2.Shard(
                    shard_id=s.shard_id,
                    epoch=s.epoch,
                    start=s.start,
                    end=s.end,
                    record_indices=b"" if grant.indices is None else encode_indices(grant.indices),
                ),
            )
        status = (
            data_pb2.GetShardReply.END
            if grant.status == ShardStatus.END
            else data_pb2.GetShardReply.PENDING
        )
        return data_pb2.GetShardReply(status=status)

    def ShardStream(self, request_iterator, context):  # noqa: N802
        """Refused here: on this thread-per-call server an open stream would hold a thread for
        the node's whole life (the aio server answers asks on streams). Nodes then ask by
        unary `GetShard` calls."""
        context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "shard asks on a stream are served by the aio server only; ask by GetShard",
        )

    @guard
    def ReportProgress(self, request, context):  # noqa: N802
        node = self._node(request.node)
        if request.global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {request.global_step}")
        self._carried_heartbeat(node, request)
        reports = [(r.shard_id, r.records_consumed) for r in request.reports]
        self.job.sharding.report(request.dataset, node.id, reports)
        self.job.nodes.note_progress(node, steps=request.steps)
        if request.global_step:
            self.job.note_global_step(request.global_step)
        if request.HasField("loss"):
            self.job.note_loss(request.loss)
        return data_pb2.ReportProgressReply(applied=len(reports))

    @guard
    def StreamProgress(self, request_iterator, context):  # noqa: N802
        """Apply a node's per-step reports in order; stale shard reports are skipped."""
        stream = ProgressStreamState(self)
        try:
            for request in request_iterator:
                stream.apply(request)
        finally:
            stream.close()
        return stream.reply()

    def _carried_heartbeat(self, node: Node, request: data_pb2.ReportProgressRequest) -> None:
        """The node's heartbeat, when its progress report carries one."""
        if request.HasField("heartbeat_stats"):
            self.job.nodes.on_carried_heartbeat(node, request.heartbeat_stats, request.global_step)

    @guard
    def ReturnShards(self, request, context):  # noqa: N802
        node = self._node(request.node)
        n = self.job.sharding.release(request.dataset, node.id)
        return data_pb2.ReturnShardsReply(records_returned=n)

    @guard
    def SaveLedger(self, request, context):  # noqa: N802
        self._node(request.node)
        if request.global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {request.global_step}")
        # Trainers that coalesce their reports: what they trained so far counts in the
        # snapshot (the model saved after it holds it), as with a report per step.
        self.job.catch_up_positions()
        if not request.dataset:  # every dataset (a checkpoint the chief makes on request)
            for name in self.job.sharding.names():
                self.job.sharding.save_snapshot(name, request.global_step)
            return data_pb2.LedgerSnapshot(global_step=request.global_step)
        return ledger_pb(self.job.sharding.save_snapshot(request.dataset, request.global_step))

    @guard
    def ReportCheckpoint(self, request, context):  # noqa: N802
        self._node(request.node)
        self.job.on_checkpoint_reported(
            Checkpoint(request.global_step, request.path, tuple(request.datasets))
        )
        return data_pb2.CheckpointReply(latest_step=self.job.checkpoints.latest().global_step)

    @guard
    def RestoreLedger(self, request, context):  # noqa: N802
        self._node(request.node)
        if not request.dataset:
            if request.global_step < 0:
                raise ValueError(f"global_step must be >= 0, got {request.global_step}")
            self.job.on_model_restored(request.global_step)
            return data_pb2.LedgerSnapshot(global_step=request.global_step)
        return ledger_pb(self.job.sharding.restore_snapshot(request.dataset, request.global_step))


def encode_indices(indices: np.ndarray | Sequence[int]) -> bytes:
    """Record indices as little-endian int64 bytes (the wire form of Shard.record_indices)."""
    return np.asarray(indices, dtype="<i8").tobytes()


class ProgressStreamState:
    """One open progress stream: applies its messages in order (stale shard reports skipped)
    and keeps the node's stream registered while it is open. Shared by both servers."""

    def __init__(self, servicer: MasterServicer) -> None:
        self._servicer = servicer
        self._job = servicer.job
        self.node_id: int | None = None
        self.applied = 0
        self.stale = 0

    def apply(self, request: data_pb2.ReportProgressRequest) -> None:
        job = self._job
        node = self._servicer._node(request.node)
        if self.node_id is None:
            self.node_id = node.id
            job.progress_streams.opened(node.id)
        elif node.id != self.node_id:
            raise ValueError("a progress stream must carry one node's reports only")
        if request.global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {request.global_step}")
        self._servicer._carried_heartbeat(node, request)
        job.nodes.note_progress(node, steps=request.steps)
        skipped = 0
        for r in request.reports:
            try:
                job.sharding.report(request.dataset, node.id, [(r.shard_id, r.records_consumed)])
                self.applied += 1
            except StaleShardError as e:
                skipped += 1
                log.debug("skipped a stale progress report: %s", e)
        if skipped:
            # After a master restart a node re-sends every shard it ever reported.
            log.info(
                "%s: skipped %d stale progress report(s) of %d (shards already ended "
                "or handed back)",
                node.name,
                skipped,
                len(request.reports),
            )
            self.stale += skipped
        if request.global_step:
            job.note_global_step(request.global_step)
        if request.HasField("loss"):
            job.note_loss(request.loss)

    def close(self) -> None:
        if self.node_id is not None:
            self._job.progress_streams.closed(self.node_id)

    def reply(self) -> data_pb2.ReportProgressReply:
        return data_pb2.ReportProgressReply(applied=self.applied, stale=self.stale)


def ledger_pb(data: dict) -> data_pb2.LedgerSnapshot:
    """The wire form of a ledger snapshot dict."""
    spec = data.get("spec", {})
    snap = data_pb2.LedgerSnapshot(
        dataset=spec.get("name", ""),
        global_step=int(data.get("global_step", 0)),
        spec=data_pb2.DatasetSpec(**{f: spec[f] for f in _SPEC_FIELDS if f in spec}),
        epoch=int(data.get("epoch", -1)),
        records_done=int(data.get("records_done", 0)),
        records_redone=int(data.get("records_redone", 0)),
    )
    for t in data.get("todo", []):
        snap.todo.add(epoch=t["epoch"], start=t["start"], end=t["end"])
    for d in data.get("doing", []):
        snap.doing.add(epoch=d["epoch"], start=d["start"] + d.get("consumed", 0), end=d["end"])
    return snap


def job_status_pb(job: JobMaster) -> nodes_pb2.JobStatus:
    """The job's status as sent to `dlrover status` and the submit display."""
    status = nodes_pb2.JobStatus(
        name=job.spec.name,
        status=job.state.value,
        reason=job.reason,
        global_step=job.global_step,
        elapsed_seconds=job.elapsed(),
        dashboard_url=job.runtime.dashboard_url,
        cluster_version=job.cluster_version,
    )
    if job.autoscaler is not None:
        scaler = job.autoscaler.status()
        status.autoscale_decision = scaler["last_decision"]
        status.autoscale_note = scaler["note"]
    for n in job.nodes.history():
        status.nodes.add(
            type=n.type,
            rank=n.rank,
            id=n.id,
            status=n.state.value,
            exit_reason=n.exit_reason.value,
            relaunches=n.relaunches,
            address=n.address,
        )
    for s in job.sharding.stats():
        status.datasets.add(**dataclasses.asdict(s))
    return status


def pending_call_options(max_workers: int) -> list[tuple[str, int]]:
    """Server options: how many calls that no thread has picked up yet gRPC may hold. Its
    defaults (1,000, then cancelling at random up to 3,000) cancel part of a start burst of a
    job beyond 1,000 nodes (every node's stream, shard ask and beat at once)."""
    pending = max(MIN_PENDING_CALLS, PENDING_CALLS_PER_THREAD * max_workers)
    return [
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", 3 * pending),
    ]


def server_options(max_workers: int) -> list[tuple[str, int]]:
    """The options both servers are built with."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        # Nodes ping every 2 s so a stream to a master that died is noticed in seconds.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        ("grpc.http2.max_ping_strikes", 0),
        *pending_call_options(max_workers),
    ]


def bind_port(server: grpc.Server, host: str, port: int, tls: ServerTLS | None) -> int:
    """Listen on host:port (TLS only with `tls`); the port bound, or OSError when taken."""
    try:
        if tls is not None:
            bound = server.add_secure_port(f"{host}:{port}", tls.credentials())
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc >= 1.60 raises where older releases returned 0
        bound = 0
    if bound == 0:
        raise OSError(errno.EADDRINUSE, f"cannot listen on {host}:{port}; choose another --port")
    return bound


def add_services(
    server: grpc.Server | InterceptedHandlers,
    servicer: MasterServicer,
    kv_servicer: type | None = None,
    rendezvous_servicer: type | None = None,
) -> None:
    """The Master service (`servicer`) and its job's Rendezvous and KV services (served by
    the given servicer classes, else the sync ones)."""
    from master.rpc.kv_servicer import KVServicer, add_kv_service
    from master.rpc.rendezvous_servicer import RendezvousServicer, add_rendezvous_service

    job = servicer.job

    def node_check(ref: common_pb2.NodeRef) -> None:
        check_node(job, ref)

    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    add_rendezvous_service(
        server, job.rendezvous, node_check, rendezvous_servicer or RendezvousServicer
    )
    add_kv_service(server, job.kv, node_check, kv_servicer or KVServicer)


def start_server(
    job: JobMaster,
    host: str,
    port: int,
    token: str,
    max_workers: int,
    heartbeat_interval_ms: int,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: ServerTLS | None = None,
    requests_per_second: float = DEFAULT_RATE_PER_SECOND,
) -> tuple[grpc.Server, int]:
    """Start the Master service on host:port (0 picks a port); returns the server and its port.

    `interceptors` run before the token check (e.g. RPC timing, so refused calls count too).
    With `tls` the port speaks TLS only (mutual TLS when it names a client CA). Each client
    connection may make `requests_per_second` calls (bursts of twice that).
    """
    buckets = TokenBuckets(requests_per_second, 2 * requests_per_second)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        interceptors=[*interceptors, RateLimitInterceptor(buckets), TokenInterceptor(token)],
        options=server_options(max_workers),
    )
    add_services(server, MasterServicer(job, heartbeat_interval_ms))
    bound = bind_port(server, host, port, tls)
    server.start()
    log.info("master listening on %s:%d%s", host, bound, " (TLS)" if tls else "")
    return server, bound


def advertised_host(host: str) -> str:
    """The address nodes should dial when the server binds a wildcard address."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host
