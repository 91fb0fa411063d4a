"""Shard asks as messages on a node's long-lived `ShardStream`: the same answers as `GetShard`,
in order, on the aio server; a domain error ends the stream with the status `GetShard` gives.
The sync server refuses the stream (it would hold a thread per node): nodes ask it by unary
calls."""

from __future__ import annotations

import queue

import grpc
import pytest

from master.client import TOKEN_METADATA_KEY
from master.pb import common_pb2, data_pb2, master_pb2_grpc

from .conftest import TOKEN
from .test_progress_stream import make_dataset

METADATA = ((TOKEN_METADATA_KEY, TOKEN),)
SHARD = data_pb2.GetShardReply.SHARD
AIO = pytest.mark.parametrize("harness", ["aio"], indirect=True)
SYNC = pytest.mark.parametrize("harness", ["sync"], indirect=True)


class OpenStream:
    """A ShardStream held open: `ask` writes one request and reads its answer."""

    def __init__(self, addr: str, metadata=METADATA) -> None:
        self._channel = grpc.insecure_channel(addr)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        stub = master_pb2_grpc.MasterStub(self._channel)
        self._replies = stub.ShardStream(iter(self._requests.get, None), metadata=metadata)

    def ask(self, request: data_pb2.GetShardRequest) -> data_pb2.GetShardReply:
        self._requests.put(request)
        return next(self._replies)

    def close(self) -> None:
        self._requests.put(None)
        self._replies.cancel()
        self._channel.close()


def ask(harness, i: int, request_id: int, **fields) -> data_pb2.GetShardRequest:
    n = harness.nodes[i]
    ref = common_pb2.NodeRef(type=n.type, rank=n.rank, id=n.id)
    return data_pb2.GetShardRequest(node=ref, request_id=request_id, **fields)


@AIO
def test_asks_on_one_stream_are_answered_in_order_like_get_shard(harness):
    make_dataset(harness.client(0), size=300, per_shard=100)
    stream = OpenStream(harness.addr)
    try:
        replies = [stream.ask(ask(harness, 0, i, dataset="d")) for i in (1, 2, 3)]
        assert [r.status for r in replies] == [SHARD] * 3
        assert [(r.shard.start, r.shard.end) for r in replies] == [(0, 100), (100, 200), (200, 300)]
        # A retried ask (its answer lost) gets the same shard again, not a new one.
        again = stream.ask(ask(harness, 0, 3, dataset="d"))
        assert again.shard.shard_id == replies[2].shard.shard_id
        # Every record is held by the node; with none left the ask waits, then ends.
        held = harness.job.sharding.stats()[0]
        assert held.records_todo == 0 and held.records_doing == 300
        other = harness.client(1)
        for r in replies:
            harness.client(0).report_progress("d", [(r.shard.shard_id, 100)])
        end = stream.ask(ask(harness, 0, 4, dataset="d", wait_ms=1000))
        assert end.status == data_pb2.GetShardReply.END
        assert other.get_shard("d").status == data_pb2.GetShardReply.END
    finally:
        stream.close()


@AIO
def test_a_domain_error_ends_the_stream_with_get_shards_status(harness):
    make_dataset(harness.client(0))
    stale = ask(harness, 0, 3, dataset="d")
    stale.node.id += 1000  # an incarnation the master does not know
    cases = [
        (ask(harness, 0, 1, dataset="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (ask(harness, 0, 2, dataset="d", wait_ms=-1), grpc.StatusCode.INVALID_ARGUMENT, "wait_ms"),
        (stale, grpc.StatusCode.FAILED_PRECONDITION, "worker"),
    ]
    for n, (request, code, words) in enumerate(cases):
        stream = OpenStream(harness.addr)
        try:
            assert stream.ask(ask(harness, 0, 10 + n, dataset="d")).status == SHARD
            with pytest.raises(grpc.RpcError) as e:
                stream.ask(request)
            assert e.value.code() == code, e.value.details()
            assert words in e.value.details()
        finally:
            stream.close()
    # The node goes on: a new stream answers.
    stream = OpenStream(harness.addr)
    try:
        assert stream.ask(ask(harness, 0, 20, dataset="d")).status == SHARD
    finally:
        stream.close()


@AIO
def test_a_stream_without_the_job_token_is_refused(harness):
    make_dataset(harness.client(0))
    stream = OpenStream(harness.addr, metadata=((TOKEN_METADATA_KEY, "wrong"),))
    try:
        with pytest.raises(grpc.RpcError) as e:
            stream.ask(ask(harness, 0, 1, dataset="d"))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stream.close()


@SYNC
def test_the_sync_server_refuses_the_stream_and_says_to_ask_by_get_shard(harness):
    make_dataset(harness.client(0))
    stream = OpenStream(harness.addr)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stream.ask(ask(harness, 0, 1, dataset="d"))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "aio server only" in e.value.details() and "GetShard" in e.value.details()
    finally:
        stream.close()
