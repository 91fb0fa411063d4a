"""Ray platform: every node incarnation is a Ray actor that runs the node's command.

The actor (`NodeActor`) starts the command in its own process group on the Ray node the
node's (type, rank) is pinned to, and its `wait()` returns the exit code. A watcher thread in
the master turns finished `wait()` calls and dead actors into `NodeEvent`s.

Node actors outlive a master that dies when `dlrover submit --platform ray --ray-address`
supervises it: the supervisor, a Ray driver itself, starts a job anchor actor (`JobAnchor`,
named in a namespace of the run's own) and the master creates every node actor through it.
Those actors are named (`node-<id>`), owned by the anchor, so they share its fate, not the
master's: a restarted master finds them by name (checking the actor id in its handle) and
watches them again, and when the supervisor goes (even SIGKILLed) Ray ends the anchor and
with it every node actor. A master without an anchor owns its actors itself (they end with it).

Processes never outlive their actor: the command runs under a small guard process
(`python -m master.platform.ray_platform FD -- COMMAND...`) whose sentinel holds the read end
of a pipe whose write end only the actor holds. When the actor's process goes away for any
reason (ray.kill, a crash, its Ray node or the master's job ending), the pipe reaches
end-of-file and the sentinel SIGKILLs the whole process group.

`ray` is imported lazily, so this module (and the guard) load without it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from master.platform.api import NodeEvent, NodeLaunchSpec, Platform, PlatformError
from master.platform.lifeline_guard import EXIT_CANNOT_RUN, GUARD_MODULE
from master.platform.local import free_port, kill_process_group, read_tail, spawn_logged

log = logging.getLogger(__name__)

# A node that asks for no CPU still takes a sliver of one, so many fit on a small cluster.
MIN_NODE_CPU = 0.01
MIB = 1024 * 1024
# One ray.wait blocks this long before the watcher picks up newly launched nodes.
WATCH_TICK_SECONDS = 0.2
# How long a signal to a node may wait for its actor (it may still be starting).
SIGNAL_TIMEOUT_SECONDS = 10.0
# After SIGKILL, how long to wait for a process to be reaped before giving up on it.
KILL_WAIT_SECONDS = 5.0
# How long the cluster address may take to accept a TCP connection.
CONNECT_TIMEOUT_SECONDS = 10.0
# The list of alive Ray nodes is cached this long.
NODE_CACHE_SECONDS = 2.0
# A local raylet that never registers (seen once in CI under load) gets a fresh try.
LOCAL_START_ATTEMPTS = 3
# wait() occupies one actor thread for the node's lifetime; signal() needs another.
ACTOR_MAX_CONCURRENCY = 4
# The job anchor's name in the run's namespace, and its concurrent calls (launches).
ANCHOR_NAME = "dlrover-job-anchor"
ANCHOR_MAX_CONCURRENCY = 16
MASTER_ACTOR_NAME = "dlrover-master"
# After the job ends, the master actor keeps its exit code this long for `dlrover submit`
# (which kills it once read), then ends itself, so a detached run leaves no actor behind.
MASTER_LINGER_SECONDS = 300.0

# Ray 2.60 turns token authentication on for a cluster ray.init starts; a cluster that only
# this master uses, on loopback, needs none.
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# On Linux Ray replaces a loopback node address with the machine's external IP; this switch
# (meant for laptops) makes a local cluster advertise and bind 127.0.0.1 only. Ray reads it
# once, when `ray` is first imported.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


# -- inside the Ray actor ------------------------------------------------------------------


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
        # The actor keeps the write end for its whole life; see the module docstring.
        read_fd, self._lifeline = os.pipe()
        env = {**_ray_node_env(), **spec.env}
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
        finally:
            os.close(read_fd)

    def wait(self) -> tuple[int, str]:
        """Block until the command ends: its exit code, and its log tail if it failed."""
        if self._proc is None:
            return EXIT_CANNOT_RUN, self._error
        code = self._proc.wait()
        # Anything the node left behind in its group goes with it.
        kill_process_group(self._proc.pid, signal.SIGKILL)
        return code, read_tail(self.spec.log_path) if code != 0 else ""

    def signal(self, sig: int) -> bool:
        """Signal the node's whole process group; False if it has ended."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        return kill_process_group(self._proc.pid, sig)


class JobAnchor:
    """Creates and holds the node actors of one run, so that they outlive its master.

    Owned by the `dlrover submit` supervisor's Ray driver: when that driver goes, Ray ends the
    anchor and every actor it owns.
    """

    def __init__(self) -> None:
        import ray

        self._ray = ray
        self._actor_class = ray.remote(NodeActor)
        self._actors: dict[int, Any] = {}

    def ping(self) -> bool:
        return True

    def launch(self, spec: NodeLaunchSpec, ray_node: str, options: dict[str, Any]) -> Any:
        """Start a node actor named node-<id> with `options`; its handle."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = dict(options)
        node_id = options.pop("node_id")
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        actor = self._actor_class.options(name=node_actor_name(spec.id), **options).remote(
            spec, ray_node
        )
        self._actors[spec.id] = actor
        return actor

    def release(self, node_id: int) -> None:
        """The master is done with this node (it ended and was reported)."""
        actor = self._actors.pop(node_id, None)
        if actor is not None:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass


class MasterActor:
    """The job's master as a detached Ray actor that Ray restarts (`max_restarts`).

    It runs `dlrover master ... --resume-if-started` as a child process (SIGKILLed if this
    actor's process dies), log appended to `log_path`. When the child ends with the job
    still running in the state store (it was killed, or crashed), this actor exits its process
    so that Ray restarts it; the new instance starts a master that resumes the job and adopts
    the node actors, which a detached job anchor keeps alive meanwhile. When the job has ended,
    the anchor is killed (and with it any node actor left) and `wait()` returns the exit code.
    """

    def __init__(
        self, argv: list[str], state: str, state_job: str, namespace: str, log_path: str
    ) -> None:
        import ray

        self._ray = ray
        self._state, self._state_job, self._namespace = state, state_job, namespace
        self._done = threading.Event()
        self._code: int | None = None
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        keep = (AUTH_MODE_ENV, LOOPBACK_ENV)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k in keep}
        guard = [sys.executable, "-m", "master.platform.pdeathsig", str(os.getpid()), "--"]
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        with open(log_path, "ab", buffering=0) as logf:
            logf.write(f"# master actor pid {os.getpid()} restarted={self.restarted}\n".encode())
            self._proc = subprocess.Popen(
                [*guard, sys.executable, "-m", "master.cli", "master", *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
            )
        threading.Thread(target=self._watch, name="master-child", daemon=True).start()

    def _watch(self) -> None:
        code = self._proc.wait()
        from master.state.job_record import recorded_job_state

        try:
            state = recorded_job_state(self._state, self._state_job)
        except Exception as e:  # the state cannot be read: let Ray try again
            log.error("master actor: cannot read the job's state: %s", e)
            state = "running"
        if state == "running":
            log.error("master exited with %d while the job runs; Ray restarts this actor", code)
            os._exit(1)
        try:
            self._ray.kill(self._ray.get_actor(ANCHOR_NAME, namespace=self._namespace))
        except Exception as e:  # already gone
            log.debug("job anchor: %s", e)
        self._code = code if code >= 0 else 1
        self._done.set()
        timer = threading.Timer(MASTER_LINGER_SECONDS, self._end_self)
        timer.daemon = True
        timer.start()

    def _end_self(self) -> None:
        try:
            me = self._ray.get_runtime_context().current_actor
            self._ray.kill(me, no_restart=True)
        except Exception as e:
            log.debug("master actor: ending itself: %s", e)

    def was_restarted(self) -> bool:
        return self.restarted

    def wait(self, timeout: float) -> int | None:
        """The master's exit code once the job has ended; None while it runs."""
        self._done.wait(timeout)
        return self._code

    def stop(self) -> None:
        """Ask the master to stop the job (as Ctrl-C would)."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)


def start_master_actor(
    address: str,
    namespace: str,
    argv: list[str],
    state: str,
    state_job: str,
    log_path: str,
    max_restarts: int,
) -> Any:
    """From `dlrover submit`: a detached job anchor and the detached, restartable master actor,
    both pinned to this machine's Ray node (the run dir and the master's port are here)."""
    ray = _connect(address, namespace)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    anchor = (
        ray.remote(JobAnchor)
        .options(
            name=ANCHOR_NAME,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=ANCHOR_MAX_CONCURRENCY,
            scheduling_strategy=here,
        )
        .remote()
    )
    ray.get(anchor.ping.remote(), timeout=120)
    master = (
        ray.remote(MasterActor)
        .options(
            name=MASTER_ACTOR_NAME,
            lifetime="detached",
            num_cpus=0,
            max_restarts=max_restarts,
            max_concurrency=4,
            scheduling_strategy=here,
        )
        .remote(argv, state, state_job, namespace, log_path)
    )
    return master


def _connect(address: str, namespace: str) -> Any:
    """This process joins the Ray cluster at `address` (`--ray-address`) in `namespace`."""
    ray = _import_ray(loopback=_is_loopback(address.rsplit(":", 1)[0]))
    try:
        _check_reachable(address)
        ray.init(
            address=address,
            namespace=namespace,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    except (OSError, RuntimeError, ValueError) as e:
        raise PlatformError(
            f"cannot connect to the Ray cluster at {address!r} (--ray-address): {e}; "
            "start one with `ray start --head` or leave --ray-address out"
        ) from e
    return ray


def node_actor_name(node_id: int) -> str:
    return f"node-{node_id}"


def start_job_anchor(address: str, namespace: str) -> Any:
    """Connect this process (the supervisor) to Ray and start the run's job anchor in it.

    The anchor lives as long as this process's Ray connection does.
    """
    ray = _connect(address, namespace)
    anchor = (
        ray.remote(JobAnchor)
        .options(name=ANCHOR_NAME, num_cpus=0, max_concurrency=ANCHOR_MAX_CONCURRENCY)
        .remote()
    )
    ray.get(anchor.ping.remote(), timeout=120)
    return anchor


def _ray_node_env() -> dict[str, str]:
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


# -- in the master -------------------------------------------------------------------------


@dataclass(frozen=True)
class _RayNode:
    node_id: str
    ip: str
    cpu: float


@dataclass(frozen=True)
class _Slot:
    """Where a (type, rank) runs: the Ray node it is pinned to, and its port there."""

    node: _RayNode
    port: int

    @property
    def address(self) -> str:
        return f"{self.node.ip}:{self.port}"


@dataclass
class _Running:
    spec: NodeLaunchSpec
    node: _RayNode
    actor: Any
    ref: Any
    actor_name: str = ""  # named actors (through the job anchor): found again by name


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_reachable(address: str) -> None:
    """Raise OSError when a host:port address accepts no TCP connection."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto" and other forms Ray resolves itself
    with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_SECONDS):
        pass


def _import_ray(loopback: bool) -> Any:
    """Import ray, first setting what Ray reads at import time for a loopback cluster."""
    if loopback:
        if "ray" in sys.modules and os.environ.get(LOOPBACK_ENV) != "0":
            log.warning(
                "ray was imported before the Ray platform set %s=0; a local cluster may "
                "advertise the machine's external address instead of loopback",
                LOOPBACK_ENV,
            )
        os.environ[LOOPBACK_ENV] = "0"
    import ray

    return ray


def start_local_cluster(num_cpus: int | None = None) -> str:
    """Start a Ray cluster on loopback, auth off, dashboard off, connected to this process.

    Returns its address (for `--ray-address`). The caller ends it with `ray.shutdown()`.
    """
    os.environ.setdefault(AUTH_MODE_ENV, "disabled")
    ray = _import_ray(loopback=True)
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            ctx = ray.init(
                address="local",
                num_cpus=num_cpus if num_cpus is not None else os.cpu_count(),
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
            return ctx.address_info["gcs_address"]
        except Exception as e:  # Ray raises a bare Exception when its raylet never comes up
            ray.shutdown()
            if attempt == LOCAL_START_ATTEMPTS:
                raise PlatformError(
                    f"the local Ray cluster did not start after {attempt} attempts: {e}; "
                    "see the raylet logs under /tmp/ray/session_latest/logs"
                ) from e
            log.warning("local Ray cluster failed to start (%s); trying again", e)
    raise AssertionError("unreachable")


class RayPlatform(Platform):
    """Runs nodes as Ray actors, each pinned to one Ray node per (type, rank).

    With no address it starts a local cluster on loopback (and shuts it down at the end);
    with an address it connects to that cluster; if this process is already connected to
    Ray it uses that connection. `host` is the address the master advertises to nodes: on a
    multi-host cluster it must not be loopback.
    """

    def __init__(self, host: str = "127.0.0.1", address: str = "", namespace: str = "") -> None:
        super().__init__()
        self.host = host
        self.address = address
        self.namespace = namespace  # the run's Ray namespace, where its job anchor is
        already = "ray" in sys.modules and sys.modules["ray"].is_initialized()
        ray_host = address.rsplit(":", 1)[0] if address else "127.0.0.1"
        self._ray = ray = _import_ray(loopback=not already and _is_loopback(ray_host))
        self._owns_connection = not already
        if already:
            log.info("using this process's existing Ray connection")
        elif address:
            try:
                # ray.init retries an unreachable GCS for minutes; fail fast instead.
                _check_reachable(address)
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            except (OSError, RuntimeError, ValueError) as e:
                raise PlatformError(
                    f"cannot connect to the Ray cluster at {address!r} (--ray-address): {e}; "
                    "start one with `ray start --head` or leave --ray-address out"
                ) from e
        else:
            start_local_cluster()
        from ray.exceptions import GetTimeoutError, RayActorError, RayError
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._RayError, self._RayActorError = RayError, RayActorError
        self._GetTimeoutError = GetTimeoutError
        self._affinity = NodeAffinitySchedulingStrategy
        self._actor_class = ray.remote(NodeActor)
        self._port_task = ray.remote(num_cpus=0)(free_port)
        self._my_node = ray.get_runtime_context().get_node_id()
        self._anchor: Any = None
        if namespace:
            try:
                self._anchor = ray.get_actor(ANCHOR_NAME, namespace=namespace)
            except ValueError:
                raise PlatformError(
                    f"no job anchor in Ray namespace {namespace!r}: the `dlrover submit` that "
                    "supervises this master is gone (or --ray-namespace is wrong)"
                ) from None

        self._lock = threading.Lock()
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._running: dict[int, _Running] = {}
        self._nodes: list[_RayNode] = []
        self._nodes_at = -1e9
        self._warned_host = False
        self._closed = False
        self._wake = threading.Event()
        self._stop_watch = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="ray-watcher", daemon=True)
        self._watcher.start()

    # -- addresses ---------------------------------------------------------------------------

    def address_for(self, node_type: str, rank: int) -> str:
        with self._lock:
            return self._slot(node_type, rank, check_alive=True).address

    def _slot(self, node_type: str, rank: int, check_alive: bool) -> _Slot:
        key = (node_type, rank)
        slot = self._slots.get(key)
        alive = {n.node_id for n in self._alive_nodes()} if slot and check_alive else set()
        if slot is not None and check_alive and slot.node.node_id not in alive:
            log.warning(
                "%s-%d: its Ray node %s is gone; moving it (its address changes)",
                node_type,
                rank,
                slot.node.ip,
            )
            slot = None
        if slot is None:
            node = self._choose_node()
            slot = _Slot(node, self._allocate_port(node))
            self._slots[key] = slot
        return slot

    def _alive_nodes(self, refresh: bool = False) -> list[_RayNode]:
        now = time.monotonic()
        if refresh or now - self._nodes_at > NODE_CACHE_SECONDS:
            self._nodes = [
                _RayNode(n["NodeID"], n["NodeManagerAddress"], float(n["Resources"].get("CPU", 0)))
                for n in self._ray.nodes()
                if n.get("Alive")
            ]
            self._nodes_at = now
        return self._nodes

    def _choose_node(self) -> _RayNode:
        """The alive Ray node with the fewest pinned nodes per CPU (spreads over the cluster)."""
        nodes = [n for n in self._alive_nodes(refresh=True) if n.cpu > 0]
        if not nodes:
            raise PlatformError("the Ray cluster has no alive node with CPUs")
        pinned = Counter(s.node.node_id for s in self._slots.values())
        node = min(nodes, key=lambda n: (pinned[n.node_id] / n.cpu, -n.cpu))
        if node.node_id != self._my_node and _is_loopback(self.host) and not self._warned_host:
            self._warned_host = True
            log.warning(
                "nodes run on Ray node %s but the master advertises %s, which they cannot "
                "reach; run the master with --host 0.0.0.0",
                node.ip,
                self.host,
            )
        return node

    def _allocate_port(self, node: _RayNode) -> int:
        """A port free on `node` now and not given to another (type, rank) there."""
        taken = {s.port for s in self._slots.values() if s.node.ip == node.ip}
        while True:
            if node.node_id == self._my_node:
                port = free_port(node.ip)
            else:
                task = self._port_task.options(
                    scheduling_strategy=self._affinity(node.node_id, False)
                )
                port = self._ray.get(task.remote(node.ip), timeout=60)
            if port not in taken:
                return port

    # -- launching and signalling -----------------------------------------------------------

    def launch(self, spec: NodeLaunchSpec) -> None:
        if self._closed:
            raise RuntimeError("the Ray platform is shut down")
        with self._lock:
            node = self._slot(spec.type, spec.rank, check_alive=False).node
        options: dict[str, Any] = {
            "num_cpus": spec.cpu if spec.cpu > 0 else MIN_NODE_CPU,
            "scheduling_strategy": self._affinity(node.node_id, soft=False),
            "max_restarts": 0,
            "max_concurrency": ACTOR_MAX_CONCURRENCY,
        }
        if spec.memory_mb > 0:
            options["memory"] = spec.memory_mb * MIB
        name = ""
        if self._anchor is not None:
            del options["scheduling_strategy"]
            options["node_id"] = node.node_id
            actor = self._ray.get(self._anchor.launch.remote(spec, node.ip, options), timeout=120)
            name = node_actor_name(spec.id)
        else:
            actor = self._actor_class.options(**options).remote(spec, node.ip)
        run = _Running(spec=spec, node=node, actor=actor, ref=actor.wait.remote(), actor_name=name)
        with self._lock:
            self._running[spec.id] = run
        self._wake.set()
        log.info(
            "launched %s-%d id=%d as a Ray actor on %s", spec.type, spec.rank, spec.id, node.ip
        )

    def signal_node(self, node_id: int, sig: int = signal.SIGKILL) -> bool:
        with self._lock:
            run = self._running.get(node_id)
        return run is not None and self._signal(run, sig)

    def _signal(self, run: _Running, sig: int) -> bool:
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
        except self._RayError:
            return False  # the actor is dead; the watcher reports it

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
            if self._signal(run, signal.SIGTERM):
                ready, _ = ray.wait([run.ref], timeout=grace_seconds)
                if not ready and self._signal(run, signal.SIGKILL):
                    ray.wait([run.ref], timeout=KILL_WAIT_SECONDS)
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
            by_ip = {n.ip: n for n in self._alive_nodes(refresh=True)}
            for key, addr in addresses.items():
                ip, _, port = addr.rpartition(":")
                node = by_ip.get(ip)
                if node is None:
                    log.warning(
                        "%s-%d: its Ray node %s is gone; it moves when relaunched", *key, ip
                    )
                    continue
                self._slots[key] = _Slot(node, int(port))

    def adopt(self, spec: NodeLaunchSpec, handle: dict[str, Any]) -> None:
        """Watch a node actor a previous master started; an end it missed is reported now."""
        if self._anchor is None:
            raise PlatformError(self._no_anchor())
        name = str(handle.get("actor") or node_actor_name(spec.id))
        namespace = str(handle.get("namespace") or self.namespace)
        with self._lock:
            slot = self._slots.get((spec.type, spec.rank))
        node = slot.node if slot else _RayNode("", "?", 0.0)
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
                by_ref = {run.ref: run for run in self._running.values()}
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
                self._finish(by_ref[ref])

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
        try:
            code, tail = self._ray.get(run.ref, timeout=KILL_WAIT_SECONDS)
            return NodeEvent(spec.type, spec.rank, spec.id, exit_code=int(code), message=tail)
        except Exception as e:  # a dead actor (RayError), or Ray itself gone
            text = " ".join(str(e).split())
            lowered = text.lower()
            if "its node has died" in lowered or "node is dead" in lowered:
                what = "its Ray node died"
            elif type(e).__name__ == "ActorUnschedulableError":
                asked = f"{spec.cpu if spec.cpu > 0 else MIN_NODE_CPU:g} CPU" + (
                    f", {spec.memory_mb} MB memory" if spec.memory_mb > 0 else ""
                )
                what = (
                    f"cannot run on Ray node {run.node.ip}, which is gone or has less than the "
                    f"{asked} it asks for"
                )
            elif isinstance(e, self._RayActorError):
                what = "its Ray actor died"
            else:
                what = f"its Ray actor failed ({type(e).__name__})"
            message = f"{_name(spec)} id={spec.id}: {what}: {text[:600]}"
            return NodeEvent(
                spec.type,
                spec.rank,
                spec.id,
                exit_code=-signal.SIGKILL,
                oom_killed="low on memory" in lowered or "memory pressure" in lowered,
                message=message,
                details={"ray_error": type(e).__name__},
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
