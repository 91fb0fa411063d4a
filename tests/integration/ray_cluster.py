"""A multi-node Ray cluster on this machine (one raylet per Ray node), and losing a whole node.

`start_ray_cluster(n)` starts a head (no CPUs, so no job node lands on it: it holds the GCS,
and removing it would end the cluster) and `n` worker Ray nodes on loopback, each with its own
raylet and a custom resource `ray_node_<i>`; this process joins it as a driver.
`RayCluster.node_holding(pid)` finds the Ray node a process runs on, `node_of_log(path)` the one
a node incarnation ran on (its log's header names it), and `remove(node)`
loses it whole: its raylet SIGKILLed (with it every worker process there, and with those the
node commands their actors ran), as when a host goes away.

Ray learns of a lost raylet from the GCS health check (defaults: every 3 s, 5 misses); the
cluster here checks every `HEALTH_CHECK_PERIOD_MS` and marks a node dead after
`HEALTH_CHECK_FAILURES` misses, as a production cluster can be configured to.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

from master.platform.ray.connect import AUTH_MODE_ENV, LOOPBACK_ENV

# The GCS's health check of each raylet: how often, how long one check may take, and how many
# misses mark a Ray node dead (about 1.5 s here instead of Ray's default 15 s).
HEALTH_CHECK_PERIOD_MS = 500
HEALTH_CHECK_TIMEOUT_MS = 1000
HEALTH_CHECK_FAILURES = 3
# A node log's header: `# worker-0 id=3 on Ray node 127.0.0.1 [5f0c3a...] (actor pid 1234)`.
_RAY_NODE = re.compile(r"on Ray node \S+ \[([0-9a-f]+)\]")


@dataclass
class RayCluster:
    """A running multi-node test cluster: its address, and its worker Ray nodes by index."""

    cluster: Any  # ray.cluster_utils.Cluster
    address: str
    nodes: list[Any]  # ray._private.node.Node of each worker Ray node, by index
    cpus_per_node: int = 1
    saved_env: dict[str, str | None] = field(default_factory=dict)
    removed: list[int] = field(default_factory=list)

    def node_id(self, index: int) -> str:
        """The Ray node id (hex) of worker Ray node `index`."""
        return self.nodes[index].node_id

    def raylet_pid(self, index: int) -> int:
        return self.nodes[index].all_processes["raylet"][0].process.pid

    def node_holding(self, pid: int) -> int | None:
        """The index of the worker Ray node whose raylet `pid` descends from (None: none)."""
        raylets = {self.raylet_pid(i): i for i in range(len(self.nodes)) if i not in self.removed}
        try:
            proc: psutil.Process | None = psutil.Process(pid)
            while proc is not None:
                if proc.pid in raylets:
                    return raylets[proc.pid]
                proc = proc.parent()
        except psutil.Error:
            return None
        return None

    def node_of_log(self, log_path: str, timeout: float = 60.0) -> int:
        """The Ray node that runs (or ran) the node incarnation whose log is `log_path`, from
        the Ray node id in the log's header."""
        deadline = time.monotonic() + timeout
        while True:
            header = _first_line(log_path)
            m = _RAY_NODE.search(header)
            if m:
                found = [i for i, n in enumerate(self.nodes) if n.node_id.startswith(m.group(1))]
                assert len(found) == 1, (header, found)
                return found[0]
            assert time.monotonic() < deadline, f"no Ray node in {log_path}: {header!r}"
            time.sleep(0.05)

    def remove(self, index: int, graceful: bool = False) -> float:
        """Lose worker Ray node `index` whole (raylet SIGKILLed unless `graceful`); returns the
        wall time it happened."""
        node = self.nodes[index]
        at = time.time()
        self.cluster.remove_node(node, allow_graceful=graceful)
        self.removed.append(index)
        return at

    def wait_dead(self, index: int, timeout: float = 30.0) -> float:
        """Until Ray marks node `index` dead; the wall time it was seen dead."""
        import ray

        node_id = self.node_id(index)
        deadline = time.monotonic() + timeout
        while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, f"Ray node {index} still alive after {timeout}s"
            time.sleep(0.05)
        return time.time()

    def add(self) -> int:
        """One more worker Ray node (after a removal, say); its index."""
        index = len(self.nodes)
        self.nodes.append(
            self.cluster.add_node(
                num_cpus=self.cpus_per_node,
                node_ip_address="127.0.0.1",
                resources={f"ray_node_{index}": 1},
            )
        )
        self.cluster.wait_for_nodes()
        return index

    def top_up(self, count: int) -> None:
        """Add Ray nodes until `count` are alive."""
        while len(self.alive()) < count:
            self.add()

    def alive(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if i not in self.removed]

    def shutdown(self) -> None:
        """Disconnect, stop every raylet and the head, and put the env back."""
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        for k, v in self.saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_ray_cluster(worker_nodes: int = 3, cpus_per_node: int = 1) -> RayCluster:
    """A head without CPUs and `worker_nodes` Ray nodes of `cpus_per_node` CPUs each, on
    loopback, authentication off; this process is connected to it as a driver."""
    saved = {k: os.environ.get(k) for k in (AUTH_MODE_ENV, LOOPBACK_ENV)}
    os.environ[AUTH_MODE_ENV] = "disabled"
    os.environ[LOOPBACK_ENV] = "0"  # read when ray is first imported: bind 127.0.0.1 only
    import logging

    import ray
    from ray.cluster_utils import Cluster

    health = {
        "health_check_period_ms": HEALTH_CHECK_PERIOD_MS,
        "health_check_timeout_ms": HEALTH_CHECK_TIMEOUT_MS,
        "health_check_failure_threshold": HEALTH_CHECK_FAILURES,
    }
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 0,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "_system_config": health,
        },
    )
    result = RayCluster(cluster, cluster.address, [], cpus_per_node, saved)
    try:
        for _ in range(worker_nodes):
            result.add()
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    except BaseException:
        result.shutdown()
        raise
    return result


@contextlib.contextmanager
def ray_cluster(worker_nodes: int = 3, cpus_per_node: int = 1) -> Iterator[RayCluster]:
    """`start_ray_cluster` for a `with` block (or a fixture): always shut down after."""
    cluster = start_ray_cluster(worker_nodes, cpus_per_node)
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline()
    except OSError:
        return ""
