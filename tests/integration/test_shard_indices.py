"""Shard record indices computed by the node for a dataset it created: none on the wire, the
same indices the master computes for a node that did not, and an older master's used as sent."""

from __future__ import annotations

from concurrent import futures

import grpc

from master.client import MasterClient, decode_indices
from master.pb import data_pb2
from master.rpc.server import encode_indices
from master.shuffle.permutation import permute

from .test_shard_stream import ask

SIZE, PER_SHARD, SEED = 200_000, 1_000, 3


def _spec(shuffle: bool = True) -> data_pb2.DatasetSpec:
    return data_pb2.DatasetSpec(
        name="d",
        size=SIZE,
        batch_size=10,
        epochs=2,
        records_per_shard=PER_SHARD,
        shuffle=shuffle,
        seed=SEED,
    )


def test_a_creator_computes_its_indices_and_gets_the_masters_order(harness):
    creator, reader = harness.client(0), harness.client(1)
    creator.create_dataset(_spec())
    # On the wire, an ask that computes its indices gets none.
    raw = harness.client(2)._stub.GetShard(
        ask(harness, 2, 1, dataset="d", indices_local=True), metadata=creator._metadata
    )
    assert raw.status == data_pb2.GetShardReply.SHARD and raw.shard.record_indices == b""
    assert raw.shard.end - raw.shard.start == PER_SHARD
    for _ in range(3):
        for client in (creator, reader):  # computed here / by the master
            shard = client.get_shard("d").shard
            expected = [permute(p, SIZE, SEED, shard.epoch) for p in range(shard.start, shard.end)]
            assert decode_indices(shard.record_indices) == expected


def test_an_unshuffled_dataset_is_read_in_order(harness):
    client = harness.client(0)
    client.create_dataset(_spec(shuffle=False))
    shard = client.get_shard("d").shard
    assert decode_indices(shard.record_indices) == list(range(shard.start, shard.end))


def test_a_master_that_sends_the_indices_anyway_is_believed():
    """An older master, unaware of indices_local, always sends them: the node uses them."""
    sent = [7, 3, 5]

    def create(request: bytes, context) -> bytes:
        return data_pb2.CreateDatasetReply(created=True).SerializeToString()

    def get_shard(request: bytes, context) -> bytes:
        shard = data_pb2.Shard(shard_id=1, start=0, end=3, record_indices=encode_indices(sent))
        return data_pb2.GetShardReply(shard=shard).SerializeToString()

    handlers = {
        "CreateDataset": grpc.unary_unary_rpc_method_handler(create),
        "GetShard": grpc.unary_unary_rpc_method_handler(get_shard),
    }
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("dlrover.v1.Master", handlers)]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = MasterClient(f"127.0.0.1:{port}", "t")
    try:
        client.create_dataset(_spec())
        assert decode_indices(client.get_shard("d").shard.record_indices) == sent
    finally:
        client.close()
        server.stop(0)
