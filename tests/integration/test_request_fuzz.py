"""10,000 generated requests against a live master: valid, malformed, oversized, wrong token,
stale or foreign node ids. It must answer every one with the status its rules give, never crash,
and keep its ledgers consistent."""

from __future__ import annotations

import contextlib
import random
from collections import Counter

import grpc
import pytest

from master.client import MAX_MESSAGE_BYTES, TOKEN_METADATA_KEY
from master.config import parse_job_spec
from master.job.master import JobMaster, JobRuntime
from master.pb import common_pb2, data_pb2, master_pb2_grpc, nodes_pb2
from master.platform.local import LocalPlatform
from master.rpc.aio_server import start_aio_server
from master.rpc.ratelimit import TokenBuckets
from master.rpc.server import start_server
from master.sharding.ledger import DatasetLedger
from master.state.sqlite import SQLiteStateStore

TOKEN = "fuzz-token-0123456789"
REQUESTS = 10_000
OK, INVALID, NOT_FOUND, STALE, AUTH, EXISTS = (
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ALREADY_EXISTS,
)
HUGE = 2**62


@pytest.fixture
def master(tmp_path):
    spec = parse_job_spec(
        {"name": "fuzz", "command": ["true"], "worker": {"replicas": 3}},
        source="test",
        base_dir=str(tmp_path),
    )
    store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
    platform = LocalPlatform()
    job = JobMaster(spec, platform, store, JobRuntime(str(tmp_path), "", ""))
    nodes = []
    for rank in range(3):
        node = job.nodes.new_incarnation("worker", rank, 0, 0)
        job.nodes.mark_running(node.id, "", "")
        nodes.append(node)
    # An old incarnation of worker 2: known to the master, but stale.
    stale = nodes[2]
    nodes[2] = job.nodes.new_incarnation("worker", 2, 1, 0)
    job.nodes.mark_running(nodes[2].id, "", "")
    server, port = start_server(job, "127.0.0.1", 0, TOKEN, 16, 1000, requests_per_second=1e6)
    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    )
    yield job, master_pb2_grpc.MasterStub(channel), nodes, stale
    channel.close()
    server.stop(0).wait()
    job.sharding.close()
    platform.shutdown(1)
    store.close()


class Generator:
    """Draws one request and the status the master's rules say it must get."""

    def __init__(self, rng: random.Random, nodes, stale) -> None:
        self.rng = rng
        self.nodes = nodes
        self.stale = stale
        self.datasets = ["a", "b"]

    def node(self) -> tuple[common_pb2.NodeRef, grpc.StatusCode]:
        r = self.rng.random()
        if r < 0.8:
            n = self.rng.choice(self.nodes)
            return common_pb2.NodeRef(type=n.type, rank=n.rank, id=n.id), OK
        if r < 0.85:
            s = self.stale
            return common_pb2.NodeRef(type=s.type, rank=s.rank, id=s.id), STALE
        if r < 0.9:
            return common_pb2.NodeRef(type="worker", rank=0, id=self.rng.randint(100, HUGE)), STALE
        if r < 0.95:  # a real id under another node's name
            n = self.rng.choice(self.nodes)
            return common_pb2.NodeRef(type="ps", rank=n.rank, id=n.id), STALE
        return common_pb2.NodeRef(), INVALID  # no identity at all: a malformed request

    def dataset(self) -> tuple[str, grpc.StatusCode]:
        r = self.rng.random()
        if r < 0.85:
            return self.rng.choice(self.datasets), OK
        if r < 0.95:
            return "no-such-" + str(self.rng.randint(0, 9)), NOT_FOUND
        return "x" * self.rng.choice([1000, 100_000]), NOT_FOUND

    def draw(self) -> tuple[str, object, grpc.StatusCode | None]:
        """(method, request, expected status); None: valid, the answer depends on state."""
        kind = self.rng.choice(
            [
                "Heartbeat",
                "ReportExit",
                "GetClusterSpec",
                "GetJobStatus",
                "CreateDataset",
                "GetShard",
                "ReportProgress",
                "ReturnShards",
                "SaveLedger",
                "RestoreLedger",
                "ReportCheckpoint",
            ]
        )
        node, node_status = self.node()
        ds, ds_status = self.dataset()
        int_bad = self.rng.random() < 0.15
        value = self.rng.choice([-1, -HUGE, HUGE]) if int_bad else self.rng.randint(0, 2000)
        if kind == "GetJobStatus":
            return kind, common_pb2.Empty(), OK
        if kind == "GetClusterSpec":
            return kind, node, node_status
        if kind == "Heartbeat":
            req = nodes_pb2.HeartbeatRequest(node=node, global_step=value)
            return kind, req, _first(node_status, INVALID if value < 0 else OK)
        if kind == "ReportExit":
            reason = self.rng.choice([0, 1, 2, 3, 99, -5])
            req = nodes_pb2.ExitReport(node=node, exit_code=value % 256, reason=reason)
            valid = reason in nodes_pb2.ExitReason.values()
            return kind, req, _first(node_status, OK if valid else INVALID)
        if kind == "CreateDataset":
            size = value if self.rng.random() < 0.5 else self.rng.choice([1000, 0, -3])
            spec = data_pb2.DatasetSpec(
                name=self.rng.choice(self.datasets), size=size, batch_size=10, epochs=2
            )
            return kind, data_pb2.CreateDatasetRequest(node=node, spec=spec), None
        if kind == "GetShard":
            wait = self.rng.choice([0, 0, 5, -1, HUGE])
            req = data_pb2.GetShardRequest(
                node=node, dataset=ds, wait_ms=wait, request_id=self.rng.choice([0, 1, 2, -7])
            )
            bad = wait < 0 or wait > 60_000 or req.request_id < 0
            return kind, req, _first(node_status, INVALID if bad else OK, ds_status, None)
        if kind == "ReportProgress":
            req = data_pb2.ReportProgressRequest(node=node, dataset=ds, global_step=max(value, 0))
            for _ in range(self.rng.randint(0, 3)):
                req.reports.add(
                    shard_id=self.rng.randint(-2, 40), records_consumed=self.rng.randint(-5, 2000)
                )
            return kind, req, _first(node_status, ds_status, None)
        if kind == "ReturnShards":
            req = data_pb2.ReturnShardsRequest(node=node, dataset=ds)
            return kind, req, _first(node_status, ds_status, None)
        if kind in ("SaveLedger", "RestoreLedger"):
            req = data_pb2.LedgerRequest(node=node, dataset=ds, global_step=value)
            bad = value < 0 and kind == "SaveLedger"
            return kind, req, _first(node_status, INVALID if bad else OK, ds_status, None)
        req = data_pb2.CheckpointReport(node=node, global_step=value, path="/ckpt", datasets=[ds])
        return kind, req, _first(node_status, INVALID if value < 0 else OK)


def _first(*statuses):
    """The status of the first check that fails, the checks in the master's order; a None
    check depends on the master's state (whether the dataset exists yet, who holds what)."""
    for s in statuses:
        if s is not OK:
            return s
    return OK


def test_ten_thousand_generated_requests_get_the_right_status(master):
    job, stub, nodes, stale = master
    gen = Generator(random.Random(20261122), nodes, stale)
    seen = Counter()
    mismatches = []
    for i in range(REQUESTS):
        method, request, expected = gen.draw()
        token = TOKEN
        if i % 25 == 0:
            token, expected = "wrong-" + TOKEN, AUTH
        metadata = ((TOKEN_METADATA_KEY, token),) if i % 50 else ()
        if not metadata:
            expected = AUTH
        try:
            getattr(stub, method)(request, timeout=10, metadata=metadata)
            code = OK
        except grpc.RpcError as e:
            code = e.code()
        seen[code] += 1
        # The master must never fail by an uncaught exception (UNKNOWN) or an internal error.
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method, request)
        if expected is not None and code != expected:
            mismatches.append((method, str(request)[:200], expected, code))
        elif expected is None:
            # Valid shape; the state decides among these.
            assert code in (OK, INVALID, NOT_FOUND, STALE, EXISTS), (method, request, code)
    assert not mismatches, "\n".join(
        f"{m}: want {e.name} got {c.name} x{n}"
        for (m, e, c), n in Counter((m, e, c) for m, _, e, c in mismatches).items()
    )
    assert seen[OK] > 2000 and seen[AUTH] >= REQUESTS // 25  # the mix hit both sides
    # Still serving, and every ledger passes its own consistency checks on a round trip.
    for name in job.sharding.names():
        data = job.sharding.save_snapshot(name, 0)
        DatasetLedger.from_snapshot(data, requeue_doing=False)
    assert stub.GetJobStatus(common_pb2.Empty(), metadata=((TOKEN_METADATA_KEY, TOKEN),)).name


def test_oversized_message_is_refused_and_the_master_carries_on(master):
    job, stub, nodes, _ = master
    n = nodes[0]
    req = data_pb2.GetShardRequest(
        node=common_pb2.NodeRef(type=n.type, rank=n.rank, id=n.id),
        dataset="y" * (MAX_MESSAGE_BYTES + 1024),
    )
    metadata = ((TOKEN_METADATA_KEY, TOKEN),)
    with pytest.raises(grpc.RpcError) as e:
        stub.GetShard(req, timeout=30, metadata=metadata)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.GetJobStatus(common_pb2.Empty(), metadata=metadata).name == "fuzz"


@contextlib.contextmanager
def rate_limited_master(tmp_path, start):
    """A master served by `start` (a server starter) that allows 5 requests/s per client."""
    spec = parse_job_spec(
        {"name": "rate", "command": ["true"], "worker": {"replicas": 1}},
        source="test",
        base_dir=str(tmp_path),
    )
    store = SQLiteStateStore(":memory:")
    platform = LocalPlatform()
    job = JobMaster(spec, platform, store, JobRuntime(str(tmp_path), "", ""))
    server, port = start(job, "127.0.0.1", 0, TOKEN, 8, 1000, requests_per_second=5)
    try:
        yield job, port
    finally:
        server.stop(0).wait()
        job.sharding.close()
        platform.shutdown(1)
        store.close()


def test_a_client_over_its_request_rate_is_told_to_slow_down(tmp_path):
    buckets = TokenBuckets(rate=10, burst=5, clock=lambda: 0.0)
    assert [buckets.take("peer") for _ in range(6)] == [True] * 5 + [False]
    assert buckets.take("other peer")  # budgets are per client
    now = [0.0]
    refill = TokenBuckets(rate=10, burst=5, clock=lambda: now[0])
    for _ in range(5):
        refill.take("p")
    assert not refill.take("p")
    now[0] = 0.1  # 10/s: one token back after 0.1 s
    assert refill.take("p") and not refill.take("p")
    with rate_limited_master(tmp_path, start_server) as (job, port):
        stub = master_pb2_grpc.MasterStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        metadata = ((TOKEN_METADATA_KEY, TOKEN),)
        codes = Counter()
        for _ in range(40):
            try:
                stub.GetJobStatus(common_pb2.Empty(), metadata=metadata, timeout=5)
                codes[OK] += 1
            except grpc.RpcError as e:
                codes[e.code()] += 1
        assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] > 0 and codes[OK] >= 10
        assert set(codes) == {OK, grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_each_ask_on_a_shard_stream_counts_against_the_clients_rate(tmp_path):
    with rate_limited_master(tmp_path, start_aio_server) as (job, port):
        node = job.nodes.new_incarnation("worker", 0, 0, 0)
        job.nodes.mark_running(node.id, job.platform.address_for("worker", 0), "")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = master_pb2_grpc.MasterStub(channel)
        ref = common_pb2.NodeRef(type="worker", rank=0, id=node.id)
        metadata = ((TOKEN_METADATA_KEY, TOKEN),)
        stub.CreateDataset(
            data_pb2.CreateDatasetRequest(
                node=ref,
                spec=data_pb2.DatasetSpec(
                    name="d", size=10**6, batch_size=1, epochs=1, records_per_shard=10
                ),
            ),
            metadata=metadata,
        )
        asks = (data_pb2.GetShardRequest(node=ref, dataset="d", request_id=i) for i in range(40))
        answered = 0
        with pytest.raises(grpc.RpcError) as e:
            for reply in stub.ShardStream(asks, metadata=metadata, timeout=30):
                assert reply.status == data_pb2.GetShardReply.SHARD
                answered += 1
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 1 <= answered <= 12  # the burst (twice the rate), not the 40 asked
        channel.close()
