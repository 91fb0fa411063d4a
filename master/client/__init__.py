"""The one client library every node uses to talk to the master."""

from __future__ import annotations

import array
import logging
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import grpc

from master.client.tls import ClientTLS, TLSError
from master.pb import (
    cluster_pb2,
    common_pb2,
    data_pb2,
    kv_pb2,
    kv_pb2_grpc,
    master_pb2_grpc,
    nodes_pb2,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
)

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "x-dlrover-token"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
ENV_MASTER_ADDR = "DLROVER_MASTER_ADDR"
ENV_NODE_TYPE = "DLROVER_NODE_TYPE"
ENV_NODE_RANK = "DLROVER_NODE_RANK"
ENV_NODE_ID = "DLROVER_NODE_ID"
ENV_JOB_TOKEN = "DLROVER_JOB_TOKEN"
ENV_JOB_TOKEN_FILE = "DLROVER_JOB_TOKEN_FILE"

T = TypeVar("T")
# KV keys the master and the TF chief share: the n-th checkpoint request is the key
# "<CHECKPOINT_REQUESTS_KEY>/<n>" (the master counts requests under the key itself), the
# chief answers under ".../<n>/done" with the step it saved at, then waits for ".../<n>/release".
CHECKPOINT_REQUESTS_KEY = b"dlrover/tf/checkpoint_requests"


# Workers pause at a step boundary while the chief checkpoints for a migration: the n-th pause
# is "<PAUSE_KEY>/<n>", each worker acks with ".../<n>/ack/<TYPE>-<RANK>", the master ends it
# with ".../<n>/release".
PAUSE_KEY = b"dlrover/tf/pause"
# Set by a TF2 PS coordinator (dlrover_tf.keras_ps): the master restarts it when a PS is lost.
COORDINATOR_KEY = b"dlrover/tf/coordinator"


def pause_key(n: int, suffix: str = "") -> bytes:
    """The KV key of the n-th pause (suffix: "ack/worker-0", "release")."""
    return PAUSE_KEY + b"/" + str(n).encode() + (b"/" + suffix.encode() if suffix else b"")


def checkpoint_request_key(n: int, suffix: str = "") -> bytes:
    """The KV key of the n-th checkpoint request (suffix: "done", the chief's answer;
    "release", the master letting the chief go on)."""
    key = CHECKPOINT_REQUESTS_KEY + b"/" + str(n).encode()
    return key + b"/" + suffix.encode() if suffix else key


# Retried with backoff: the master is away (restarting), or asks this node to slow down.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class MasterError(RuntimeError):
    """A call to the master failed; the message says what to check."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class StaleNodeError(MasterError):
    """The master no longer accepts this node incarnation or shard (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class NodeIdentity:
    """Who a node is: type, stable rank, and the id of this incarnation."""

    type: str
    rank: int
    id: int

    def to_pb(self) -> common_pb2.NodeRef:
        return common_pb2.NodeRef(type=self.type, rank=self.rank, id=self.id)


def decode_indices(data: bytes) -> list[int]:
    """Shard.record_indices (little-endian int64 bytes) as a list of ints."""
    arr = array.array("q")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def read_token(env: Mapping[str, str]) -> str:
    """The job token from DLROVER_JOB_TOKEN_FILE (preferred) or DLROVER_JOB_TOKEN."""
    path = env.get(ENV_JOB_TOKEN_FILE, "")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            raise MasterError(
                f"cannot read the job token file {path!r} named by {ENV_JOB_TOKEN_FILE}: {e}"
            ) from e
    return env.get(ENV_JOB_TOKEN, "")


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
    ) -> None:
        """`channel_options`: extra gRPC channel arguments (e.g. a private connection)."""
        self.addr = addr
        self.node = node
        self.call_timeout = call_timeout
        self.retry_seconds = retry_seconds
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._lock = threading.Lock()
        # Random start: several clients of one node never reuse each other's ask ids.
        self._ask_id = random.getrandbits(48)
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

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MasterClient:
        """Build the client from the DLROVER_* variables the master gave this node."""
        env = os.environ if env is None else env
        addr = env.get(ENV_MASTER_ADDR, "")
        if not addr:
            raise MasterError(
                f"{ENV_MASTER_ADDR} is not set: this process was not started by a dlrover master. "
                "Run it through `dlrover submit JOB.yaml`, or set "
                f"{ENV_MASTER_ADDR}=host:port and {ENV_JOB_TOKEN_FILE}."
            )
        node = None
        if env.get(ENV_NODE_TYPE):
            try:
                node = NodeIdentity(
                    type=env[ENV_NODE_TYPE],
                    rank=int(env.get(ENV_NODE_RANK, "0")),
                    id=int(env.get(ENV_NODE_ID, "0")),
                )
            except ValueError as e:
                raise MasterError(f"{ENV_NODE_RANK} and {ENV_NODE_ID} must be integers: {e}") from e
        return cls(addr, read_token(env), node, tls=ClientTLS.from_env(env))

    def close(self) -> None:
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
                if code in _RETRYABLE and time.monotonic() < deadline:
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
        return self._call(self._stub.CreateDataset, req).created

    def get_shard(self, dataset: str, wait_ms: int = 0) -> data_pb2.GetShardReply:
        # One id per ask, the same for its retries: a retry whose first answer was lost gets
        # the shard that answer carried instead of leaving it stranded.
        with self._lock:
            self._ask_id += 1
            ask = self._ask_id
        req = data_pb2.GetShardRequest(
            node=self._node_pb(), dataset=dataset, wait_ms=wait_ms, request_id=ask
        )
        return self._call(self._stub.GetShard, req, timeout=self.call_timeout + wait_ms / 1000)

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


class ResourceSampler:
    """CPU and memory of this process (and its children), and GPUs when NVML is present.

    Keeps its psutil handles between samples: CPU percent is measured since the last sample.
    """

    def __init__(self, include_children: bool = False) -> None:
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self._children: dict[int, object] = {}
        # Listing children scans all of /proc: only agents that own worker processes ask.
        self._include_children = include_children
        self._proc.cpu_percent(interval=None)
        self._nvml = _load_nvml()

    def sample(self) -> nodes_pb2.ResourceStats:
        procs = [self._proc]
        if self._include_children:
            current = {}
            for child in self._proc.children(recursive=True):
                current[child.pid] = self._children.get(child.pid, child)
            self._children = current
            procs.extend(current.values())
        cpu = 0.0
        rss = 0
        for p in procs:
            try:
                cpu += p.cpu_percent(interval=None)
                rss += p.memory_info().rss
            except self._psutil.Error:
                continue
        stats = nodes_pb2.ResourceStats(
            cpu_percent=cpu, memory_rss_bytes=rss, memory_limit_bytes=cgroup_memory_limit()
        )
        stats.gpus.extend(_gpu_stats(self._nvml))
        return stats


REOPEN_DELAY_SECONDS = 0.2  # before a stream the master ended is reopened


class ProgressStream:
    """Per-step progress reports on one long-lived stream, without a round trip per step.

    send() returns at once, but first waits (rarely: a send takes ~0.2 ms, a step much
    longer) until the previous report is written to the connection. A report written to
    the socket reaches the master even if this process is killed right after, and the
    master drains a dead node's stream before re-queueing its shards: so after a crash
    only the batch of the step in flight can be ambiguous. A stream the master ends (it died)
    is reopened at once, not at the next report: a node that takes no step meanwhile (paused,
    or waiting for data) still gives a restarted master the progress the old one had not
    stored yet.
    """

    _END = object()

    def __init__(self, client: MasterClient, send_timeout: float = 10.0) -> None:
        self._client = client
        self._send_timeout = send_timeout
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue | None = None
        self._future: grpc.Future | None = None
        self._enqueued = 0
        self._sent = 0
        self._flowing = False  # a message went out on the current stream
        # Latest cumulative progress per dataset and shard, re-sent on a new stream: the
        # master may have restarted and lost the tail of what the old stream carried.
        self._progress: dict[str, dict[int, int]] = {}
        self._global_step = 0
        self._open_lock = threading.RLock()
        self._closing = False

    def _messages(self, q: queue.SimpleQueue) -> Iterator[data_pb2.ReportProgressRequest]:
        while True:
            item = q.get()
            if item is self._END:
                return
            yield item
            # gRPC asks for the next message only once the previous one was sent.
            with self._cond:
                self._sent += 1
                self._flowing = True
                self._cond.notify_all()

    def _open(self) -> None:
        if self._future is not None:
            try:
                self._future.result(timeout=0)
            except grpc.RpcError as e:
                log.warning("progress stream ended (%s: %s); reopening", e.code().name, e.details())
        self._queue = queue.SimpleQueue()
        with self._cond:
            self._enqueued = self._sent = 0
            self._flowing = False
        # wait_for_ready: a stream opened while the master restarts starts once it is back.
        self._future = self._client._stub.StreamProgress.future(
            self._messages(self._queue), metadata=self._client._metadata, wait_for_ready=True
        )
        self._future.add_done_callback(self._ended)
        for dataset, shards in self._progress.items():
            # Progress is cumulative, so the latest report of a shard stands for every earlier
            # one; shards the master already saw end are skipped by it as stale.
            self._put(
                self._client._progress_request(dataset, sorted(shards.items()), self._global_step)
            )

    def _ended(self, future: grpc.Future) -> None:
        """The stream ended; unless this side closed it, reopen it now (in a thread of its
        own: this runs in gRPC's) to re-send the progress the master may have lost."""
        if self._closing or future.cancelled() or not self._progress:
            return
        error = future.exception()
        if not isinstance(error, grpc.RpcError) or error.code() not in _RETRYABLE:
            return  # not the master going away: the next send() reports what is wrong
        threading.Thread(
            target=self._reopen, args=(future,), name="dlrover-progress-reopen", daemon=True
        ).start()

    def _reopen(self, ended: grpc.Future) -> None:
        time.sleep(REOPEN_DELAY_SECONDS * (0.5 + random.random()))  # a master refusing at once
        with self._open_lock:
            if self._closing or self._future is not ended:
                return  # closed, or send() has reopened it already
            try:
                self._open()
            except Exception as e:  # the next send() tries again
                log.warning("reopening the progress stream: %s", e)

    def _put(self, request: data_pb2.ReportProgressRequest) -> None:
        with self._cond:
            self._enqueued += 1
        self._queue.put(request)

    def send(
        self,
        dataset: str,
        reports: Iterable[tuple[int, int]],
        global_step: int = 0,
        loss: float | None = None,
    ) -> None:
        """Queue one step's report (and its loss, if given) once the previous one is on the wire."""
        with self._open_lock:
            self._closing = False
            if self._future is None or self._future.done():
                self._open()
        self._wait_sent()
        reports = list(reports)
        self._progress.setdefault(dataset, {}).update(reports)
        self._global_step = max(self._global_step, global_step)
        self._put(self._client._progress_request(dataset, reports, global_step, loss))
        if not self._flowing:
            # A new stream (first use, or the master restarting) may not be connected yet:
            # keep the one-batch bound by waiting for this report itself to go out.
            self._wait_sent()

    def _wait_sent(self) -> None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._sent >= self._enqueued or self._future.done(), self._send_timeout
            ):
                log.warning(
                    "a progress report is not sent after %ss; is the master reachable?",
                    self._send_timeout,
                )

    def close(self, timeout: float = 30.0) -> data_pb2.ReportProgressReply | None:
        """Flush: end the stream and wait until the master has applied every report."""
        with self._open_lock:
            self._closing = True
        if self._future is None:
            return None
        self._queue.put(self._END)
        try:
            reply = self._future.result(timeout=timeout)
            self._progress.clear()  # applied: nothing to send again on the next stream
            return reply
        except grpc.RpcError as e:
            raise self._client._translate(e) from None
        finally:
            self._future = None


CGROUP_MEMORY_LIMIT_FILES = (
    "/sys/fs/cgroup/memory.max",  # cgroup v2
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
)


def cgroup_memory_limit(files: tuple[str, ...] = CGROUP_MEMORY_LIMIT_FILES) -> int:
    """This container's memory limit in bytes, 0 if none (the master's OOM diagnosis uses it)."""
    import psutil

    for path in files:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < psutil.virtual_memory().total:
            return int(text)
        return 0  # "max", or a v1 "unlimited" larger than the machine
    return 0


def _load_nvml():
    """The pynvml module, initialised, or None where there is no NVML (no GPU or no package)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError when no driver is present
        return None
    return pynvml


def _gpu_stats(nvml) -> list[nodes_pb2.GpuStats]:
    """Utilisation and memory of every GPU NVML sees."""
    if nvml is None:
        return []
    out = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            out.append(
                nodes_pb2.GpuStats(
                    index=i,
                    utilization_percent=float(util.gpu),
                    memory_used_bytes=int(mem.used),
                    memory_total_bytes=int(mem.total),
                )
            )
    except Exception as e:  # a GPU that fell off the bus must not stop heartbeats
        log.warning("reading GPU stats failed: %s", e)
    return out


class HeartbeatThread(threading.Thread):
    """Sends heartbeats with resource stats and hands received commands to a callback."""

    def __init__(
        self,
        client: MasterClient,
        interval: float,
        on_command: Callable[[nodes_pb2.Command], None] | None = None,
        global_step: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(name="dlrover-heartbeat", daemon=True)
        self._client = client
        self._interval = interval
        self._on_command = on_command
        self._global_step = global_step or (lambda: 0)
        self._stop_event = threading.Event()
        self._sampler = ResourceSampler()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                commands = self._client.heartbeat(self._sampler.sample(), self._global_step())
                for cmd in commands:
                    if self._on_command:
                        self._on_command(cmd)
            except MasterError as e:
                log.warning("heartbeat failed: %s", e)
            self._stop_event.wait(self._interval)

    def stop(self) -> None:
        self._stop_event.set()


# -- torch rendezvous and KV store (Rendezvous and KVStore services) ------------------------------
# Built on a MasterClient: they share its channel, token metadata, node identity, retries on
# UNAVAILABLE and error translation (FAILED_PRECONDITION -> StaleNodeError).

# Longest single blocking call; longer waits are split so no call outlives a lost connection.
MAX_WAIT_CHUNK_MS = 10_000


class RendezvousClient:
    """Calls of the Rendezvous service on behalf of the MasterClient's node."""

    def __init__(self, master: MasterClient) -> None:
        if master.node is None:
            raise MasterError(
                "the rendezvous needs a node identity: build the MasterClient with a "
                f"NodeIdentity (or set {ENV_NODE_TYPE}, {ENV_NODE_RANK} and {ENV_NODE_ID})"
            )
        self.master = master
        self._stub = rendezvous_pb2_grpc.RendezvousStub(master._channel)

    @property
    def node(self) -> NodeIdentity:
        return self.master.node

    def join(
        self,
        run_id: str,
        config: rendezvous_pb2.RendezvousConfig,
        rank_hint: int,
        local_world_size: int,
        host: str,
    ) -> rendezvous_pb2.JoinRoundReply:
        """Join the round being formed; the reply names the round to wait for."""
        req = rendezvous_pb2.JoinRoundRequest(
            node=self.master._node_pb(),
            run_id=run_id,
            config=config,
            rank_hint=rank_hint,
            local_world_size=local_world_size,
            host=host,
        )
        return self.master._call(self._stub.Join, req)

    def wait_round(self, run_id: str, round_number: int, wait_ms: int) -> rendezvous_pb2.RoundReply:
        """Block up to wait_ms (one call) until the round closes; PENDING if it has not."""
        req = rendezvous_pb2.WaitRoundRequest(
            node=self.master._node_pb(), run_id=run_id, round=round_number, wait_ms=wait_ms
        )
        return self.master._call(
            self._stub.WaitRound, req, timeout=self.master.call_timeout + wait_ms / 1000
        )

    def watch(
        self, run_id: str, round_number: int, known_waiting: int, wait_ms: int
    ) -> rendezvous_pb2.WatchReply:
        """Block up to wait_ms until the view (waiting, closed) changes; renews the lease."""
        req = rendezvous_pb2.WatchRequest(
            node=self.master._node_pb(),
            run_id=run_id,
            round=round_number,
            known_waiting=known_waiting,
            wait_ms=wait_ms,
        )
        return self.master._call(
            self._stub.Watch, req, timeout=self.master.call_timeout + wait_ms / 1000
        )

    def leave(self, run_id: str) -> None:
        req = rendezvous_pb2.LeaveRequest(node=self.master._node_pb(), run_id=run_id)
        self.master._call(self._stub.Leave, req)

    def set_closed(self, run_id: str) -> None:
        req = rendezvous_pb2.SetClosedRequest(node=self.master._node_pb(), run_id=run_id)
        self.master._call(self._stub.SetClosed, req)


class KVClient:
    """Calls of the KVStore service; get and wait block up to a timeout in seconds."""

    def __init__(self, master: MasterClient) -> None:
        self.master = master
        self._stub = kv_pb2_grpc.KVStoreStub(master._channel)

    def set(self, key: bytes, value: bytes) -> None:
        req = kv_pb2.KVSetRequest(node=self.master._node_pb(), key=key, value=value)
        self.master._call(self._stub.Set, req)

    def get(self, key: bytes, timeout: float) -> bytes | None:
        """The value of key, waiting up to timeout seconds for it; None if it never came."""
        deadline = time.monotonic() + timeout
        while True:
            wait_ms = _chunk_ms(deadline)
            req = kv_pb2.KVGetRequest(node=self.master._node_pb(), key=key, wait_ms=wait_ms)
            reply = self.master._call(
                self._stub.Get, req, timeout=self.master.call_timeout + wait_ms / 1000
            )
            if reply.found:
                return reply.value
            if time.monotonic() >= deadline:
                return None

    def add(self, key: bytes, amount: int) -> int:
        req = kv_pb2.KVAddRequest(node=self.master._node_pb(), key=key, amount=amount)
        return self.master._call(self._stub.Add, req).value

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        req = kv_pb2.KVCompareSetRequest(
            node=self.master._node_pb(), key=key, expected=expected, desired=desired
        )
        return self.master._call(self._stub.CompareSet, req).value

    def wait(self, keys: Iterable[bytes], timeout: float) -> bool:
        """Wait up to timeout seconds until every key exists; whether they all do."""
        keys = list(keys)
        deadline = time.monotonic() + timeout
        while True:
            wait_ms = _chunk_ms(deadline)
            req = kv_pb2.KVWaitRequest(node=self.master._node_pb(), keys=keys, wait_ms=wait_ms)
            reply = self.master._call(
                self._stub.Wait, req, timeout=self.master.call_timeout + wait_ms / 1000
            )
            if reply.value:
                return True
            if time.monotonic() >= deadline:
                return False

    def check(self, keys: Iterable[bytes]) -> bool:
        req = kv_pb2.KVKeysRequest(node=self.master._node_pb(), keys=list(keys))
        return self.master._call(self._stub.Check, req).value

    def delete_key(self, key: bytes) -> bool:
        req = kv_pb2.KVKeyRequest(node=self.master._node_pb(), key=key)
        return self.master._call(self._stub.DeleteKey, req).value

    def num_keys(self) -> int:
        req = kv_pb2.KVNumKeysRequest(node=self.master._node_pb())
        return self.master._call(self._stub.NumKeys, req).count


def _chunk_ms(deadline: float) -> int:
    """The wait of the next blocking call: what is left until deadline, at most one chunk."""
    return max(0, min(MAX_WAIT_CHUNK_MS, int((deadline - time.monotonic()) * 1000)))
