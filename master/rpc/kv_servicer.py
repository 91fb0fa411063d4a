"""The KVStore gRPC service over a KVStore."""

from __future__ import annotations

import grpc

from master.kv.store import KVStore
from master.pb import common_pb2, kv_pb2, kv_pb2_grpc
from master.rpc.guard import CallWatch, NodeCheck, check_wait_ms, guard


class KVServicer(kv_pb2_grpc.KVStoreServicer):
    """Implements the KVStore service; node_check (if given) refuses unknown or stale nodes."""

    def __init__(self, kv: KVStore, node_check: NodeCheck | None = None) -> None:
        self.kv = kv
        self._node_check = node_check

    def _check(self, ref: common_pb2.NodeRef) -> None:
        if self._node_check is not None:
            if not ref.type:
                raise ValueError("the request names no node (node.type is empty)")
            self._node_check(ref)

    @guard
    def Set(self, request, context):  # noqa: N802 (gRPC method names)
        self._check(request.node)
        self.kv.set(request.key, request.value)
        return common_pb2.Empty()

    @guard
    def Get(self, request, context):  # noqa: N802
        self._check(request.node)
        wait = check_wait_ms(request.wait_ms)
        with CallWatch(context, self.kv.wake) as call:
            value = self.kv.get(request.key, wait, call.is_active)
        if value is None:
            return kv_pb2.KVGetReply(found=False)
        return kv_pb2.KVGetReply(found=True, value=value)

    @guard
    def Add(self, request, context):  # noqa: N802
        self._check(request.node)
        return kv_pb2.KVAddReply(value=self.kv.add(request.key, request.amount))

    @guard
    def CompareSet(self, request, context):  # noqa: N802
        self._check(request.node)
        value = self.kv.compare_set(request.key, request.expected, request.desired)
        return kv_pb2.KVValueReply(value=value)

    @guard
    def Wait(self, request, context):  # noqa: N802
        self._check(request.node)
        wait = check_wait_ms(request.wait_ms)
        with CallWatch(context, self.kv.wake) as call:
            ready = self.kv.wait(list(request.keys), wait, call.is_active)
        return kv_pb2.KVBoolReply(value=ready)

    @guard
    def Check(self, request, context):  # noqa: N802
        self._check(request.node)
        return kv_pb2.KVBoolReply(value=self.kv.check(list(request.keys)))

    @guard
    def DeleteKey(self, request, context):  # noqa: N802
        self._check(request.node)
        return kv_pb2.KVBoolReply(value=self.kv.delete(request.key))

    @guard
    def NumKeys(self, request, context):  # noqa: N802
        self._check(request.node)
        return kv_pb2.KVNumKeysReply(count=self.kv.num_keys())


def add_kv_service(
    server: grpc.Server,
    kv: KVStore,
    node_check: NodeCheck | None = None,
    servicer: type[KVServicer] = KVServicer,
) -> None:
    """Serve the KVStore service on server (with `servicer`, a KVServicer class)."""
    kv_pb2_grpc.add_KVStoreServicer_to_server(servicer(kv, node_check), server)
