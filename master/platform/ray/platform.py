"""The Ray platform in the master: launches node actors, signals them, adopts them after a
restart, and turns their ends into `NodeEvent`s (see the package docstring)."""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from master.client.position import decode_positions
from master.platform.api import (
    NODE_LOST,
    POSITIONS_DETAIL,
    REASON_DETAIL,
    HostRemoval,
    NodeEvent,
    NodeLaunchSpec,
    Platform,
    PlatformError,
)
from master.platform.peer_forward import ENV_PEER_FORWARD
from master.platform.ray.actor_calls import CpuSecondsPoll, free_port_from_actors, gather
from master.platform.ray.actor_end import MIN_NODE_CPU, actor_failure_event, says_node_died
from master.platform.ray.connect import import_ray, is_loopback, join_cluster, start_local_cluster
from master.platform.ray.job_anchor import ANCHOR_NAME
from master.platform.ray.node_actor import NodeActor, node_actor_name
from master.platform.ray.node_removal import remove_ray_node
from master.platform.ray.placement import NodePlacement, RayNode
from master.platform.ray.raylet_probe import raylet_answers

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# One ray.wait blocks this long before the watcher picks up newly launched nodes.
WATCH_TICK_SECONDS = 0.2
# How long a signal to a node may wait for its actor (it may still be starting).
SIGNAL_TIMEOUT_SECONDS = 10.0
# How long the actors on live Ray nodes get to point their forwarders at moved ranks.
READDRESS_TIMEOUT_SECONDS = 3.0
# After SIGKILL, how long to wait for a process to be reaped before giving up on it.
KILL_WAIT_SECONDS = 5.0
# wait() occupies one actor thread for the node's lifetime; signal() needs another.
ACTOR_MAX_CONCURRENCY = 4
# How much of a Ray node's id the logs show.
RAY_NODE_ID_CHARS = 12
# An actor Ray calls unavailable (its connection broke: its Ray node may be going) is asked
# again this often until Ray says whether it lives or died.
UNAVAILABLE_RETRY_SECONDS = 0.2
# An actor unreachable this long on a Ray node Ray still has alive (a network partition) ends
# as a failure, so the master can relaunch the rank.
UNAVAILABLE_GIVE_UP_SECONDS = 30.0


@dataclass
class _Running:
    """A launched node incarnation: its actor and the pending result of its wait()."""

    spec: NodeLaunchSpec
    node: RayNode
    actor: Any
    ref: Any
    actor_name: str = ""  # named actors (through the job anchor): found again by name
    retry_at: float = 0.0  # unavailable: when to ask again (monotonic; 0: its wait() runs)
    unreachable_since: float = 0.0  # monotonic; 0: reachable
    signalled: bool = False  # this platform sent it a signal (a stop, a kill)
    held: Any = None  # its wait() result, held while its raylet does not answer


class RayPlatform(Platform):
    """Runs nodes as Ray actors, each pinned to one Ray node per (type, rank).

    With no address it starts a local cluster on loopback (and shuts it down at the end);
    with an address it connects to that cluster; if this process is already connected to
    Ray it uses that connection. `host` is the address the master advertises to nodes: on a
    multi-host cluster it must not be loopback.
    """

    # A standby PS is an actor of the PS group's resources on a Ray node apart from ps-0's
    # (beside it with forwarders off: it then takes over ps-0's address).
    runs_ps_standby = True

    def __init__(self, host: str = "127.0.0.1", address: str = "", namespace: str = "") -> None:
        super().__init__()
        self.host = host
        self.address = address
        self.namespace = namespace  # the run's Ray namespace, where its job anchor is
        already = "ray" in sys.modules and sys.modules["ray"].is_initialized()
        ray_host = address.rsplit(":", 1)[0] if address else "127.0.0.1"
        self._ray = ray = import_ray(loopback=not already and is_loopback(ray_host))
        self._owns_connection = not already
        if already:
            log.info("using this process's existing Ray connection")
        elif address:
            join_cluster(ray, address)
        else:
            start_local_cluster()
        from ray.exceptions import (
            ActorUnavailableError,
            GetTimeoutError,
            RayActorError,
            RayError,
        )
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._RayError, self._RayActorError = RayError, RayActorError
        self._GetTimeoutError = GetTimeoutError
        self._ActorUnavailableError = ActorUnavailableError
        self._affinity = NodeAffinitySchedulingStrategy
        self._actor_class = ray.remote(NodeActor)
        self._my_node = ray.get_runtime_context().get_node_id()
        self._placement = NodePlacement(ray, host, self._my_node, NodeAffinitySchedulingStrategy)
        # Called with the lock held: a port asked of a node actor there is faster than a task.
        self._placement.port_from_actors = lambda node: free_port_from_actors(
            ray, [r.actor for r in self._running.values() if r.node == node], node.ip
        )
        self._anchor: Any = None
        if namespace:
            try:
                self._anchor = ray.get_actor(ANCHOR_NAME, namespace=namespace)
            except ValueError:
                raise PlatformError(
                    f"no job anchor in Ray namespace {namespace!r}: the `dlrover submit` that "
                    "supervises this master is gone (or --ray-namespace is wrong)"
                ) from None

        self._lock = threading.Lock()  # guards _running and _placement
        self._running: dict[int, _Running] = {}
        # cpu_seconds: requests still unanswered, and the last figure of each running node
        self._cpu = CpuSecondsPoll(self._ray)
        self._forwarding = True  # the job's nodes reach their peers through forwarders
        self._closed = False
        self._wake = threading.Event()
        self._stop_watch = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="ray-watcher", daemon=True)
        self._watcher.start()

    # -- addresses ---------------------------------------------------------------------------

    def address_for(self, node_type: str, rank: int) -> str:
        with self._lock:
            return self._placement.slot(node_type, rank, check_alive=True).address

    # -- launching and signalling -----------------------------------------------------------

    def launch(self, spec: NodeLaunchSpec) -> None:
        if self._closed:
            raise RuntimeError("the Ray platform is shut down")
        with self._lock:
            # Job-wide: whether peers reach each other through forwarders (see readdress).
            self._forwarding = spec.env.get(ENV_PEER_FORWARD) != "0"
            if spec.rank < 0:  # a standby: beside or apart from the rank it likely replaces
                node = self._placement.standby_node(spec.type, apart=self._forwarding)
            else:
                node = self._placement.slot(spec.type, spec.rank, check_alive=False).node
        options: dict[str, Any] = {
            "num_cpus": spec.cpu if spec.cpu > 0 else MIN_NODE_CPU,
            "scheduling_strategy": self._affinity(node.node_id, soft=False),
            "max_restarts": 0,
            "max_concurrency": ACTOR_MAX_CONCURRENCY,
        }
        if spec.memory_mb > 0:
            options["memory"] = spec.memory_mb * MIB
        name = ""
        # The log's header names the Ray node: its address and id (many share an address).
        where = f"{node.ip} [{node.node_id[:RAY_NODE_ID_CHARS]}]"
        if self._anchor is not None:
            del options["scheduling_strategy"]
            options["node_id"] = node.node_id
            actor = self._ray.get(self._anchor.launch.remote(spec, where, options), timeout=120)
            name = node_actor_name(spec.id)
        else:
            actor = self._actor_class.options(**options).remote(spec, where)
        run = _Running(spec=spec, node=node, actor=actor, ref=actor.wait.remote(), actor_name=name)
        with self._lock:
            self._running[spec.id] = run
        self._wake.set()
        log.info(
            "launched %s-%d id=%d as a Ray actor on %s", spec.type, spec.rank, spec.id, node.ip
        )

    def cpu_seconds(self, node_ids: Collection[int]) -> dict[int, float]:
        """CPU seconds of each node's process group, measured by its actor on its Ray node
        (one call old: see CpuSecondsPoll)."""
        with self._lock:
            actors = {i: r.actor for i in node_ids if (r := self._running.get(i)) is not None}
        return self._cpu.poll(actors)

    def readdress(self, addresses: Mapping[tuple[str, int], str]) -> set[int]:
        """Each running node actor points its forwarders to the moved ranks' new addresses."""
        with self._lock:
            alive = {n.node_id for n in self._placement.alive_nodes(refresh=True)}
            runs = [r for r in self._running.values() if r.node.node_id in alive]
        asked = {r.spec.id: r.actor.readdress.remote(dict(addresses)) for r in runs}
        return {i for i, ok in gather(self._ray, asked, READDRESS_TIMEOUT_SECONDS).items() if ok}

    def read_positions(self, node_id: int) -> dict[str, list[tuple[int, int]]]:
        """The running node's position files, read by its actor on its Ray node."""
        with self._lock:
            run = self._running.get(node_id)
        if run is None:
            return {}
        try:
            return decode_positions(self._ray.get(run.actor.positions.remote(), timeout=10))
        except Exception as e:  # a dead actor, or one of an older master without the method
            log.warning("cannot read the positions of node id=%d: %s", node_id, e)
            return {}

    def can_stand_in(self, standby_id: int, node_type: str, rank: int) -> bool:
        """Beside the rank's slot; anywhere alive where peers follow a rank that moves."""
        with self._lock:
            run = self._running.get(standby_id)
            slot = self._placement.get(node_type, rank)
            if run is None or slot is None:
                return False
            if self._forwarding:
                return self._placement.is_alive(run.node.node_id)
        return run.node.node_id == slot.node.node_id

    def take_over(self, standby_id: int, node_type: str, rank: int) -> None:
        """The rank moves to the standby's Ray node (a fresh port there) if it is elsewhere."""
        with self._lock:
            run = self._running.get(standby_id)
            slot = self._placement.get(node_type, rank)
            if run is not None and slot is not None and run.node.node_id != slot.node.node_id:
                self._placement.move_to(node_type, rank, run.node)

    def signal_node(self, node_id: int, sig: int = signal.SIGKILL) -> bool:
        with self._lock:
            run = self._running.get(node_id)
        return run is not None and self._signal(run, sig)

    def _signal(self, run: _Running, sig: int) -> bool:
        run.signalled = True
        try:
            return bool(
                self._ray.get(run.actor.signal.remote(int(sig)), timeout=SIGNAL_TIMEOUT_SECONDS)
            )
        except self._GetTimeoutError:
            if sig != signal.SIGKILL:
                log.warning("%s: actor did not answer a signal", _name(run.spec))
                return False
            # An actor that cannot even be reached is killed whole; its death becomes the event.
            self._kill_actor(run)
            return True
        except self._RayActorError:
            # The actor died while the signal was on its way, most often because the signal
            # ended the node and the watcher, seeing the end first, released the actor. Either
            # way the node is over and the watcher reports its end (with its positions): a
            # caller told False would report a second end of its own.
            return True
        except self._RayError as e:
            log.warning("%s: signal %d failed: %s", _name(run.spec), sig, e)
            return False

    def remove_host(self, node_id: int) -> HostRemoval:
        """Remove the Ray node of node `node_id` (master.platform.ray.node_removal); never
        the head's, this master's or the job anchor's."""
        with self._lock:
            run = self._running.get(node_id)
        if run is None:
            raise PlatformError(f"node id={node_id} is not running")
        protected = {self._my_node: "this job's master"}
        if self._anchor is not None:
            try:
                anchor_node = self._ray.get(self._anchor.node_id.remote(), timeout=10)
            except Exception as e:  # the anchor is gone, or of an older version
                raise PlatformError(f"cannot tell which Ray node holds the job anchor: {e}") from e
            protected.setdefault(anchor_node, "the job anchor (which owns every node actor)")
        # Through the node's own actor, a Ray worker already on that Ray node.
        return remove_ray_node(self._ray, run.node, protected, self._affinity, run.actor)

    def stop_node(self, node_id: int, grace_seconds: float) -> None:
        with self._lock:
            run = self._running.get(node_id)
        if run is None:
            return
        threading.Thread(
            target=self._stop, args=(run, grace_seconds), name=f"stop-{node_id}", daemon=True
        ).start()

    def _stop(self, run: _Running, grace_seconds: float) -> None:
        """SIGTERM, SIGKILL after the grace period, then the actor itself."""
        ray = self._ray
        try:
            ref = run.ref
            if ref is not None and self._signal(run, signal.SIGTERM):
                ready, _ = ray.wait([ref], timeout=grace_seconds)
                if not ready and self._signal(run, signal.SIGKILL):
                    ray.wait([ref], timeout=KILL_WAIT_SECONDS)
        except Exception as e:  # the actor died meanwhile, or Ray is shutting down
            log.debug("%s: stop: %s", _name(run.spec), e)
        self._kill_actor(run)

    def _kill_actor(self, run: _Running) -> None:
        try:
            self._ray.kill(run.actor, no_restart=True)
        except Exception as e:  # already gone, or Ray is shutting down
            log.debug("%s: ray.kill: %s", _name(run.spec), e)
        if self._anchor is not None and run.actor_name:
            try:
                self._anchor.release.remote(run.spec.id)
            except Exception as e:
                log.debug("%s: release: %s", _name(run.spec), e)

    # -- resuming under a restarted master ----------------------------------------------------

    def handle(self, node_id: int) -> dict[str, Any]:
        """The node actor's name, namespace and id: a later master finds exactly this actor."""
        with self._lock:
            run = self._running.get(node_id)
        if run is None or not run.actor_name:
            return {}
        return {
            "actor": run.actor_name,
            "namespace": self.namespace,
            "actor_id": run.actor._actor_id.hex(),
        }

    def restore_addresses(self, addresses: dict[tuple[str, int], str]) -> None:
        """Pin each (type, rank) to the Ray node and port a previous master gave it."""
        if self._anchor is None:
            raise PlatformError(self._no_anchor())
        with self._lock:
            self._placement.restore(addresses)

    def adopt(self, spec: NodeLaunchSpec, handle: dict[str, Any]) -> None:
        """Watch a node actor a previous master started; an end it missed is reported now."""
        if self._anchor is None:
            raise PlatformError(self._no_anchor())
        name = str(handle.get("actor") or node_actor_name(spec.id))
        namespace = str(handle.get("namespace") or self.namespace)
        with self._lock:
            slot = self._placement.get(spec.type, spec.rank)
        node = slot.node if slot else RayNode("", "?", 0.0)
        actor = None
        try:
            actor = self._ray.get_actor(name, namespace=namespace)
        except ValueError:
            pass
        if actor is not None and handle.get("actor_id") not in (None, actor._actor_id.hex()):
            log.warning("%s: actor %s is another incarnation's; not adopting it", _name(spec), name)
            actor = None
        if actor is None:
            self.events.put(
                NodeEvent(
                    spec.type,
                    spec.rank,
                    spec.id,
                    exit_code=-signal.SIGKILL,
                    message=f"{_name(spec)} id={spec.id}: its Ray actor {name} ended while no "
                    "master watched it",
                    details={"ray_error": "ActorGone"},
                )
            )
            return
        run = _Running(spec=spec, node=node, actor=actor, ref=actor.wait.remote(), actor_name=name)
        with self._lock:
            self._running[spec.id] = run
        self._wake.set()
        log.info("adopted %s-%d id=%d (Ray actor %s)", spec.type, spec.rank, spec.id, name)

    def _no_anchor(self) -> str:
        return (
            "the Ray platform adopts a previous master's nodes only under `dlrover submit "
            "--platform ray --ray-address ADDRESS`, whose job anchor keeps them alive; this "
            "master was started without one"
        )

    # -- events ------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Turn finished wait() calls (exits) and failed ones (dead actors) into events."""
        ray = self._ray
        while not self._stop_watch.is_set():
            with self._lock:
                by_ref = {r.ref: r for r in self._running.values() if r.ref is not None}
                retrying = len(by_ref) < len(self._running)
            if not by_ref and retrying:
                self._stop_watch.wait(UNAVAILABLE_RETRY_SECONDS)
                self._retry_unavailable()
                continue
            if not by_ref:
                self._wake.wait(WATCH_TICK_SECONDS)
                self._wake.clear()
                continue
            try:
                refs = list(by_ref)
                ready, _ = ray.wait(refs, num_returns=1, timeout=WATCH_TICK_SECONDS)
                if ready:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            except Exception as e:  # Ray going away under us during shutdown
                if not self._stop_watch.is_set():
                    log.error("ray.wait failed: %s", e)
                    self._stop_watch.wait(WATCH_TICK_SECONDS)
                continue
            for ref in ready:
                run = by_ref[ref]
                if not self._unavailable(run) and not self._host_suspect(run):
                    self._finish(run)
            self._retry_unavailable()

    def _unavailable(self, run: _Running) -> bool:
        """Whether the run's wait() failed only because Ray cannot reach its actor now (its
        connection broke: its Ray node may be dying, or a network blip). Such a run is not
        over until Ray knows: it is asked again, and its Ray node's death ends it."""
        try:
            self._ray.get(run.ref, timeout=0)
        except self._ActorUnavailableError:
            with self._lock:
                if self._running.get(run.spec.id) is run:
                    now = time.monotonic()
                    run.retry_at = now + UNAVAILABLE_RETRY_SECONDS
                    run.unreachable_since = run.unreachable_since or now
                    run.ref = None
            return True
        except Exception:  # an exit, a dead actor: _finish reads it
            return False
        return False

    def _host_suspect(self, run: _Running) -> bool:
        """Whether a node that ended by a signal this platform never sent ended with its
        raylet (which no longer answers): its end is held until Ray marks the Ray node dead
        (a NodeLost), or the raylet answers again (a plain kill)."""
        try:
            result = self._ray.get(run.ref, timeout=0)
        except Exception:  # a dead actor: _finish reads it
            return False
        if int(result[0]) >= 0 or run.signalled:
            return False
        if raylet_answers(run.node.ip, run.node.raylet_port):
            return False
        with self._lock:
            if self._running.get(run.spec.id) is not run:
                return False
            now = time.monotonic()
            run.held, run.ref = result, None
            run.retry_at, run.unreachable_since = now, now
        log.info("%s id=%d: ended by a signal, its raylet silent", _name(run.spec), run.spec.id)
        return True

    def _retry_unavailable(self) -> None:
        """Runs whose actor was unavailable: ended as lost once their Ray node is dead, else
        their wait() asked again (it fails at once while Ray still cannot reach the actor)."""
        now = time.monotonic()
        with self._lock:
            due = [r for r in self._running.values() if r.ref is None and r.retry_at <= now]
        for run in due:
            with self._lock:
                alive = self._placement.is_alive(run.node.node_id)
            if not alive or now - run.unreachable_since > UNAVAILABLE_GIVE_UP_SECONDS:
                self._finish(run)
                continue
            if run.held is not None:  # ended: nothing to ask again, only whether Ray knows
                if raylet_answers(run.node.ip, run.node.raylet_port):
                    self._finish(run)  # a plain kill after all
                else:
                    run.retry_at = now + UNAVAILABLE_RETRY_SECONDS
                continue
            ref = run.actor.wait.remote()
            with self._lock:
                if self._running.get(run.spec.id) is run:
                    run.ref = ref

    def _finish(self, run: _Running) -> None:
        """Report a node's end once and release its actor."""
        with self._lock:
            if self._running.get(run.spec.id) is not run:
                return
            del self._running[run.spec.id]
        event = self._event_for(run)
        self._kill_actor(run)
        log.info("%s id=%d ended with %d", _name(run.spec), run.spec.id, event.exit_code)
        self.events.put(event)

    def _event_for(self, run: _Running) -> NodeEvent:
        spec = run.spec
        if run.held is not None:
            return self._held_event(run)
        if run.ref is None and self._alive(run):  # unreachable for too long
            return NodeEvent(
                spec.type,
                spec.rank,
                spec.id,
                exit_code=-signal.SIGKILL,
                message=f"{_name(spec)} id={spec.id}: its Ray actor on {run.node.ip} was "
                f"unreachable for {UNAVAILABLE_GIVE_UP_SECONDS:g}s",
                details={"ray_error": "ActorUnavailableError"},
            )
        if run.ref is None:  # unavailable, then its Ray node was found dead
            return self._lost(
                run, "its Ray node died (its actor was unreachable, then Ray marked the node dead)"
            )
        try:
            code, tail, *rest = self._ray.get(run.ref, timeout=KILL_WAIT_SECONDS)
            positions = rest[0] if rest else ""  # an actor of an older master has none
            return NodeEvent(
                spec.type,
                spec.rank,
                spec.id,
                exit_code=int(code),
                message=tail,
                details={POSITIONS_DETAIL: positions} if positions else {},
            )
        except Exception as e:  # a dead actor (RayError), or Ray itself gone
            text = " ".join(str(e).split())
            if says_node_died(text):
                return self._lost(run, f"its Ray node died: {text[:600]}")
            if type(e).__name__ == "ActorUnschedulableError" and not self._alive(run):
                return self._lost(run, f"its Ray node is gone: {text[:600]}")
            return actor_failure_event(spec, run.node.ip, e, isinstance(e, self._RayActorError))

    def _held_event(self, run: _Running) -> NodeEvent:
        """The end of a node held while its raylet did not answer: lost if its Ray node is
        dead now (with the positions its actor read back), else the exit it had."""
        code, tail, *rest = run.held
        positions = {POSITIONS_DETAIL: rest[0]} if rest and rest[0] else {}
        if not self._alive(run):
            event = self._lost(run, f"its Ray node died (the node's processes ended with {code})")
            return dataclasses.replace(event, details={**event.details, **positions})
        spec = run.spec
        return NodeEvent(spec.type, spec.rank, spec.id, int(code), message=tail, details=positions)

    def _alive(self, run: _Running) -> bool:
        with self._lock:
            return self._placement.is_alive(run.node.node_id)

    def _lost(self, run: _Running, what: str) -> NodeEvent:
        """The end of a node whose Ray node was lost with every process on it: no exit code,
        reported as NodeLost (as a Kubernetes node lost), so the master relaunches it on a Ray
        node still alive (the placement has seen the death: its rank moves)."""
        spec = run.spec
        with self._lock:
            self._placement.alive_nodes(refresh=True)
        return NodeEvent(
            spec.type,
            spec.rank,
            spec.id,
            exit_code=-signal.SIGKILL,
            message=f"{NODE_LOST}: {_name(spec)} id={spec.id} on Ray node {run.node.ip} "
            f"[{run.node.node_id[:RAY_NODE_ID_CHARS]}]: {what}",
            details={REASON_DETAIL: NODE_LOST, "ray_node": run.node.node_id},
        )

    # -- the end -----------------------------------------------------------------------------

    def shutdown(self, grace_seconds: float = 5.0) -> None:
        """Stop every node (SIGTERM, SIGKILL after the grace), kill every actor, report ends."""
        ray = self._ray
        self._closed = True
        self._stop_watch.set()
        self._wake.set()
        self._watcher.join(timeout=5)
        with self._lock:
            runs = list(self._running.values())
        try:
            if runs:
                self._terminate(runs, grace_seconds)
        except Exception as e:  # Ray itself failing: the actors' ends are reported below
            log.error("stopping the Ray nodes: %s", e)
        finally:
            for run in runs:
                self._finish(run)
            if self._owns_connection and ray.is_initialized():
                ray.shutdown()

    def _terminate(self, runs: list[_Running], grace_seconds: float) -> None:
        """SIGTERM every node at once, SIGKILL the ones left after the grace, then actors."""
        ray = self._ray
        runs = [run for run in runs if run.ref is not None]  # not unreachable ones
        if not runs:
            return
        for run in runs:
            run.actor.signal.remote(int(signal.SIGTERM))
        refs = [run.ref for run in runs]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=grace_seconds)
        left = [run for run in runs if run.ref in set(pending)]
        for run in left:
            run.actor.signal.remote(int(signal.SIGKILL))
        if left:
            refs = [run.ref for run in left]
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=KILL_WAIT_SECONDS)
        for run in left:
            if run.ref in set(pending):
                log.error("%s: still running after SIGKILL; killing its actor", _name(run.spec))
                self._kill_actor(run)

    def running_ids(self) -> list[int]:
        with self._lock:
            return list(self._running)


def _name(spec: NodeLaunchSpec) -> str:
    return f"{spec.type}-{spec.rank}"
