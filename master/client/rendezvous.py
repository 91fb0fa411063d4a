"""RendezvousClient: the torch rendezvous calls (Rendezvous service) of a MasterClient's node.

Built on a MasterClient: it shares its channel, token metadata, node identity, retries on
UNAVAILABLE and error translation (FAILED_PRECONDITION -> StaleNodeError).
"""

from __future__ import annotations

from master.client.env import ENV_NODE_ID, ENV_NODE_RANK, ENV_NODE_TYPE
from master.client.errors import MasterError
from master.client.identity import NodeIdentity
from master.client.master import MasterClient
from master.pb import rendezvous_pb2, rendezvous_pb2_grpc


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
