"""The agent side: owns the node's checkpoint shared memory and runs the persister in-process."""

from __future__ import annotations

import logging
import os
import shutil

from dlrover_torch.checkpoint import lease, shm, shm_clean
from dlrover_torch.checkpoint.env import DEFAULT_ORPHAN_GRACE_S, SERVICE_ENV
from dlrover_torch.checkpoint.persister import PersistResult
from dlrover_torch.checkpoint.service import PersistService
from dlrover_torch.checkpoint.socket_dir import hold_owner_lock, make_socket_dir

log = logging.getLogger(__name__)

DEFAULT_STOP_PERSIST_TIMEOUT_S = 300.0


class AgentCheckpointKeeper:
    """Serves the node's workers: persists on request and before a worker group is stopped.

    Usage in an agent::

        keeper = AgentCheckpointKeeper(f"{job}-{node_rank}")
        os.environ.update(keeper.start())      # workers find the service through this
        agent.on_stop.append(keeper.stop_hook)  # persist the latest memory checkpoint first
        ...
        keeper.close()                          # removes the node's checkpoint shm
    """

    def __init__(
        self,
        key: str | None = None,
        stop_persist_timeout: float = DEFAULT_STOP_PERSIST_TIMEOUT_S,
        shm_dir: str = shm.SHM_DIR,
        orphan_grace_s: float = DEFAULT_ORPHAN_GRACE_S,
    ) -> None:
        key = key or f"agent{os.getpid()}"
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)
        self.namespace = f"dlrover-fc-{os.getuid()}-{safe}"
        self.stop_persist_timeout = stop_persist_timeout
        sock = make_socket_dir("agent-")
        self._dir = os.path.dirname(sock)
        self._owner_lock = hold_owner_lock(sock)
        self.shm_dir = shm_dir
        # The node's segments are this agent's: kept across worker restarts while it lives,
        # freed by close(), and by the next sweep on this machine if the agent dies.
        try:
            shm_clean.sweep(shm_dir, orphan_grace_s)
        except OSError as exc:
            log.warning("sweeping ownerless checkpoint memory in %s failed: %s", shm_dir, exc)
        self._lease = lease.Lease.take(
            lease.lease_path(self.namespace, None, shm_dir), lease.owner_info("agent", key=key)
        )
        if self._lease is None:
            log.warning("another live agent holds checkpoint namespace %s", self.namespace)
        self._service = PersistService(sock, self.namespace, shm_dir)
        self._started = False

    def start(self) -> dict[str, str]:
        """Start serving; return the environment the workers need."""
        if not self._started:
            self._service.start()
            self._started = True
        return {SERVICE_ENV: self._service.socket_path}

    def persist_latest(self, timeout: float) -> list[PersistResult]:
        """Persist each local rank's newest memory checkpoint not yet on disk."""
        return self._service.persist_latest(timeout)

    def stop_hook(self, reason: str) -> None:
        """For the agent's on-stop hooks: persist before the worker group is stopped."""
        log.info("worker group stopping (%s): persisting the latest memory checkpoints", reason)
        results = self.persist_latest(self.stop_persist_timeout)
        failed = [r for r in results if not r.ok]
        if failed:
            log.error("could not persist %d memory checkpoint(s): %s", len(failed), failed)

    def close(self, remove_memory: bool = True) -> None:
        """Finish queued persists, stop serving, and remove the shared memory it owns."""
        if self._started:
            self._service.close(unlink_segments=remove_memory)
        elif remove_memory:
            for path in shm.slot_paths(self.namespace, self.shm_dir):
                shm.unlink_quietly(path)
        shutil.rmtree(self._dir, ignore_errors=True)
        self._owner_lock.close()
        if self._lease is not None:
            self._lease.release(remove=remove_memory)
