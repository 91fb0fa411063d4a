"""`MasterClient.get_shard` asks on the node's open `ShardStream` where the master serves it,
and by a unary call with the same ask id wherever the stream does not answer."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from master.client import MasterClient, MasterError, NodeIdentity, decode_indices
from master.client import shard_asks as shard_asks_module
from master.pb import data_pb2

from .test_progress_stream import make_dataset

SHARD = data_pb2.GetShardReply.SHARD


def spans(replies) -> list[tuple[int, int]]:
    return [(r.shard.start, r.shard.end) for r in replies]


@pytest.mark.parametrize("harness", ["aio", "sync"], indirect=True)
def test_asks_go_on_the_stream_where_served_and_get_what_unary_asks_get(harness, request):
    on_stream = harness.client(0)
    unary = harness.client(1, shard_asks_on_stream=False)
    make_dataset(on_stream, size=600, per_shard=100)
    replies = [c.get_shard("d") for c in (on_stream, unary, on_stream, unary, on_stream)]
    assert [r.status for r in replies] == [SHARD] * 5
    assert spans(replies) == [(0, 100), (100, 200), (200, 300), (300, 400), (400, 500)]
    # Indices computed by the node, as for a unary answer.
    assert decode_indices(replies[2].shard.record_indices) == list(range(200, 300))
    stream = on_stream._asks
    if request.node.callspec.params["harness"] == "aio":
        assert stream._answers is not None and not stream._closed  # answered on the stream
    else:
        assert stream._closed and stream._answers is None  # refused once: unary from then on
    held = harness.job.sharding.stats()[0]
    assert (held.records_todo, held.records_doing) == (100, 500)


@pytest.mark.parametrize("harness", ["aio"], indirect=True)
def test_an_ask_the_stream_does_not_answer_goes_by_a_unary_call_and_the_stream_reopens(harness):
    c = harness.client(0)
    make_dataset(c, size=400, per_shard=100)
    first = c.get_shard("d")
    stream = c._asks
    assert stream._answers is not None
    stream._answers.cancel()  # as when the master ends the stream (a restart)
    second = c.get_shard("d")  # the stream's next() fails: asked again by a unary call
    assert stream._answers is None
    third = c.get_shard("d")  # and the stream is back
    assert stream._answers is not None
    fourth = c.get_shard("d")
    assert spans([first, second, third, fourth]) == [(0, 100), (100, 200), (200, 300), (300, 400)]
    held = harness.job.sharding.stats()[0]
    assert (held.records_todo, held.records_doing) == (0, 400)  # no shard granted twice


def test_a_failed_ask_raises_what_a_unary_call_raises_and_the_node_goes_on(harness):
    c = harness.client(0)
    make_dataset(c)
    with pytest.raises(MasterError) as e:
        c.get_shard("nope")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "nope" in str(e.value)
    assert c.get_shard("d").status == SHARD


def test_asks_of_two_threads_at_once_get_distinct_shards(harness):
    c = harness.client(0)
    make_dataset(c, size=2000, per_shard=10)
    got: list[int] = []
    lock = threading.Lock()

    def take(n: int) -> None:
        for _ in range(n):
            reply = c.get_shard("d")
            with lock:
                got.append(reply.shard.shard_id)

    threads = [threading.Thread(target=take, args=(50,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got) == len(set(got)) == 200
    assert harness.job.sharding.stats()[0].records_doing == 2000


def test_an_ask_the_stream_never_answers_is_given_up_and_asked_by_a_unary_call(monkeypatch):
    """A master that takes the stream but never answers on it (wedged): the ask is cancelled
    past its deadline and the unary call answers."""
    monkeypatch.setattr(shard_asks_module, "WATCH_PERIOD_SECONDS", 0.05)
    shard = data_pb2.GetShardReply(
        status=SHARD, shard=data_pb2.Shard(shard_id=7, start=0, end=10)
    ).SerializeToString()
    held = threading.Event()

    def never(requests, context):
        next(requests)
        held.wait(30)  # holds the ask without answering until the test ends
        return iter(())

    handler = grpc.method_handlers_generic_handler(
        "dlrover.v1.Master",
        {
            "GetShard": grpc.unary_unary_rpc_method_handler(lambda request, context: shard),
            "ShardStream": grpc.stream_stream_rpc_method_handler(never),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = MasterClient(f"127.0.0.1:{port}", "t", NodeIdentity("worker", 0, 1), call_timeout=0.3)
    try:
        start = time.monotonic()
        reply = client.get_shard("d")
        assert reply.status == SHARD and reply.shard.shard_id == 7
        assert time.monotonic() - start < 10
    finally:
        held.set()
        client.close()
        server.stop(0)
