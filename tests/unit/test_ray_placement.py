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
    assert placement.standby_node("ps") == ps0.node
    ray.dead.add(ps0.node.node_id)
    placement.alive_nodes(refresh=True)
    assert placement.standby_node("ps").node_id != ps0.node.node_id  # where a new rank goes


def test_without_a_rank_0_a_standby_goes_where_a_new_rank_would():
    placement = _placement(FakeRay({"a": ("10.0.0.1", 1), "b": ("10.0.0.2", 8)}))
    assert placement.standby_node("ps").node_id == "b"
