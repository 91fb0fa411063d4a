"""The Rendezvous gRPC service over a RendezvousService."""

from __future__ import annotations

import grpc

from master.pb import common_pb2, rendezvous_pb2, rendezvous_pb2_grpc
from master.rendezvous.rounds import (
    NodeKey,
    Participant,
    RendezvousClosedError,
    RoundConfig,
    WaitStatus,
)
from master.rendezvous.service import RendezvousService
from master.rpc.guard import CallWatch, NodeCheck, check_wait_ms, guard

DEFAULT_LEASE_MS = 10_000
_STATUS = {
    WaitStatus.PENDING: rendezvous_pb2.RoundReply.PENDING,
    WaitStatus.DONE: rendezvous_pb2.RoundReply.DONE,
    WaitStatus.NEXT: rendezvous_pb2.RoundReply.NEXT,
    WaitStatus.CLOSED: rendezvous_pb2.RoundReply.CLOSED,
}


def config_from_pb(pb: rendezvous_pb2.RendezvousConfig) -> RoundConfig:
    """The round config a join asks for (ValueError names a bad field)."""
    return RoundConfig(
        min_nodes=pb.min_nodes,
        max_nodes=pb.max_nodes,
        node_unit=pb.node_unit or 1,
        last_call_seconds=pb.last_call_ms / 1000,
        lease_seconds=(pb.lease_ms or DEFAULT_LEASE_MS) / 1000,
    )


class RendezvousServicer(rendezvous_pb2_grpc.RendezvousServicer):
    """Implements the Rendezvous service; node_check (if given) refuses unknown or stale nodes."""

    def __init__(self, rendezvous: RendezvousService, node_check: NodeCheck | None = None) -> None:
        self.rendezvous = rendezvous
        self._node_check = node_check

    def _key(self, ref: common_pb2.NodeRef) -> NodeKey:
        if not ref.type:
            raise ValueError("the request names no node (node.type is empty)")
        if self._node_check is not None:
            # While a restarted master re-adopts its nodes, the check raises
            # MasterResumingError: the caller retries rather than leave a valid round.
            self._node_check(ref)
        return (ref.type, ref.rank)

    @guard
    def Join(self, request, context):  # noqa: N802 (gRPC method names)
        self._key(request.node)
        if request.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {request.local_world_size}")
        participant = Participant(
            type=request.node.type,
            rank=request.node.rank,
            id=request.node.id,
            rank_hint=request.rank_hint,
            local_world_size=request.local_world_size,
            host=request.host,
        )
        try:
            number = self.rendezvous.join(
                request.run_id, config_from_pb(request.config), participant
            )
        except RendezvousClosedError:
            return rendezvous_pb2.JoinRoundReply(closed=True)
        return rendezvous_pb2.JoinRoundReply(round=number)

    @guard
    def WaitRound(self, request, context):  # noqa: N802
        key = self._key(request.node)
        wait = check_wait_ms(request.wait_ms)
        with CallWatch(context, self.rendezvous.wake) as call:
            result = self.rendezvous.wait_round(
                request.run_id, key, request.node.id, request.round, wait, call.is_active
            )
        reply = rendezvous_pb2.RoundReply(
            status=_STATUS[result.status], round=result.round, rank=result.rank
        )
        for m in result.members:
            reply.members.add(
                node=common_pb2.NodeRef(type=m.type, rank=m.rank, id=m.id),
                local_world_size=m.local_world_size,
                host=m.host,
            )
        return reply

    @guard
    def Watch(self, request, context):  # noqa: N802
        key = self._key(request.node)
        wait = check_wait_ms(request.wait_ms)
        with CallWatch(context, self.rendezvous.wake) as call:
            waiting, closed = self.rendezvous.watch(
                request.run_id,
                key,
                request.node.id,
                request.round,
                request.known_waiting,
                wait,
                call.is_active,
            )
        return rendezvous_pb2.WatchReply(waiting=waiting, closed=closed)

    @guard
    def Leave(self, request, context):  # noqa: N802
        key = self._key(request.node)
        self.rendezvous.leave(request.run_id, key, request.node.id)
        return common_pb2.Empty()

    @guard
    def SetClosed(self, request, context):  # noqa: N802
        self._key(request.node)
        self.rendezvous.set_closed(request.run_id)
        return common_pb2.Empty()


def add_rendezvous_service(
    server: grpc.Server,
    rendezvous: RendezvousService,
    node_check: NodeCheck | None = None,
    servicer: type[RendezvousServicer] = RendezvousServicer,
) -> None:
    """Serve the Rendezvous service on server (with `servicer`, a RendezvousServicer class)."""
    rendezvous_pb2_grpc.add_RendezvousServicer_to_server(servicer(rendezvous, node_check), server)
