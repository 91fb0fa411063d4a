"""Node incarnations start and end here: launch, adopt, and the three ways a node is ended.

- `stop`: graceful (SIGTERM, a grace period, then SIGKILL): the job's end, a scale-in.
- `stop_now`: at once, expected (its state is saved elsewhere, e.g. a PS after a checkpoint).
- `kill`: at once, a failure verdict (heartbeat lost, hung, straggler, a coordinator restart).

Whatever the way, the node's end comes back as a platform event and is handled by
master.job.exits; a node the platform no longer has is handed to `on_gone` at once."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from master.config import JobSpec
from master.job.cluster import Cluster
from master.job.events import Emit
from master.job.launch import launch_spec, node_env, node_log_path
from master.job.model import STOP_GRACE_SECONDS, JobRuntime, NodeStart
from master.nodes.manager import NodeManager
from master.nodes.model import Node
from master.platform.api import NodeEvent, NodeLaunchSpec, Platform


class NodeLifecycle:
    """Starts node incarnations on the platform and ends them; owns no state of its own
    beyond what the node registry and the cluster keep."""

    def __init__(
        self,
        spec: JobSpec,
        runtime: JobRuntime,
        platform: Platform,
        nodes: NodeManager,
        cluster: Cluster,
        emit: Emit,
        on_launched: Callable[[Node], None],
        on_gone: Callable[[NodeEvent], None],
    ) -> None:
        self._spec = spec
        self._runtime = runtime
        self._platform = platform
        self._nodes = nodes
        self._cluster = cluster
        self._emit = emit
        self._on_launched = on_launched  # after the platform took it, before its event
        self._on_gone = on_gone  # a node to end that the platform no longer has

    def launch(self, start: NodeStart) -> Node:
        """Start a new incarnation of (type, rank) at the rank's address."""
        group = self._spec.group(start.node_type)
        node = self._nodes.new_incarnation(
            start.node_type, start.rank, start.relaunches, start.memory_mb or group.memory_mb
        )
        node.cpu = start.cpu or group.cpu
        address = self._cluster.address(start.node_type, start.rank)
        log_path = node_log_path(self._runtime.run_dir, node)
        inherited = os.environ if self._platform.inherits_master_env else None
        env = node_env(self._spec, self._runtime, node, self._cluster.tf_cluster(), inherited)
        self._platform.launch(launch_spec(self._spec, node, env, log_path))
        self._nodes.mark_running(node.id, address, log_path, self._platform.handle(node.id))
        self._on_launched(node)
        self._emit(
            "node_running",
            f"{node.name} (id {node.id}) launched at {address}",
            node,
            relaunches=start.relaunches,
            memory_mb=node.memory_mb,
        )
        return node

    def relocate(self) -> list[tuple[str, int]]:
        """After a host was lost: every running rank's address anew from the platform; the
        (type, rank)s that moved (the TF cluster spec changed)."""
        return self._cluster.refresh_running()

    def addresses(self) -> dict[tuple[str, int], str]:
        """Every rank's address now (a copy), to see which ranks `moved_since` then."""
        return self._cluster.addresses

    def moved_since(self, before: dict[tuple[str, int], str]) -> list[tuple[str, int]]:
        """The ranks whose address changed since `before` (a lost host, a standby elsewhere
        promoted into the rank)."""
        now = self._cluster.addresses
        return sorted(k for k, a in now.items() if before.get(k, a) != a)

    def readdress(self, moved: list[tuple[str, int]]) -> set[int]:
        """The running nodes that reach the `moved` ranks at their new addresses in place
        (their platform forwards to peers); the others need a restart to reach them."""
        return self._platform.readdress({k: self._cluster.address(*k) for k in moved})

    def adopt(self, node: Node) -> None:
        """Take over a node a previous master instance started (it keeps running)."""
        self._platform.adopt(self.adoption_spec(node), node.platform_handle)

    def adoption_spec(self, node: Node) -> NodeLaunchSpec:
        """What a platform needs to adopt a node a previous master started."""
        return launch_spec(self._spec, node, {}, node.log_path)

    def stop(self, node: Node, cause: str = "") -> None:
        """End a node gracefully; `cause` is said with its end ("stopped: job done")."""
        if cause:
            node.stop_cause = cause
        node.stop_requested = True
        self._nodes.save(node)
        self._platform.stop_node(node.id, STOP_GRACE_SECONDS)

    def stop_now(self, node: Node) -> None:
        """End a node at once, as the master asked (not a failure): every step the others
        take meanwhile would be trained again after a restore."""
        node.stop_requested = True
        self._nodes.save(node)
        self.kill(node)

    def signal_kill(self, node: Node) -> bool:
        """SIGKILL a node the platform still runs; False when it has none (its end, e.g.
        with a lost host, is then already on its way as a platform event)."""
        return self._platform.signal_node(node.id, signal.SIGKILL)

    def kill(self, node: Node) -> None:
        """SIGKILL a node; if the platform no longer has it, its end is handled now."""
        if not self._platform.signal_node(node.id, signal.SIGKILL):
            self._on_gone(NodeEvent(node.type, node.rank, node.id, exit_code=-9))
