"""MasterClient: typed calls to the master over one gRPC channel, with the token, retries with
backoff while the master is away, and errors that say what to check."""

from __future__ import annotations

import array
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import grpc

from master.client.env import (
    ENV_JOB_TOKEN_FILE,
    ENV_MASTER_ADDR,
    read_master_addr,
    read_master_wait,
    read_node_identity,
    read_token,
)
from master.client.errors import MasterError, StaleNodeError
from master.client.identity import NodeIdentity
from master.client.shard_asks import ShardAskStream
from master.client.tls import ClientTLS, TLSError
from master.pb import cluster_pb2, common_pb2, data_pb2, master_pb2_grpc, nodes_pb2
from master.shuffle.permutation import record_indices

TOKEN_METADATA_KEY = "x-dlrover-token"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

T = TypeVar("T")

# Retried with backoff: the master is away (restarting), or asks this node to slow down.
RETRYABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def decode_indices(data: bytes) -> list[int]:
    """Shard.record_indices (little-endian int64 bytes) as a list of ints."""
    arr = array.array("q")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


class MasterClient:
    """Typed calls to the master over gRPC, retried with backoff while it is unreachable."""

    def __init__(
        self,
        addr: str,
        token: str,
        node: NodeIdentity | None = None,
        call_timeout: float = 30.0,
        retry_seconds: float = 60.0,
        tls: ClientTLS | None = None,
        channel_options: Iterable[tuple[str, object]] = (),
        shard_asks_on_stream: bool = True,
    ) -> None:
        """`channel_options`: extra gRPC channel arguments (e.g. a private connection).
        `shard_asks_on_stream`: `get_shard` asks on the node's `ShardStream` (else by unary
        calls only)."""
        channel_options = tuple(channel_options)
        # What clone() needs to open the same connection again (e.g. in a forked process).
        self._args = (
            addr,
            token,
            node,
            call_timeout,
            retry_seconds,
            tls,
            channel_options,
            shard_asks_on_stream,
        )
        self.addr = addr
        self.node = node
        self.call_timeout = call_timeout
        self.retry_seconds = retry_seconds
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._lock = threading.Lock()
        # Random start: several clients of one node never reuse each other's ask ids.
        self._ask_id = random.getrandbits(48)
        # Datasets this client created (or found identical): their shards' indices are
        # computed here, not sent by the master.
        self._specs: dict[str, data_pb2.DatasetSpec] = {}
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 2_000),
            ("grpc.keepalive_timeout_ms", 2_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Reconnect within a second of a restarted master coming back.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1_000),
            *channel_options,
        ]
        if tls is not None:
            try:
                credentials = tls.credentials()  # a bad file fails here, naming itself
            except TLSError as e:
                raise MasterError(str(e)) from None
            self._channel = grpc.secure_channel(addr, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(addr, options=options)
        self._stub = master_pb2_grpc.MasterStub(self._channel)
        self._asks = (
            ShardAskStream(
                lambda requests: self._stub.ShardStream(requests, metadata=self._metadata),
                call_timeout,
            )
            if shard_asks_on_stream
            else None
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MasterClient:
        """Build the client from the DLROVER_* variables the master gave this node."""
        env = os.environ if env is None else env
        addr = read_master_addr(env)
        node = read_node_identity(env)
        return cls(
            addr,
            read_token(env),
            node,
            retry_seconds=read_master_wait(env),
            tls=ClientTLS.from_env(env),
        )

    def clone(self) -> MasterClient:
        """A new client to the same master with the same token, identity and settings, on a
        channel of its own (a gRPC channel must not be used across fork)."""
        return MasterClient(*self._args)

    def __reduce__(self):
        """Pickled (e.g. to a spawned DataLoader worker) as its settings: unpickling opens a
        new connection."""
        return (MasterClient, self._args)

    def close(self) -> None:
        if self._asks is not None:
            self._asks.close()
        self._channel.close()

    def _node_pb(self) -> common_pb2.NodeRef:
        return self.node.to_pb() if self.node else common_pb2.NodeRef()

    def _call(self, method: Callable[..., T], request: object, timeout: float | None = None) -> T:
        """One RPC; UNAVAILABLE is retried with jittered backoff for up to retry_seconds."""
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.05
        while True:
            try:
                return method(
                    request, timeout=timeout or self.call_timeout, metadata=self._metadata
                )
            except grpc.RpcError as e:
                code = e.code()
                if code in RETRYABLE_CODES and time.monotonic() < deadline:
                    time.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 2.0)
                    continue
                raise self._translate(e) from None

    def _translate(self, e: grpc.RpcError) -> MasterError:
        code, details = e.code(), e.details()
        if code == grpc.StatusCode.UNAVAILABLE:
            return MasterError(
                f"cannot reach the master at {self.addr} ({details}). Is the job still running? "
                f"Check {ENV_MASTER_ADDR}.",
                code,
            )
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return MasterError(
                f"the master at {self.addr} refused the job token ({details}). "
                f"Use the token of this job ({ENV_JOB_TOKEN_FILE}).",
                code,
            )
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return StaleNodeError(f"master: {details}", code)
        return MasterError(f"master call failed: {code.name}: {details}", code)

    # -- nodes --------------------------------------------------------------

    def register(self, host: str, pid: int) -> nodes_pb2.RegisterReply:
        req = nodes_pb2.RegisterRequest(node=self._node_pb(), host=host, pid=pid)
        return self._call(self._stub.RegisterNode, req)

    def heartbeat(
        self, stats: nodes_pb2.ResourceStats | None = None, global_step: int = 0
    ) -> list[nodes_pb2.Command]:
        req = nodes_pb2.HeartbeatRequest(
            node=self._node_pb(), stats=stats or nodes_pb2.ResourceStats(), global_step=global_step
        )
        return list(self._call(self._stub.Heartbeat, req).commands)

    def report_exit(self, exit_code: int, reason: int, message: str = "") -> None:
        req = nodes_pb2.ExitReport(
            node=self._node_pb(), exit_code=exit_code, reason=reason, message=message[-4000:]
        )
        self._call(self._stub.ReportExit, req)

    def job_status(self) -> nodes_pb2.JobStatus:
        return self._call(self._stub.GetJobStatus, common_pb2.Empty())

    def scale(self, node_type: str, replicas: int, reason: str = "") -> nodes_pb2.ScaleReply:
        req = nodes_pb2.ScaleRequest(node_type=node_type, replicas=replicas, reason=reason)
        # A PS count change returns once the cluster restarted with the new PS set.
        extra = 300 if node_type == "ps" else 0
        return self._call(self._stub.Scale, req, timeout=self.call_timeout + extra)

    def migrate(
        self, node_type: str, rank: int, memory_mb: int = 0, cpu: float = 0.0, reason: str = ""
    ) -> nodes_pb2.MigrateReply:
        """Move a node (a PS) to new resources; returns once the new incarnation runs."""
        req = nodes_pb2.MigrateRequest(
            node_type=node_type, rank=rank, memory_mb=memory_mb, cpu=cpu, reason=reason
        )
        return self._call(self._stub.MigrateNode, req, timeout=self.call_timeout + 300)

    def save_ledgers(self, global_step: int) -> None:
        """Snapshot every dataset's ledger at global_step (just before a checkpoint)."""
        req = data_pb2.LedgerRequest(node=self._node_pb(), global_step=global_step)
        self._call(self._stub.SaveLedger, req)

    def cluster_spec(self) -> cluster_pb2.ClusterSpec:
        return self._call(self._stub.GetClusterSpec, self._node_pb())

    # -- data ---------------------------------------------------------------

    def create_dataset(self, spec: data_pb2.DatasetSpec) -> bool:
        req = data_pb2.CreateDatasetRequest(node=self._node_pb(), spec=spec)
        created = self._call(self._stub.CreateDataset, req).created
        self._specs[spec.name] = spec  # the master's own: it refuses a differing one
        return created

    def get_shard(self, dataset: str, wait_ms: int = 0) -> data_pb2.GetShardReply:
        """The next shard of `dataset`, with its record indices (computed here for a dataset
        this client created, which spares the master the work and the bytes)."""
        # One id per ask, the same for its retries: a retry whose first answer was lost gets
        # the shard that answer carried instead of leaving it stranded.
        with self._lock:
            self._ask_id += 1
            ask = self._ask_id
        spec = self._specs.get(dataset)
        req = data_pb2.GetShardRequest(
            node=self._node_pb(),
            dataset=dataset,
            wait_ms=wait_ms,
            request_id=ask,
            indices_local=spec is not None,
        )
        # On the node's open stream when it answers; else (busy with another thread's ask,
        # broken, refused) by a unary call with the same ask id.
        reply = self._asks.ask(req) if self._asks is not None else None
        if reply is None:
            reply = self._call(self._stub.GetShard, req, timeout=self.call_timeout + wait_ms / 1000)
        shard = reply.shard
        if reply.status == data_pb2.GetShardReply.SHARD and spec and not shard.record_indices:
            indices = record_indices(
                shard.start, shard.end, spec.size, spec.shuffle, spec.seed, shard.epoch, False
            )
            shard.record_indices = indices.astype("<i8", copy=False).tobytes()
        return reply

    def _progress_request(
        self,
        dataset: str,
        reports: Iterable[tuple[int, int]],
        global_step: int,
        loss: float | None = None,
    ) -> data_pb2.ReportProgressRequest:
        request = data_pb2.ReportProgressRequest(
            node=self._node_pb(),
            dataset=dataset,
            reports=[data_pb2.ProgressReport(shard_id=s, records_consumed=c) for s, c in reports],
            global_step=global_step,
        )
        if loss is not None:
            request.loss = loss
        return request

    def report_progress(
        self, dataset: str, reports: Iterable[tuple[int, int]], global_step: int = 0
    ) -> None:
        """Report (shard_id, cumulative records consumed) pairs after a completed step."""
        self._call(self._stub.ReportProgress, self._progress_request(dataset, reports, global_step))

    def return_shards(self, dataset: str) -> int:
        req = data_pb2.ReturnShardsRequest(node=self._node_pb(), dataset=dataset)
        return self._call(self._stub.ReturnShards, req).records_returned

    def save_ledger(self, dataset: str, global_step: int) -> data_pb2.LedgerSnapshot:
        req = data_pb2.LedgerRequest(node=self._node_pb(), dataset=dataset, global_step=global_step)
        return self._call(self._stub.SaveLedger, req)

    def report_checkpoint(
        self, global_step: int, path: str, datasets: Iterable[str]
    ) -> data_pb2.CheckpointReply:
        req = data_pb2.CheckpointReport(
            node=self._node_pb(), global_step=global_step, path=path, datasets=list(datasets)
        )
        return self._call(self._stub.ReportCheckpoint, req)

    def report_model_restored(self, global_step: int) -> None:
        """Chief: the model was (re)loaded at global_step; every dataset goes back with it."""
        req = data_pb2.LedgerRequest(node=self._node_pb(), global_step=global_step)
        self._call(self._stub.RestoreLedger, req)

    def restore_ledger(self, dataset: str, global_step: int) -> data_pb2.LedgerSnapshot:
        req = data_pb2.LedgerRequest(node=self._node_pb(), dataset=dataset, global_step=global_step)
        return self._call(self._stub.RestoreLedger, req)
