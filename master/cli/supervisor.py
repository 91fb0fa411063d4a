"""`dlrover submit` on the local platform: run the master as a child and restart it if it dies.

The supervisor holds the write end of a lifeline pipe that every node's guard watches, so
nodes outlive a crashed master (a restarted one adopts them) but never the supervisor. It is
also a child subreaper: nodes whose master died are re-parented here and reaped here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import TextIO

from master.cli.run_layout import STATE_FILE

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
DEFAULT_MAX_MASTER_RESTARTS = 5
REAP_INTERVAL_SECONDS = 0.5


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _die_with_parent() -> None:
    """In the master child: SIGKILL when the supervisor goes away."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def resumable(state_path: str, job: str) -> bool:
    """Whether the state store holds a started job that has not ended (a master to restart)."""
    from master.state.api import StateStoreError
    from master.state.job_record import recorded_job_state

    try:
        return recorded_job_state(state_path, job) == "running"
    except StateStoreError as e:
        log.error("cannot read the job's state to decide on a restart: %s", e)
        return False


class MasterSupervisor:
    """Starts `master_argv` (a `dlrover submit` command line) and restarts it after a crash."""

    def __init__(
        self,
        master_argv: list[str],
        run_dir: str,
        out: TextIO,
        state: str = "",
        job: str = "default",
        max_restarts: int = DEFAULT_MAX_MASTER_RESTARTS,
    ) -> None:
        self.master_argv = master_argv
        self.run_dir = run_dir
        self.state = state or os.path.join(run_dir, STATE_FILE)
        self.job = job
        self.out = out
        self.max_restarts = max_restarts
        self.restarts = 0
        self._child: subprocess.Popen | None = None
        self._stopping = False
        # The orphan reaper must never take the master child's exit from Popen.wait (Popen
        # then reports exit code 0): it skips the child, and it ends with run(), so a later
        # supervisor's child (a new port pick) is not taken for an orphan either.
        self._child_lock = threading.Lock()
        self._done = threading.Event()

    def run(self) -> int:
        """Supervise until the job ends; returns the exit code `dlrover submit` ends with."""
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        read_fd, write_fd = os.pipe()  # the write end is ours alone (not inheritable)
        os.set_inheritable(read_fd, True)
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        reaper = threading.Thread(target=self._reap_orphans, name="reaper", daemon=True)
        reaper.start()
        try:
            resume = False
            while True:
                argv = [*self.master_argv, "--lifeline-fd", str(read_fd)]
                if resume:
                    argv.append("--resume")
                with self._child_lock:
                    self._child = subprocess.Popen(
                        argv, pass_fds=(read_fd,), preexec_fn=_die_with_parent
                    )
                code = self._child.wait()
                if self._stopping or not resumable(self.state, self.job):
                    return code if code >= 0 else 1
                if self.restarts >= self.max_restarts:
                    self._say(
                        f"!! master died ({_describe(code)}) and was restarted "
                        f"{self.restarts} times already; giving up, stopping every node"
                    )
                    return 1
                self.restarts += 1
                self._say(
                    f"!! master died ({_describe(code)}); restarting it "
                    f"({self.restarts}/{self.max_restarts}), nodes keep running"
                )
                resume = True
        finally:
            self._done.set()
            reaper.join()
            for s, handler in previous.items():
                signal.signal(s, handler)
            os.close(write_fd)  # every node's guard sees the lifeline close
            os.close(read_fd)

    def _forward(self, signum: int, frame: object) -> None:
        """Ctrl-C or SIGTERM: the master stops the job cleanly; no restart after that."""
        self._stopping = True
        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signum)

    def _reap_orphans(self) -> None:
        """Reap adopted nodes' guards re-parented here (never the master child: Popen does)."""
        while not self._done.wait(REAP_INTERVAL_SECONDS):
            with self._child_lock:
                try:
                    info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    continue
                if info is None:
                    continue
                child = self._child
                if child is not None and info.si_pid == child.pid:
                    continue
                try:
                    os.waitpid(info.si_pid, 0)  # an exited orphan: returns at once
                except ChildProcessError:
                    pass

    def _say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
