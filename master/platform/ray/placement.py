"""Where each (type, rank) runs on a Ray cluster: the Ray node it is pinned to and its port.

A rank keeps its node and port across incarnations (its address stays the same) until its
Ray node dies; new ranks go to the alive node with the fewest pinned ranks per CPU.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from master.platform.api import PlatformError
from master.platform.local import free_port
from master.platform.ray.connect import is_loopback

log = logging.getLogger(__name__)

# The list of alive Ray nodes is cached this long.
NODE_CACHE_SECONDS = 2.0


@dataclass(frozen=True)
class RayNode:
    """One alive node of the Ray cluster."""

    node_id: str
    ip: str
    cpu: float
    raylet_port: int = 0  # its raylet's port (0: unknown)


@dataclass(frozen=True)
class Slot:
    """Where a (type, rank) runs: the Ray node it is pinned to, and its port there."""

    node: RayNode
    port: int

    @property
    def address(self) -> str:
        return f"{self.node.ip}:{self.port}"


class NodePlacement:
    """The Ray node and port of every (type, rank); the caller serializes the calls.

    `host` is the address the master advertises to nodes (warned about when loopback while
    nodes land on other Ray nodes); `my_node` is the Ray node id of this process.
    """

    def __init__(self, ray: Any, host: str, my_node: str, affinity: Any) -> None:
        self._ray = ray
        self.host = host
        self._my_node = my_node
        self._affinity = affinity  # NodeAffinitySchedulingStrategy
        self._port_task = ray.remote(num_cpus=0)(free_port)
        self._slots: dict[tuple[str, int], Slot] = {}
        self._nodes: list[RayNode] = []
        self._nodes_at = -1e9
        self._warned_host = False
        # A free port on a Ray node asked of what already runs there (None: nothing does).
        self.port_from_actors: Callable[[RayNode], int | None] = lambda node: None

    def get(self, node_type: str, rank: int) -> Slot | None:
        """The slot the (type, rank) has now, if any; nothing is allocated."""
        return self._slots.get((node_type, rank))

    def slot(self, node_type: str, rank: int, check_alive: bool) -> Slot:
        """The (type, rank)'s slot, allocated on first use (or when its node died, with
        `check_alive`)."""
        key = (node_type, rank)
        slot = self._slots.get(key)
        alive = {n.node_id for n in self.alive_nodes()} if slot and check_alive else set()
        if slot is not None and check_alive and slot.node.node_id not in alive:
            log.warning(
                "%s-%d: its Ray node %s is gone; moving it (its address changes)",
                node_type,
                rank,
                slot.node.ip,
            )
            slot = None
        if slot is None:
            node = self._choose_node()
            slot = Slot(node, self._allocate_port(node))
            self._slots[key] = slot
        return slot

    def standby_node(self, node_type: str, apart: bool) -> RayNode:
        """Where a standby of `node_type` runs: beside the type's rank 0 (it takes over that
        address), or `apart` from it where a rank can move to the standby's node (its peers
        follow it there), so a lost Ray node does not take both."""
        # Rank 0 of a lost Ray node moves now (its relaunch goes there too).
        rank0 = self.slot(node_type, 0, check_alive=True).node
        others = [n for n in self._nodes_with_cpu() if n.node_id != rank0.node_id]
        return self._least_pinned(others) if apart and others else rank0

    def move_to(self, node_type: str, rank: int, node: RayNode) -> Slot:
        """Pin (type, rank) to `node` at a fresh port there (its address changes)."""
        slot = Slot(node, self._allocate_port(node))
        self._slots[(node_type, rank)] = slot
        return slot

    def restore(self, addresses: dict[tuple[str, int], str]) -> None:
        """Pin each (type, rank) to the Ray node and port of its `ip:port` address."""
        by_ip = {n.ip: n for n in self.alive_nodes(refresh=True)}
        for key, addr in addresses.items():
            ip, _, port = addr.rpartition(":")
            node = by_ip.get(ip)
            if node is None:
                log.warning("%s-%d: its Ray node %s is gone; it moves when relaunched", *key, ip)
                continue
            self._slots[key] = Slot(node, int(port))

    def is_alive(self, node_id: str) -> bool:
        """Whether Ray has the node alive now (asked afresh)."""
        return any(n.node_id == node_id for n in self.alive_nodes(refresh=True))

    def alive_nodes(self, refresh: bool = False) -> list[RayNode]:
        """The cluster's alive nodes, cached for NODE_CACHE_SECONDS unless `refresh`."""
        now = time.monotonic()
        if refresh or now - self._nodes_at > NODE_CACHE_SECONDS:
            self._nodes = [
                RayNode(
                    n["NodeID"],
                    n["NodeManagerAddress"],
                    float(n["Resources"].get("CPU", 0)),
                    int(n.get("NodeManagerPort") or 0),
                )
                for n in self._ray.nodes()
                if n.get("Alive")
            ]
            self._nodes_at = now
        return self._nodes

    def _nodes_with_cpu(self) -> list[RayNode]:
        return [n for n in self.alive_nodes(refresh=True) if n.cpu > 0]

    def _least_pinned(self, nodes: list[RayNode]) -> RayNode:
        """The node of `nodes` with the fewest pinned ranks per CPU."""
        pinned = Counter(s.node.node_id for s in self._slots.values())
        return min(nodes, key=lambda n: (pinned[n.node_id] / n.cpu, -n.cpu))

    def _choose_node(self) -> RayNode:
        """The alive Ray node with the fewest pinned nodes per CPU (spreads over the cluster)."""
        nodes = self._nodes_with_cpu()
        if not nodes:
            raise PlatformError("the Ray cluster has no alive node with CPUs")
        node = self._least_pinned(nodes)
        if node.node_id != self._my_node and is_loopback(self.host) and not self._warned_host:
            self._warned_host = True
            log.warning(
                "nodes run on Ray node %s but the master advertises %s, which they cannot "
                "reach; run the master with --host 0.0.0.0",
                node.ip,
                self.host,
            )
        return node

    def _allocate_port(self, node: RayNode) -> int:
        """A port free on `node` now and not given to another (type, rank) there."""
        taken = {s.port for s in self._slots.values() if s.node.ip == node.ip}
        while True:
            if node.node_id == self._my_node:
                port = free_port(node.ip)
            elif (found := self.port_from_actors(node)) is not None:
                port = found
            else:
                task = self._port_task.options(
                    scheduling_strategy=self._affinity(node.node_id, False)
                )
                port = self._ray.get(task.remote(node.ip), timeout=60)
            if port not in taken:
                return port
