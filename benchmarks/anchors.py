"""The anchors environment: DLRover 0.6.1 in its own venv (``make anchors`` builds ``.anchors/``).

Benchmarks run the reference system beside ours in the same run when this environment exists,
and say so when it does not; no figure of another system is ever written into a benchmark.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from common import ROOT

ANCHORS = os.environ.get("DLROVER_ANCHORS", os.path.join(ROOT, ".anchors"))
DLROVER_VERSION = "0.6.1"
MISSING = f"no anchors environment at {ANCHORS} (make anchors builds it): DLRover not measured"


def python() -> str | None:
    """The anchors' interpreter when DLRover is installed there, else None."""
    exe = os.path.join(ANCHORS, "bin", "python")
    if not os.path.exists(exe):
        return None
    found = subprocess.run(
        [exe, "-c", "import importlib.metadata as m; print(m.version('dlrover'))"],
        capture_output=True,
        text=True,
    )
    return exe if found.returncode == 0 and found.stdout.strip() == DLROVER_VERSION else None


def bin_path(name: str) -> str:
    """A console script of the anchors environment (e.g. dlrover-run)."""
    return os.path.join(ANCHORS, "bin", name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DLRoverMaster:
    """DLRover's local job master, started by hand: 0.6.1's ``dlrover-run --standalone`` builds
    its master with a torch API that torch 2.13 changed (SubprocessHandler's numa_options)."""

    def __init__(self, job: str, log_path: str, nodes: int = 1) -> None:
        exe = python()
        if exe is None:
            raise RuntimeError(MISSING)
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [exe, "-u", "-m", "dlrover.python.master.main", "--port", str(self.port)]
                + ["--node_num", str(nodes), "--job_name", job, "--platform", "local"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"DLRover's master did not start; see {log_path}")

    def stop(self) -> None:
        """Stop the master and anything it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
