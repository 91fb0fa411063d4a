"""The Ray actor of one node incarnation: runs the node's command where the actor runs.

Loaded by Ray workers by name; it imports no `ray` itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from master.client.env import ENV_POSITION_FILE, ENV_TF_CONFIG_DIRECT
from master.client.position import collect_positions, encode_positions
from master.platform.api import NodeLaunchSpec
from master.platform.lifeline_guard import EXIT_CANNOT_RUN, GUARD_MODULE
from master.platform.local import (
    free_port,
    kill_process_group,
    position_base_for,
    read_tail,
    spawn_logged,
)
from master.platform.peer_forward import ENV_PEER_FORWARD, PeerForwarders
from master.platform.proc_stats import process_groups_cpu_seconds


def node_actor_name(node_id: int) -> str:
    """The name of a node actor created through a job anchor (found again by a new master)."""
    return f"node-{node_id}"


class NodeActor:
    """One node incarnation: its command in a fresh process group, run where the actor runs.

    The log goes to `spec.log_path` on the Ray node that hosts the actor. On a single machine
    that is the master's run dir; on a multi-host cluster the path must be on storage shared
    by the Ray nodes, or the log stays local to the Ray node that ran the incarnation.
    """

    def __init__(self, spec: NodeLaunchSpec, ray_node: str) -> None:
        self.spec = spec
        self._proc: subprocess.Popen | None = None
        self._error = ""
        # The actor keeps the write end for its whole life: when its process goes, the guard's
        # sentinel sees end-of-file and kills the node's process group.
        read_fd, self._lifeline = os.pipe()
        # The node's trainers keep their data position there; read back when the node ends.
        env = {**ray_node_env(), **spec.env, ENV_POSITION_FILE: position_base_for(spec)}
        # Its peers at forwarders on this Ray node: a peer that moves is followed (readdress).
        self._peers = PeerForwarders()
        if "TF_CONFIG" in env and env.get(ENV_PEER_FORWARD) != "0":
            env[ENV_TF_CONFIG_DIRECT] = env["TF_CONFIG"]
            env["TF_CONFIG"] = self._peers.forward(env["TF_CONFIG"])
        guard = [sys.executable, "-m", GUARD_MODULE, str(read_fd), "--"]
        try:
            self._proc = spawn_logged(
                spec,
                guard + list(spec.command),
                env,
                f" on Ray node {ray_node} (actor pid {os.getpid()})",
                pass_fds=(read_fd,),
            )
        except OSError as e:
            self._error = f"cannot start {spec.type}-{spec.rank} id={spec.id}: {e}"
            self._peers.close()
        finally:
            os.close(read_fd)

    def wait(self) -> tuple[int, str, str]:
        """Block until the command ends: its exit code, its log tail if it failed, and the
        data positions its trainers recorded last (master.client.position, encoded)."""
        if self._proc is None:
            return EXIT_CANNOT_RUN, self._error, ""
        code = self._proc.wait()
        self._peers.close()
        # Anything the node left behind in its group goes with it.
        kill_process_group(self._proc.pid, signal.SIGKILL)
        tail = read_tail(self.spec.log_path) if code != 0 else ""
        return code, tail, encode_positions(collect_positions(position_base_for(self.spec)))

    def readdress(self, addresses: dict[tuple[str, int], str]) -> bool:
        """Peers moved to these addresses: this node reaches them there from now on (its
        forwarders' connections are cut); False if it dials one of them directly."""
        return self._peers.readdress(addresses)

    def free_port(self, ip: str) -> int:
        """A port free on this Ray node now (for a rank the master places here)."""
        return free_port(ip)

    def cpu_seconds(self) -> float | None:
        """CPU seconds the node's process group used so far; None once it has ended."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return process_groups_cpu_seconds([self._proc.pid]).get(self._proc.pid)

    def positions(self) -> str:
        """The data positions the running node's trainers recorded so far (encoded)."""
        return encode_positions(collect_positions(position_base_for(self.spec), remove=False))

    def signal(self, sig: int) -> bool:
        """Signal the node's whole process group; False if it has ended."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        return kill_process_group(self._proc.pid, sig)

    def kill_raylet(self, node_id: str, delay: float) -> tuple[int, str, float]:
        """Fault injection: SIGKILL this Ray node's raylet, the actor's parent, `delay` seconds
        after answering (master.platform.ray.node_removal.kill_own_raylet)."""
        from master.platform.ray.node_removal import kill_own_raylet

        return kill_own_raylet(node_id, delay)


def ray_node_env() -> dict[str, str]:
    """The environment this Ray node gives its workers, without Ray's own additions.

    A node starts from it (PATH, HOME and the like of the machine it runs on) plus the job's
    env, as a pod starts from its image's. Dropped: Ray's plumbing (RAY_*, SPT_NOENV) and
    what the Ray worker set for itself after it started (OMP_NUM_THREADS=1 for fractional
    CPUs, PYTHONBREAKPOINT), which would throttle or redirect the node's own code.
    """
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
        env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
    except OSError:
        env = {}
    if not env:  # not Linux: the worker's current env is the best there is
        env = {
            k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONBREAKPOINT")
        }
    return {k: v for k, v in env.items() if not k.startswith("RAY_") and k != "SPT_NOENV"}
