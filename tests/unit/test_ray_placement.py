"""Where ranks and a standby run on a Ray cluster (master/platform/ray/placement.py), against a
stand-in for the few `ray` calls the placement makes."""

from __future__ import annotations

import itertools

from master.platform.ray.placement import NodePlacement


class FakeRay:
    """`ray.nodes()`, `ray.remote(...)(f).options(...).remote(...)` and `ray.get`."""

    def __init__(self, nodes: dict[str, tuple[str, float]]) -> None:
        self.nodes_by_id = nodes  # node id -> (ip, cpus)
        self.dead: set[str] = set()
        self._ports = itertools.count(40000)

    def nodes(self) -> list[dict]:
        return [
            {
                "NodeID": i,
                "NodeManagerAddress": ip,
                "Resources": {"CPU": c},
                "Alive": i not in self.dead,
            }
            for i, (ip, c) in self.nodes_by_id.items()
        ]

    def remote(self, **_):
        ports = self._ports

        class Task:
            def options(self, **_):
                return self

            def remote(self, ip):
                return next(ports)

        return lambda f: Task()

    def get(self, value, timeout=None):
        return value


def _placement(ray: FakeRay) -> NodePlacement:
    return NodePlacement(ray, "0.0.0.0", my_node="none-of-them", affinity=lambda n, soft: n)


def test_a_standby_runs_on_the_ray_node_of_rank_0_where_it_can_take_its_address():
    ray = FakeRay({"a": ("10.0.0.1", 4), "b": ("10.0.0.2", 4)})
    placement = _placement(ray)
    ps0 = placement.slot("ps", 0, check_alive=False)
    placement.slot("worker", 0, check_alive=False)  # the other node now has fewer
    placement.slot("worker", 1, check_alive=False)
    assert placement.standby_node("ps", apart=False) == ps0.node
    ray.dead.add(ps0.node.node_id)
    placement.alive_nodes(refresh=True)
    # Where a new rank goes.
    assert placement.standby_node("ps", apart=False).node_id != ps0.node.node_id


def test_without_a_rank_0_a_standby_goes_where_a_new_rank_would():
    placement = _placement(FakeRay({"a": ("10.0.0.1", 1), "b": ("10.0.0.2", 8)}))
    assert placement.standby_node("ps", apart=False).node_id == "b"


def test_apart_a_standby_runs_off_the_ray_node_of_rank_0_and_the_rank_can_move_to_it():
    """Peers that follow a moved rank (forwarders): the standby goes where a lost Ray node
    does not take it with ps-0 (alone on one Ray node: beside it), and ps-0 moves to it at a
    fresh port when it is promoted."""
    ray = FakeRay({"a": ("10.0.0.1", 4), "b": ("10.0.0.2", 4), "c": ("10.0.0.3", 4)})
    placement = _placement(ray)
    ps0 = placement.slot("ps", 0, check_alive=False)
    placement.slot("worker", 0, check_alive=False)
    standby = placement.standby_node("ps", apart=True)
    assert standby.node_id not in (ps0.node.node_id, placement.get("worker", 0).node.node_id)
    moved = placement.move_to("ps", 0, standby)
    assert placement.get("ps", 0) == moved and moved.node == standby
    assert moved.address != ps0.address
    alone = _placement(FakeRay({"a": ("10.0.0.1", 4)}))
    only = alone.slot("ps", 0, check_alive=False).node
    assert alone.standby_node("ps", apart=True) == only


def test_a_port_is_asked_of_what_runs_on_the_ray_node_before_a_task_is_scheduled_there():
    """A rank moved to a Ray node where node actors run: one of them names a free port (an
    actor call, where a task might wait for a Ray worker to start)."""
    placement = _placement(FakeRay({"a": ("10.0.0.1", 4), "b": ("10.0.0.2", 4)}))
    asked = []

    def from_actors(node):
        asked.append(node.node_id)
        return 31000 if node.node_id == "b" else None

    placement.port_from_actors = from_actors
    slots = [placement.slot("ps", 0, check_alive=False), placement.slot("ps", 1, False)]
    by_node = {s.node.node_id: s.port for s in slots}
    assert by_node == {"b": 31000, "a": 40000} and sorted(asked) == ["a", "b"]
