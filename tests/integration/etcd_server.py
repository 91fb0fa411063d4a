"""A real single-member etcd on loopback for tests: free ports, its own data dir, killed after."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

logger = logging.getLogger(__name__)

START_DEADLINE_SECONDS = 30.0  # a cold start on a busy 2-core machine
_START_ATTEMPTS = 3  # a free port can be taken by another process before etcd binds it


def etcd_binary() -> str:
    """The etcd binary; skips outside CI when it is absent, fails in CI (CI=true)."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else "")
    if path:
        return path
    message = "etcd is not installed: `apt-get install -y etcd-server` (.ci/run does it)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd process; stop() and start() again reuse the same data dir and ports."""

    def __init__(self, binary: str, data_dir: Path) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.client_port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_endpoint(self) -> str:
        return f"127.0.0.1:{self.peer_port}"

    def start(self) -> None:
        """Start etcd (on new free ports the first time) and wait until it serves clients."""
        fresh = self.client_port == 0
        for attempt in range(_START_ATTEMPTS):
            if fresh:
                self.client_port, self.peer_port = free_port(), free_port()
            if self._launch():
                return
            if not fresh or attempt == _START_ATTEMPTS - 1:
                break
        raise RuntimeError(f"etcd did not start; its log:\n{self.log_path.read_text()[-3000:]}")

    def _launch(self) -> bool:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_DEADLINE_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                logger.warning("etcd exited with %s while starting", self.proc.returncode)
                self.proc = None
                return False
            if self._healthy(client):
                return True
            time.sleep(0.05)
        self.kill()
        return False

    @staticmethod
    def _healthy(client: str) -> bool:
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the process (SIGKILL by default: nothing is flushed at exit) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
        self.proc = None
