"""Local platform: every node is a subprocess in its own process group."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass

from master.client.env import ENV_POSITION_FILE
from master.client.position import collect_positions, encode_positions
from master.platform.api import (
    POSITIONS_DETAIL,
    NodeEvent,
    NodeLaunchSpec,
    Platform,
    PlatformError,
)
from master.platform.lifeline_guard import GUARD_MODULE, read_exit_file
from master.platform.proc_stats import process_groups_cpu_seconds

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 4000


# Ray's workers listen on 10002-19999 by default; picks start above that range.
LISTEN_PICK_LOW = 20000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, picked below the kernel's range for outgoing
    connections: a port from that range can be taken by any connect() before the caller binds it
    (Ray's processes make many while a master starts)."""
    high = _ephemeral_low() - 1
    if high - LISTEN_PICK_LOW >= 1000:
        pick = random.SystemRandom()
        for _ in range(50):
            port = pick.randint(LISTEN_PICK_LOW, high)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux's default 32768)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def spawn_logged(
    spec: NodeLaunchSpec,
    command: list[str],
    env: dict[str, str],
    header: str,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen:
    """Start `command` in a new process group, output appended to the spec's log file.

    The project's root goes on PYTHONPATH so the platforms' wrapper modules (orphan guards)
    are importable from the node's working directory.
    """
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)}
    os.makedirs(os.path.dirname(spec.log_path) or ".", exist_ok=True)
    with open(spec.log_path, "ab", buffering=0) as logf:
        logf.write(
            f"# {spec.type}-{spec.rank} id={spec.id}{header}: {' '.join(spec.command)}\n".encode()
        )
        return subprocess.Popen(
            command,
            cwd=spec.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=pass_fds,
        )


def read_tail(path: str, limit: int = LOG_TAIL_BYTES) -> str:
    """The last `limit` bytes of a log file, for exit messages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class AdoptedProcess:
    """A node process this master did not start (it outlived the previous master instance).

    Its exit is seen through a pidfd; its status comes from the exit file its lifeline guard
    writes (none means the guard itself was SIGKILLed).
    """

    def __init__(self, pid: int, exit_file: str) -> None:
        self.pid = pid
        self.exit_file = exit_file
        self.returncode: int | None = None
        self._pidfd: int | None = None
        # The reaper and a stop's grace wait poll the pidfd at once; it is closed only after
        # the last of them is done with it (a double close could close another thread's fd).
        self._lock = threading.Lock()
        self._waiters = 0
        try:
            if pid > 0:
                self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pass
        if self._pidfd is None:
            self._finish()  # it ended while no master watched it

    def _finish(self) -> None:
        """Record the status once the end is seen (called with the lock held, or alone)."""
        if self.returncode is None:
            code = read_exit_file(self.exit_file)
            self.returncode = code if code is not None else -signal.SIGKILL
        if self._waiters == 0 and self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int:
        """Block until the process ends (subprocess.TimeoutExpired after `timeout`)."""
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            assert self._pidfd is not None
            self._waiters += 1
        ended = False
        try:
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            ended = bool(poller.poll(None if timeout is None else int(timeout * 1000)))
        finally:
            with self._lock:
                self._waiters -= 1
                if ended or self.returncode is not None:
                    # The guard writes its exit file just before it ends; it is there by now.
                    self._finish()
        if self.returncode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        return self.returncode


@dataclass
class _Running:
    spec: NodeLaunchSpec
    proc: subprocess.Popen | AdoptedProcess
    pgid: int
    stop_requested: bool = False


class LocalPlatform(Platform):
    """Runs nodes as local processes; every process group is killed when the platform stops.

    Without a lifeline, processes are started from one long-lived launcher thread, so the
    orphan guard (PR_SET_PDEATHSIG, which fires when the launching *thread* ends) only fires
    when the master itself goes away. With `lifeline_fd` (the read end of a pipe whose write end
    the `dlrover submit` supervisor holds) nodes outlive this master and die with the
    supervisor instead, so a restarted master can adopt them.
    """

    inherits_master_env = True
    runs_ps_standby = True
    enforces_resources = False  # cpu and memory_mb are not applied to local processes

    def __init__(
        self, host: str = "127.0.0.1", orphan_guard: bool = True, lifeline_fd: int | None = None
    ) -> None:
        super().__init__()
        self.host = host
        self.orphan_guard = orphan_guard
        self.lifeline_fd = lifeline_fd
        self._ports: dict[tuple[str, int], int] = {}
        self._running: dict[int, _Running] = {}
        self._pgids: set[int] = set()
        self._lock = threading.Lock()
        self._launch_queue: queue.Queue[tuple[NodeLaunchSpec, Future] | None] = queue.Queue()
        self._launcher = threading.Thread(
            target=self._launch_loop, name="local-launcher", daemon=True
        )
        self._launcher.start()
        self._closed = False

    def address_for(self, node_type: str, rank: int) -> str:
        with self._lock:
            key = (node_type, rank)
            if key not in self._ports:
                port = free_port(self.host)
                while port in self._ports.values():
                    port = free_port(self.host)
                self._ports[key] = port
            return f"{self.host}:{self._ports[key]}"

    def launch(self, spec: NodeLaunchSpec) -> None:
        if self._closed:
            raise RuntimeError("the local platform is shut down")
        done: Future = Future()
        self._launch_queue.put((spec, done))
        done.result()

    def _launch_loop(self) -> None:
        while True:
            item = self._launch_queue.get()
            if item is None:
                return
            spec, done = item
            try:
                self._start(spec)
                done.set_result(None)
            except BaseException as e:  # handed back to the caller of launch()
                done.set_exception(e)

    def _start(self, spec: NodeLaunchSpec) -> None:
        command = list(spec.command)
        pass_fds: tuple[int, ...] = ()
        if self.lifeline_fd is not None:
            exit_file = exit_file_for(spec)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(exit_file)
            guard = [sys.executable, "-m", GUARD_MODULE, str(self.lifeline_fd)]
            command = [*guard, "--exit-file", exit_file, "--", *command]
            pass_fds = (self.lifeline_fd,)
        elif self.orphan_guard and sys.platform.startswith("linux"):
            guard = [sys.executable, "-m", "master.platform.pdeathsig", str(os.getpid()), "--"]
            command = guard + command
        # The node's trainers keep their data position there; read back when the node ends.
        env = {**spec.env, ENV_POSITION_FILE: position_base_for(spec)}
        proc = spawn_logged(spec, command, env, "", pass_fds=pass_fds)
        run = _Running(spec=spec, proc=proc, pgid=proc.pid)
        with self._lock:
            self._running[spec.id] = run
            self._pgids.add(proc.pid)
        log.info("started %s-%d id=%d pid=%d", spec.type, spec.rank, spec.id, proc.pid)
        threading.Thread(
            target=self._reap, args=(run,), name=f"reap-{spec.id}", daemon=True
        ).start()

    def _reap(self, run: _Running) -> None:
        code = run.proc.wait()
        ended_at = time.time()
        # Anything the node left behind in its group goes with it.
        if run.pgid:
            kill_process_group(run.pgid, signal.SIGKILL)
        with self._lock:
            self._running.pop(run.spec.id, None)
        tail = read_tail(run.spec.log_path) if code != 0 else ""
        positions = collect_positions(position_base_for(run.spec))
        self.events.put(
            NodeEvent(
                type=run.spec.type,
                rank=run.spec.rank,
                id=run.spec.id,
                exit_code=code,
                message=tail,
                details={
                    "ended_at": repr(ended_at),
                    **({POSITIONS_DETAIL: encode_positions(positions)} if positions else {}),
                },
            )
        )

    def read_positions(self, node_id: int) -> dict[str, list[tuple[int, int]]]:
        """The node's position files as they are now (left in place for its end)."""
        with self._lock:
            run = self._running.get(node_id)
        return {} if run is None else collect_positions(position_base_for(run.spec), remove=False)

    def cpu_seconds(self, node_ids: Collection[int]) -> dict[int, float]:
        """CPU seconds of each node's process group (see master.platform.proc_stats)."""
        with self._lock:
            pgids = {i: r.pgid for i in node_ids if (r := self._running.get(i)) and r.pgid}
        used = process_groups_cpu_seconds(pgids.values())
        return {i: used[pgid] for i, pgid in pgids.items() if pgid in used}

    def handle(self, node_id: int) -> dict[str, int]:
        """What a later master needs to adopt the node: the pid of its process-group leader."""
        with self._lock:
            run = self._running.get(node_id)
        return {"pid": run.pgid} if run is not None else {}

    def adopt(self, spec: NodeLaunchSpec, handle: dict[str, int]) -> None:
        """Watch a node started by a previous master; its end arrives as a NodeEvent."""
        if self.lifeline_fd is None:
            raise PlatformError(
                "the local platform adopts nodes only when supervised (dlrover submit); "
                "this master was started without a lifeline"
            )
        pid = int(handle.get("pid", 0))
        exit_file = exit_file_for(spec)
        if pid <= 0 or not _is_guard_of(pid, exit_file):
            pid = 0  # gone, or the pid now belongs to another process
        proc = AdoptedProcess(pid, exit_file)
        run = _Running(spec=spec, proc=proc, pgid=pid)
        with self._lock:
            if pid:
                self._running[spec.id] = run
                self._pgids.add(pid)
        log.info("adopted %s-%d id=%d pid=%d", spec.type, spec.rank, spec.id, pid)
        threading.Thread(
            target=self._reap, args=(run,), name=f"reap-{spec.id}", daemon=True
        ).start()

    def restore_addresses(self, addresses: dict[tuple[str, int], str]) -> None:
        """Reuse the addresses a previous master gave out: running nodes know them."""
        with self._lock:
            for key, addr in addresses.items():
                self._ports[key] = int(addr.rsplit(":", 1)[1])

    def signal_node(self, node_id: int, sig: int = signal.SIGKILL) -> bool:
        with self._lock:
            run = self._running.get(node_id)
        if run is None:
            return False
        return kill_process_group(run.pgid, sig)

    def stop_node(self, node_id: int, grace_seconds: float) -> None:
        with self._lock:
            run = self._running.get(node_id)
        if run is None:
            return
        run.stop_requested = True
        kill_process_group(run.pgid, signal.SIGTERM)
        threading.Thread(target=self._kill_after, args=(run, grace_seconds), daemon=True).start()

    def _kill_after(self, run: _Running, grace_seconds: float) -> None:
        try:
            run.proc.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            kill_process_group(run.pgid, signal.SIGKILL)

    def shutdown(self, grace_seconds: float = 5.0) -> None:
        """SIGTERM every group, SIGKILL what is left after the grace period."""
        self._closed = True
        with self._lock:
            runs = list(self._running.values())
            pgids = set(self._pgids)
        for run in runs:
            kill_process_group(run.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for run in runs:
            try:
                run.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pgid in pgids:
            kill_process_group(pgid, signal.SIGKILL)
        for run in runs:
            try:
                run.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("process %d did not die after SIGKILL", run.proc.pid)
        self._launch_queue.put(None)


def position_base_for(spec: NodeLaunchSpec) -> str:
    """Where a node's trainers record their data position at every step (per incarnation)."""
    return spec.log_path + ".position"


def exit_file_for(spec: NodeLaunchSpec) -> str:
    """Where a supervised node's guard records its exit status."""
    return spec.log_path + ".exit"


def _is_guard_of(pid: int, exit_file: str) -> bool:
    """Whether pid is still the lifeline guard writing `exit_file` (pids get reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return GUARD_MODULE.encode() in argv and exit_file.encode() in argv


def kill_process_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; False if it is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("no permission to signal process group %d", pgid)
        return False
