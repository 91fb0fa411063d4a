"""Worker side of the persist service: connect (or start a standalone service) and send requests."""

from __future__ import annotations

import itertools
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any

from dlrover_torch.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0


class ServiceClient:
    """One connection to a persist service; replies complete the futures of requests."""

    def __init__(self, sock: socket.socket, namespace: str, proc: Any = None) -> None:
        self._sock = sock
        self.namespace = namespace
        self.proc = proc  # the standalone service process, when we started it
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name="ckpt-client", daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, socket_path: str, proc: Any = None) -> ServiceClient:
        """Connect to the service at ``socket_path`` and learn its shm namespace."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(socket_path)
            sock.sendall(b'{"op": "hello"}\n')
            line = _read_line(sock)
        except OSError as exc:
            sock.close()
            raise CheckpointError(
                f"cannot reach the checkpoint service at {socket_path} ({exc}); is the "
                "dlrover-run agent alive? Unset DLROVER_CKPT_SERVICE to run standalone"
            ) from exc
        sock.settimeout(None)
        hello = json.loads(line)
        return cls(sock, str(hello["namespace"]), proc)

    @classmethod
    def spawn(cls, namespace: str, shm_dir: str, orphan_grace_s: float) -> ServiceClient:
        """Start a standalone service process for this training process and connect to it.

        Once this process is gone it also reaps the namespace's ownerless shared memory."""
        cmd = [
            sys.executable,
            "-m",
            "dlrover_torch.checkpoint.service",
            "--namespace",
            namespace,
            "--parent-pid",
            str(os.getpid()),
            "--shm-dir",
            shm_dir,
            "--orphan-grace",
            str(orphan_grace_s),
        ]
        # Own session: a signal to the training job's process group must not cut a persist short.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], CONNECT_TIMEOUT_S)
        word, _, path = (proc.stdout.readline() if ready else b"").strip().partition(b" ")
        if word != b"ready" or not path:
            proc.kill()  # its folder, if it made one, goes with the next service's sweep
            proc.wait()
            raise CheckpointError(
                f"the standalone checkpoint service did not start (exit code {proc.poll()}); "
                "see its log above"
            )
        proc.stdout.close()
        path = os.fsdecode(path)
        client = cls.connect(path, proc)
        log.info("started standalone checkpoint service pid %d", proc.pid)
        return client

    def persist(self, slot_path: str, seq: int) -> Future[dict[str, Any]]:
        """Ask the service to persist ``slot_path`` if it still holds save ``seq``."""
        fut: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._broken:
                fut.set_exception(CheckpointError(self._broken))
                return fut
            rid = next(self._ids)
            self._pending[rid] = fut
        msg = {"op": "persist", "id": rid, "slot": slot_path, "seq": seq}
        try:
            self._sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError as exc:
            self._fail_all(f"lost the checkpoint service: {exc}")
        return fut

    def close(self) -> None:
        """Close the connection (a standalone service then finishes its work and exits)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(timeout=5)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                log.error("checkpoint service pid %d did not exit; killing it", self.proc.pid)
                self.proc.kill()
                self.proc.wait()

    def _read_loop(self) -> None:
        try:
            with self._sock.makefile("rb") as reader:
                for line in reader:
                    msg = json.loads(line)
                    with self._lock:
                        fut = self._pending.pop(msg.get("id"), None)
                    if fut is not None:
                        fut.set_result(msg)
        except (OSError, ValueError) as exc:
            log.debug("checkpoint service connection ended: %s", exc)
        self._fail_all("the checkpoint service connection closed before replying")

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self._broken = self._broken or reason
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(CheckpointError(reason))


def _read_line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise OSError("connection closed during the handshake")
        buf += chunk
    return buf
