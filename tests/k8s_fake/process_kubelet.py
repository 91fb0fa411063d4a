"""A kubelet that runs each node pod's container as a local process, on named fake nodes.

`ProcessKubelet` schedules every new node pod on the Ready fake node with the fewest pods, runs
its container's command with the pod's env (the master's service resolved to loopback, the
token secret mounted as a file), marks it Running, and reports the container's own exit. A
graceful deletion is SIGTERM, then SIGKILL after the pod's grace period; the pod is removed
once its process ended. A node can be lost (`lose_node`): its processes are frozen (nothing
they do reaches anyone), its pods marked not Ready and some deleted by the taint manager;
`resume_node` lets them run on (their network is back) and `node_back` is its kubelet
returning, which kills every process whose pod no longer exists. `placement` pins pods to a
node by name; `program` swaps a command for another (a fake of a heavy program).
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.k8s_fake.store import CORE, ApiError, ObjectStore

NODE_SELECTOR = "dlrover.io/role=node"
MASTER_SERVICE_SUFFIX = ".svc"
LOG_TAIL_BYTES = 2048  # terminationMessagePolicy FallbackToLogsOnError keeps this much


@dataclass(eq=False)
class PodProcess:
    """One pod's container, run as a local process group on a fake node."""

    pod: str
    uid: str
    node: str
    proc: subprocess.Popen
    log_path: str
    node_type: str = ""
    deleting: bool = False
    ended: threading.Event = field(default_factory=threading.Event)


class ProcessKubelet:
    """Runs node pods as local processes on `nodes` (fake node names)."""

    def __init__(self, api: Any, workdir: str, nodes: tuple[str, ...]) -> None:
        self.api = api
        self.store: ObjectStore = api.store
        self.namespace = api.namespace
        self.workdir = workdir
        self.nodes = list(nodes)
        self.lost: set[str] = set()
        self.placement: dict[str, str] = {}  # pod name prefix -> the node it must go to
        # The program the "image" runs for a container's command (e.g. a fake for a real one).
        self.program: Callable[[list[str]], list[str]] = list
        self.processes: list[PodProcess] = []
        self._lock = threading.Lock()
        # Deletions are this kubelet's to finish (the store's own timer would fake the exit).
        self.store.kubelet_delay = 3600.0
        self._watch = self.store.open_watch(CORE, "pods", self.namespace, NODE_SELECTOR, None, None)
        self._watch.initial = []
        self._thread = threading.Thread(target=self._loop, name="process-kubelet", daemon=True)
        self._thread.start()

    # -- the test's side -------------------------------------------------------------

    def on_node(self, node: str) -> list[PodProcess]:
        with self._lock:
            return [p for p in self.processes if p.node == node]

    def running(self, pod: str) -> PodProcess | None:
        with self._lock:
            return next((p for p in self.processes if p.pod == pod), None)

    def lose_node(self, node: str, deleted: tuple[str, ...] = ()) -> list[str]:
        """The node stops answering: its processes freeze, the node controller marks its pods
        not Ready, and the taint manager deletes those named in `deleted` (no kubelet ever
        confirms); the others wait for their tolerationSeconds. The names of its pods."""
        with self._lock:
            self.lost.add(node)
        for p in self.on_node(node):
            _signal_group(p.proc, signal.SIGSTOP)
        names = self.api.kubelet.node_not_ready(node)
        for name in deleted:
            self.api.kubelet.node_lost(name)
        return names

    def freeze(self, p: PodProcess, frozen: bool = True) -> None:
        """Pause the pod's processes (SIGSTOP), or let them go on (SIGCONT)."""
        _signal_group(p.proc, signal.SIGSTOP if frozen else signal.SIGCONT)

    def resume_node(self, node: str) -> None:
        """The lost node's network is back: its processes run on (their kubelet still away)."""
        for p in self.on_node(node):
            _signal_group(p.proc, signal.SIGCONT)

    def node_back(self, node: str) -> None:
        """The node's kubelet returns: processes of pods that no longer exist are killed."""
        with self._lock:
            self.lost.discard(node)
        existing = {p["metadata"]["uid"] for p in self.api.pods(NODE_SELECTOR)}
        for p in self.on_node(node):
            _signal_group(p.proc, signal.SIGCONT)
            if p.uid not in existing:
                _signal_group(p.proc, signal.SIGKILL)
        self.api.kubelet.node_ready(node)

    def close(self) -> None:
        self._watch.dropped = True
        self.store.close_watch(self._watch)
        with self._lock:
            procs = list(self.processes)
        for p in procs:
            _signal_group(p.proc, signal.SIGCONT)
            _signal_group(p.proc, signal.SIGKILL)
        for p in procs:
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._thread.join(timeout=5)

    # -- the kubelet's side -----------------------------------------------------------

    def _loop(self) -> None:
        while not self._watch.dropped:
            for kind, pod in self.store.next_changes(self._watch, 0.2):
                try:
                    self._on_change(kind, pod)
                except ApiError:
                    pass  # the pod changed meanwhile; a later change says what to do

    def _on_change(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if kind == "ADDED" and not pod["spec"].get("nodeName"):
            self._start(pod)
            return
        p = self._process_of(meta["uid"])
        if p is None or p.node in self.lost:
            return  # nobody on a lost node hears of it
        if kind == "DELETED":
            _signal_group(p.proc, signal.SIGKILL)  # force-deleted: no grace
        elif meta.get("deletionTimestamp") and not p.deleting:
            p.deleting = True
            p.proc.send_signal(signal.SIGTERM)  # to the container's first process
            grace = float(meta.get("deletionGracePeriodSeconds") or 0)
            timer = threading.Timer(grace, _signal_group, (p.proc, signal.SIGKILL))
            timer.daemon = True
            timer.start()

    def _process_of(self, uid: str) -> PodProcess | None:
        with self._lock:
            return next((p for p in self.processes if p.uid == uid), None)

    def _pick_node(self, pod: str) -> str:
        with self._lock:
            for prefix, node in self.placement.items():
                if pod.startswith(prefix) and node not in self.lost:
                    return node
            load = {n: 0 for n in self.nodes if n not in self.lost}
            for p in self.processes:
                if p.node in load and not p.ended.is_set():
                    load[p.node] += 1
        return min(load, key=lambda n: (load[n], n))

    def _start(self, pod: dict[str, Any]) -> None:
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        container = pod["spec"]["containers"][-1]
        node = self._pick_node(name)
        log_path = os.path.join(self.workdir, f"{name}.log")
        env = self._env(pod, container)
        cwd = container.get("workingDir") or self.workdir
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                self.program(container["command"]),
                env=env,
                cwd=cwd if os.path.isdir(cwd) else self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # one process group per container
            )
        p = PodProcess(name, uid, node, proc, log_path, env.get("DLROVER_NODE_TYPE", ""))
        with self._lock:
            self.processes.append(p)
        self.api.kubelet.run(name, node=node)
        threading.Thread(target=self._wait, args=(p,), daemon=True).start()

    def _env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        """The image's env (this machine's, with the venv first on PATH), then the pod's, with
        the master's service resolved to loopback and the token secret mounted here."""
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = root
        env.pop("KUBERNETES_SERVICE_HOST", None)
        for e in container.get("env") or []:
            env[e["name"]] = e.get("value", "")
        host, _, port = env.get("DLROVER_MASTER_ADDR", "").rpartition(":")
        if MASTER_SERVICE_SUFFIX in host:
            env["DLROVER_MASTER_ADDR"] = f"127.0.0.1:{port}"
        for volume in pod["spec"].get("volumes") or []:
            secret = (volume.get("secret") or {}).get("secretName")
            if secret and env.get("DLROVER_JOB_TOKEN_FILE"):
                data = self.store.get(CORE, "secrets", self.namespace, secret)["data"]
                path = os.path.join(self.workdir, f"{pod['metadata']['name']}.token")
                with open(path, "wb") as f:
                    f.write(base64.b64decode(data["token"]))
                env["DLROVER_JOB_TOKEN_FILE"] = path
        return env

    def _wait(self, p: PodProcess) -> None:
        code = p.proc.wait()
        p.ended.set()
        if p.node in self.lost:
            return  # its node is away: nobody reports the end
        if code < 0:
            code = 128 - code  # as container runtimes report a signal
        try:
            if code == 0:
                self.api.kubelet.exit(p.pod, 0)
            else:
                self.api.kubelet.exit(p.pod, code, message=_tail(p.log_path))
            if p.deleting:
                self.store.delete(CORE, "pods", self.namespace, p.pod)  # terminal: removed
        except ApiError:
            pass  # force-deleted meanwhile


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the container's process group while its leader is not reaped (so its id cannot
    belong to another process group yet)."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
