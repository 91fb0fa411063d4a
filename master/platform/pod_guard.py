"""Run a node's command in its pod, and hand its trainers' last data positions to the master.

Usage: python -m master.platform.pod_guard -- COMMAND...

On Kubernetes nothing of the master's can read a dead container's files, so a trainer there
reported every step (10 messages a second per worker). The guard is the container's first
process: it starts COMMAND with DLROVER_POSITION_FILE naming a node-local file (see
master.client.position), so its trainers coalesce their reports; it forwards the signals the
kubelet sends and reaps orphans, as an init does; and when COMMAND ends it sends the positions
the trainers recorded last to the master, then ends the way COMMAND did. The container, and so
the pod's end event, waits for that report: the master applies it before it re-queues the
node's shards, and a failure still costs at most the one batch in flight.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from master.client.env import ENV_MASTER_WAIT, ENV_POSITION_FILE, read_master_wait
from master.client.errors import MasterError
from master.client.position import collect_positions
from master.platform.lifeline_guard import EXIT_CANNOT_RUN, GUARD_SURVIVES

GUARD_MODULE = "master.platform.pod_guard"
# How long the guard keeps trying an unreachable master with the positions (a restarting
# master pod takes seconds); the pod's end waits that long at most.
REPORT_WAIT_SECONDS = 30.0
_SHM = "/dev/shm"

log = logging.getLogger(__name__)


def guarded_command(command: Sequence[str], python: str = "python") -> list[str]:
    """COMMAND run under the guard (for a pod whose image has this package)."""
    return [python, "-m", GUARD_MODULE, "--", *command]


def position_dir() -> str:
    """A fresh directory for the trainers' position files: in memory where /dev/shm is
    writable (one write per step), else in the temp dir."""
    parent = _SHM if os.access(_SHM, os.W_OK) else None
    return tempfile.mkdtemp(prefix="dlrover-positions-", dir=parent)


def report_positions(env: Mapping[str, str], positions: dict[str, list[tuple[int, int]]]) -> int:
    """Send each (shard, records consumed) the trainers left to the master as this node's
    progress; returns how many it took. A stale one (a shard already handed back) is skipped."""
    if not positions:
        return 0
    from master.client.master import MasterClient  # grpc only where there is something to send

    wait = min(read_master_wait(env), REPORT_WAIT_SECONDS)
    client = MasterClient.from_env({**env, ENV_MASTER_WAIT: str(wait)})
    sent = 0
    try:
        for dataset, pairs in positions.items():
            for pair in pairs:  # one per call: a stale pair must not drop the others
                try:
                    client.report_progress(dataset, [pair])
                    sent += 1
                except MasterError as e:
                    log.debug("position %s of %s not taken: %s", pair, dataset, e)
    finally:
        client.close()
    return sent


class _Forwarder:
    """Passes the signals a kubelet or a user sends the container's first process
    (GUARD_SURVIVES) to COMMAND; those that come before it starts, once it has."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.pending: list[int] = []

    def __call__(self, signum, frame) -> None:
        if self.child is None:
            self.pending.append(signum)
            return
        try:
            self.child.send_signal(signum)
        except ProcessLookupError:
            pass

    def started(self, child: subprocess.Popen) -> None:
        self.child = child
        for signum in self.pending:
            self(signum, None)


def _wait_reaping(child: subprocess.Popen) -> int:
    """COMMAND's exit status (negative: its signal), reaping any orphan that exits meanwhile."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # already reaped
            return child.wait()
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            return child.returncode


def run(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run COMMAND, then report its trainers' positions; COMMAND's exit status."""
    directory = position_dir()
    base = os.path.join(directory, "position")
    forward = _Forwarder()
    for sig in GUARD_SURVIVES:
        # A handler (unlike SIG_IGN) is reset to the default in COMMAND by exec.
        signal.signal(sig, forward)
    try:
        child = subprocess.Popen(list(command), env={**env, ENV_POSITION_FILE: base})
    except OSError as e:
        sys.stderr.write(f"cannot run {command[0]!r}: {e}\n")
        shutil.rmtree(directory, ignore_errors=True)
        return EXIT_CANNOT_RUN
    forward.started(child)
    code = _wait_reaping(child)
    for sig in GUARD_SURVIVES:
        signal.signal(sig, signal.SIG_IGN)  # the report is short; a second TERM must not cut it
    try:
        report_positions(env, collect_positions(base))
    except MasterError as e:
        log.warning("the trainers' last positions did not reach the master: %s", e)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return code


def _end_like(code: int) -> None:
    """Exit as COMMAND did: by its signal (an init, which signals cannot end, exits 128+N)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0 and os.getpid() != 1:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def main(argv: Sequence[str]) -> None:
    if len(argv) < 2 or argv[0] != "--":
        sys.stderr.write(f"usage: python -m {GUARD_MODULE} -- COMMAND...\n")
        os._exit(2)
    logging.basicConfig(level=logging.WARNING, format="dlrover pod guard: %(message)s")
    _end_like(run(argv[1:], os.environ))


if __name__ == "__main__":
    main(sys.argv[1:])
