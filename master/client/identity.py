"""Who a node is on the wire: type, stable rank, and the id of this incarnation."""

from __future__ import annotations

from dataclasses import dataclass

from master.pb import common_pb2


@dataclass(frozen=True)
class NodeIdentity:
    """Who a node is: type, stable rank, and the id of this incarnation."""

    type: str
    rank: int
    id: int

    def to_pb(self) -> common_pb2.NodeRef:
        return common_pb2.NodeRef(type=self.type, rank=self.rank, id=self.id)
