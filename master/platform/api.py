"""The platform interface: launch a node, stop or kill it, and stream node events."""

from __future__ import annotations

import abc
import queue
import signal
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any


class PlatformError(RuntimeError):
    """The platform cannot be used as configured (missing credentials, unreachable cluster)."""


@dataclass(frozen=True)
class NodeLaunchSpec:
    """Everything a platform needs to start one node incarnation."""

    type: str
    rank: int
    id: int
    command: tuple[str, ...]
    env: Mapping[str, str]
    workdir: str
    log_path: str
    cpu: float = 0.0
    memory_mb: int = 0
    # Platforms running images (Kubernetes): this node's image ("" = the platform's), the
    # command as written for it (its own `python`) and the working directory inside it ("" =
    # the image's own). Others run `command` in `workdir`.
    image: str = ""
    image_command: tuple[str, ...] = ()
    image_workdir: str = ""


# NodeEvent.details key: the ended node's last data positions (master.client.position's
# encode_positions), for the master to apply before it re-queues the node's shards.
POSITIONS_DETAIL = "positions"
# NodeEvent.details key of the platform's reason for an end, and the reason of a node whose
# host was lost (a Kubernetes node gone, a Ray node removed or dead): every process on it went
# at once, with no exit code. The master relaunches it where the platform still has room.
REASON_DETAIL = "reason"
NODE_LOST = "NodeLost"


@dataclass(frozen=True)
class NodeEvent:
    """A node incarnation's process ended (exit_code < 0: killed by that signal)."""

    type: str
    rank: int
    id: int
    exit_code: int
    oom_killed: bool = False
    message: str = ""
    details: Mapping[str, str] = field(default_factory=dict)


def node_lost(event: NodeEvent) -> bool:
    """Whether the node ended because its host (Kubernetes node, Ray node) was lost."""
    return event.details.get(REASON_DETAIL) == NODE_LOST


class HostRemoval(abc.ABC):
    """A host taken away with every process on it (fault injection: `Platform.remove_host`).
    It counts as removed only once the platform sees the host gone, which may take seconds."""

    host: str = ""  # names the host in messages
    error: str = ""  # why it failed, once `outcome()` said so
    details: Mapping[str, Any] = {}  # how it went (for the fault's event), once done

    @abc.abstractmethod
    def outcome(self) -> bool | None:
        """True once the host is gone, False if its removal failed (`error` says why), None
        while it is under way. Cheap enough to ask on every control loop tick."""


class Platform(abc.ABC):
    """Where nodes run: local processes, Ray actors or Kubernetes pods."""

    # Whether nodes start with the master's own environment (true for processes on the
    # master's machine). Otherwise nodes get the job's env and DLROVER_* vars on top of what
    # their platform gives them (the image's env for pods, the Ray node's env for actors).
    inherits_master_env = False
    # Whether the master may keep a standby PS process here (master.job.ps_standby), and
    # whether a node gets exactly the resources it was launched with (so a standby launched
    # with the group's resources cannot stand in for a PS moved to other resources).
    runs_ps_standby = False
    enforces_resources = True

    def __init__(self) -> None:
        self.events: queue.Queue[NodeEvent] = queue.Queue()

    @abc.abstractmethod
    def address_for(self, node_type: str, rank: int) -> str:
        """The host:port a node of this type and rank serves on, stable across relaunches."""

    @abc.abstractmethod
    def launch(self, spec: NodeLaunchSpec) -> None:
        """Start a node incarnation; its end arrives later as a NodeEvent."""

    @abc.abstractmethod
    def signal_node(self, node_id: int, sig: int = signal.SIGKILL) -> bool:
        """Send a signal to a running node incarnation; False if it is not running."""

    @abc.abstractmethod
    def stop_node(self, node_id: int, grace_seconds: float) -> None:
        """Stop a node: SIGTERM, then SIGKILL after the grace period."""

    @abc.abstractmethod
    def shutdown(self, grace_seconds: float) -> None:
        """Stop every node this platform started and release its resources."""

    def take_over(self, standby_id: int, node_type: str, rank: int) -> None:
        """Make running standby node `standby_id` reachable at (type, rank)'s address; called
        before it is promoted (nothing to do where it binds that address itself)."""
        return None

    def readdress(self, addresses: Mapping[tuple[str, int], str]) -> set[int]:
        """Ranks moved to these addresses (their host was lost): the running nodes that now
        reach them there without a restart (none where nodes dial their peers directly)."""
        return set()

    def can_stand_in(self, standby_id: int, node_type: str, rank: int) -> bool:
        """Whether running node `standby_id` (a standby) can serve (type, rank)'s address
        (on a cluster: whether it runs where that address is)."""
        return True

    def remove_host(self, node_id: int) -> HostRemoval:
        """Fault injection: take away the host that runs node `node_id`, with every process on
        it, as a machine lost would; its nodes end as lost (NodeLost). PlatformError where the
        platform cannot, or must not (a host the job cannot go on without)."""
        raise PlatformError(
            f"{type(self).__name__} cannot remove a node's host: a host loss (`--kill "
            "TYPE:RANK@WHEN:node`) is rehearsed on --platform ray with --ray-address of a Ray "
            "cluster of several Ray nodes; here use a kill or :freeze"
        )

    def cpu_seconds(self, node_ids: Collection[int]) -> dict[int, float]:
        """CPU seconds each running node's processes used so far, by node id; a node the
        platform cannot measure is left out (its heartbeats say how busy it is, if any)."""
        return {}

    def notices(self) -> list[str]:
        """The latest lines about the platform itself (e.g. API calls retried), oldest first;
        the job turns each new one into a `platform` event."""
        return []

    def troubles(self) -> dict[int, str]:
        """What holds each troubled node up without ending it (an image pull backing off, an
        unschedulable pod, its host not Ready), by node id."""
        return {}

    # -- resuming a job under a restarted master --------------------------------

    def read_positions(self, node_id: int) -> dict[str, list[tuple[int, int]]]:
        """A running node's latest data positions from its position files (see
        master.client.position), where this platform can read them; {} elsewhere."""
        return {}

    def handle(self, node_id: int) -> dict[str, Any]:
        """What a later master instance needs to adopt this running node (kept in the state,
        as JSON: plain strings and numbers)."""
        return {}

    def adopt(self, spec: NodeLaunchSpec, handle: dict[str, Any]) -> None:
        """Watch a node a previous master instance started; its end arrives as a NodeEvent."""
        raise PlatformError(
            f"{type(self).__name__} cannot adopt the nodes of a previous master yet; "
            "a restarted master can resume jobs on the local, Ray and Kubernetes platforms"
        )

    def restore_addresses(self, addresses: dict[tuple[str, int], str]) -> None:
        """Give out the same node addresses a previous master instance gave out."""
        raise PlatformError(
            f"{type(self).__name__} cannot restore a previous master's node addresses yet"
        )
