"""Fault injection on a Ray cluster: a whole Ray node removed, as a lost host.

A Ray worker on that node checks that its parent process is the node's raylet (Ray forks its
workers from the raylet: checked on Ray 2.60) and, a moment after answering, SIGKILLs the
raylet and every process under it (Ray's workers, the node actors' commands), itself last:
everything the Ray node runs ends at once, as with a lost host. (Killing only the raylet is
not enough: its workers exit once they see their parent gone, which takes as long as the
raylet's parent takes to reap it: 40 s and more on a test cluster whose raylets are children
of the test.) The worker is the target's node actor (already there, so at once), else a task
pinned to the node (NodeAffinitySchedulingStrategy, soft=False, no CPU; a worker process may
have to start). This needs no shell on the host and no access to the raylet's port from the
master (Ray's own chaos tests send the raylet a private `ShutdownRaylet` RPC instead). The
removal counts as done only when Ray has the node dead (its health checks missed).

Never removed: the head node (the cluster's GCS ends with it) and the Ray nodes the job cannot
go on without (the master's, the job anchor's that owns the node actors).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

from master.platform.api import HostRemoval, PlatformError
from master.platform.ray.placement import RayNode

log = logging.getLogger(__name__)

# The resource only the head node has.
HEAD_RESOURCE = "node:__internal_head__"
# The raylet's process name (it sets it).
RAYLET_PROCESS = "raylet"
# The task answers, then its raylet is SIGKILLed this much later (from a thread).
KILL_DELAY_SECONDS = 0.2
# How long the task may take to run on its Ray node (a worker process may have to start).
TASK_TIMEOUT_SECONDS = 60.0
# How long Ray may take to mark the node dead after the kill: its health check (by default
# every 3 s, 5 misses) plus slack for a loaded head.
DEAD_TIMEOUT_SECONDS = 90.0
# How often `outcome()` asks Ray (a GCS call) at most.
POLL_SECONDS = 0.25
ID_CHARS = 12


def kill_own_raylet(node_id: str, delay: float) -> tuple[int, str, float]:
    """Runs on Ray node `node_id` (a task, or a node actor's method): (the raylet's pid, "",
    when it is killed, wall time) with the node's kill `delay` seconds away (`kill_ray_node`),
    or (0, why not, 0) if this is not the node or its parent is no raylet."""
    import psutil
    import ray

    here = ray.get_runtime_context().get_node_id()
    if here != node_id:
        return 0, f"the task ran on Ray node {here[:ID_CHARS]}, not on {node_id[:ID_CHARS]}", 0.0
    parent = os.getppid()
    try:
        name = psutil.Process(parent).name()
    except psutil.Error as e:
        return 0, f"cannot read the task's parent process {parent}: {e}", 0.0
    if name != RAYLET_PROCESS:
        why = (
            f"the task's parent process {parent} is {name!r}, not the raylet: this Ray "
            "version does not start workers from the raylet"
        )
        return 0, why, 0.0
    timer = threading.Timer(delay, kill_ray_node, (parent,))
    timer.daemon = True
    timer.start()
    return parent, "", time.time() + delay


def kill_ray_node(raylet_pid: int) -> None:
    """SIGKILL the raylet and every process under it, this one last; all are stopped (SIGSTOP)
    first, so none acts on another's end and the raylet forks no new worker meanwhile."""
    import psutil

    me = os.getpid()
    found: dict[int, Any] = {}
    for _ in range(2):  # again: a process may have forked before it was stopped
        try:
            raylet = psutil.Process(raylet_pid)
            procs = [raylet, *raylet.children(recursive=True)]
        except psutil.Error:
            procs = list(found.values())
        for proc in procs:
            if proc.pid != me and proc.pid not in found:
                found[proc.pid] = proc
                with contextlib.suppress(psutil.Error):
                    proc.suspend()
    for proc in found.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()
    os.kill(me, signal.SIGKILL)


class RayNodeRemoval(HostRemoval):
    """One Ray node being removed: the kill task's answer, then Ray marking the node dead."""

    def __init__(self, ray: Any, node: RayNode, ref: Any) -> None:
        self._ray = ray
        self.node = node
        self.host = f"Ray node {node.ip} [{node.node_id[:ID_CHARS]}]"
        self._ref = ref
        self._started = time.monotonic()
        self._killed_at = 0.0  # monotonic; 0: the task has not answered
        self._raylet_pid = 0
        self._killed_wall = 0.0  # when the raylet was SIGKILLed (wall time, from its host)
        self._task_error = ""
        self._next_poll = 0.0
        self._outcome: bool | None = None

    def outcome(self) -> bool | None:
        now = time.monotonic()
        if self._outcome is not None or now < self._next_poll:
            return self._outcome
        self._next_poll = now + POLL_SECONDS
        try:
            self._poll(now)
        except Exception as e:  # Ray busy or going away: asked again at the next poll
            log.warning("%s: removal: %s", self.host, e)
            if now - self._started > TASK_TIMEOUT_SECONDS + DEAD_TIMEOUT_SECONDS:
                self._fail(f"Ray could not say whether it went: {e}")
        return self._outcome

    def _poll(self, now: float) -> None:
        if not self._killed_at:
            self._read_task(now)
        elif not self._alive():
            self.details = {
                "ray_node": self.node.node_id,
                "raylet_pid": self._raylet_pid,
                "raylet_killed_at": self._killed_wall,
                "seconds_to_dead": round(now - self._killed_at, 2),
            }
            self._outcome = True
        elif now - self._killed_at > DEAD_TIMEOUT_SECONDS:
            self._fail(
                f"its raylet (pid {self._raylet_pid}) was SIGKILLed but Ray still had the node "
                f"alive {DEAD_TIMEOUT_SECONDS:g}s later{self._task_error}"
            )

    def _read_task(self, now: float) -> None:
        ready, _ = self._ray.wait([self._ref], timeout=0)
        if not ready:
            if now - self._started > TASK_TIMEOUT_SECONDS:
                with contextlib.suppress(Exception):  # it may have ended meanwhile
                    self._ray.cancel(self._ref, force=True)
                self._fail(f"the removal task did not run there within {TASK_TIMEOUT_SECONDS:g}s")
            return
        try:
            pid, why, self._killed_wall = self._ray.get(self._ref, timeout=0)
        except Exception as e:  # its worker died before it answered: with the node, or not
            self._task_error = f"; the removal task failed: {' '.join(str(e).split())[:300]}"
            self._killed_at, self._killed_wall = now, time.time()  # Ray tells if it went
            return
        if not pid:
            self._fail(why)
            return
        self._raylet_pid, self._killed_at = int(pid), now

    def _alive(self) -> bool:
        return any(n.get("Alive") and n["NodeID"] == self.node.node_id for n in self._ray.nodes())

    def _fail(self, error: str) -> None:
        self.error, self._outcome = error, False


def remove_ray_node(
    ray: Any, node: RayNode, protected: Mapping[str, str], affinity: Any, actor: Any = None
) -> RayNodeRemoval:
    """Start removing Ray node `node` (see the module docstring) through `actor`, a node actor
    there, if given. PlatformError for the head node, a node in `protected` (Ray node id ->
    what it holds) and a node not alive."""
    info = next((n for n in ray.nodes() if n["NodeID"] == node.node_id), None)
    name = f"Ray node {node.ip} [{node.node_id[:ID_CHARS]}]"
    if info is None or not info.get("Alive"):
        raise PlatformError(f"{name} is not alive")
    if HEAD_RESOURCE in info.get("Resources", {}):
        raise PlatformError(
            f"{name} is the Ray cluster's head node, which is never removed (the cluster ends "
            "with it): start the job's nodes elsewhere (a head with --num-cpus=0)"
        )
    if node.node_id in protected:
        raise PlatformError(
            f"{name} holds {protected[node.node_id]}, and the job cannot go on without it: it is "
            "never removed"
        )
    if actor is not None:
        ref = actor.kill_raylet.remote(node.node_id, KILL_DELAY_SECONDS)
    else:
        task = ray.remote(num_cpus=0, max_retries=0)(kill_own_raylet)
        ref = task.options(scheduling_strategy=affinity(node.node_id, soft=False)).remote(
            node.node_id, KILL_DELAY_SECONDS
        )
    return RayNodeRemoval(ray, node, ref)
