"""The job's cluster: how many ranks of each type run, its TF cluster version, and each rank's
address (kept across relaunches, so TF peers reconnect to the same place)."""

from __future__ import annotations

from collections.abc import Mapping

from master.config import NODE_TYPES, JobSpec
from master.job.launch import tf_cluster_spec
from master.platform.api import Platform


class Cluster:
    """Owns the replica counts, the cluster version and the addresses handed out."""

    def __init__(self, spec: JobSpec, platform: Platform) -> None:
        self._spec = spec
        self._platform = platform
        self._replicas = {t: spec.group(t).replicas for t in NODE_TYPES}
        self.version = 1  # goes up whenever the TF cluster spec changes
        self._addresses: dict[tuple[str, int], str] = {}

    @property
    def replicas(self) -> dict[str, int]:
        """How many ranks of each type the job has now (a copy)."""
        return dict(self._replicas)

    def resize(self, node_type: str, replicas: int, new_cluster: bool) -> None:
        """Run `replicas` ranks of `node_type`; `new_cluster`: the TF cluster spec changes."""
        self._replicas[node_type] = replicas
        if new_cluster:
            self.version += 1

    def address(self, node_type: str, rank: int) -> str:
        """The node address for (type, rank), remembered so relaunches and a restarted master
        keep it."""
        key = (node_type, rank)
        if key not in self._addresses:
            self._addresses[key] = self._platform.address_for(node_type, rank)
        return self._addresses[key]

    def refresh(self, node_type: str, rank: int) -> bool:
        """Ask the platform again for (type, rank)'s address, after its host was lost; True
        when it moved (the TF cluster spec then changes: a new version)."""
        key = (node_type, rank)
        new = self._platform.address_for(node_type, rank)
        if self._addresses.get(key, new) == new:
            self._addresses[key] = new
            return False
        self._addresses[key] = new
        self.version += 1
        return True

    def refresh_running(self) -> list[tuple[str, int]]:
        """Ask the platform again for the address of every rank that runs, after a host was
        lost: the ranks that moved (every one the host held, whichever end is seen first)."""
        ranks = [k for k in self._addresses if k[1] < self._replicas.get(k[0], 0)]
        return [key for key in sorted(ranks) if self.refresh(*key)]

    @property
    def addresses(self) -> dict[tuple[str, int], str]:
        """Every address handed out so far (a copy), for the runtime record."""
        return dict(self._addresses)

    def tf_cluster(self) -> dict[str, list[str]]:
        """The TF cluster of the nodes that run, or of every worker slot when the job reserves
        them (master.job.launch.tf_cluster_spec)."""
        return tf_cluster_spec(self._spec, self._replicas, self.address)

    def restore(
        self, replicas: Mapping[str, int], version: int, addresses: Mapping[tuple[str, int], str]
    ) -> None:
        """A restarted master takes the previous instance's cluster (the platform is told the
        addresses, so it serves the same ones)."""
        self._replicas.update(replicas)
        self.version = version
        self._addresses = dict(addresses)
        self._platform.restore_addresses(dict(self._addresses))
