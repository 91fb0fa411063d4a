"""Run a node's command so that its whole process group dies with the Ray actor that owns it.

Usage: python -m master.platform.lifeline_guard LIFELINE_FD [--exit-file PATH] -- COMMAND...
LIFELINE_FD is the read end of a pipe whose write end only the owner (a Ray actor, or the
`dlrover submit` supervisor of a local job) holds. With --exit-file, the command's exit status
is written there before the guard ends, for a master that adopted the node and cannot wait()
for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

# Exit code when the command cannot be started at all (as a shell would report it).
EXIT_CANNOT_RUN = 127
GUARD_MODULE = "master.platform.lifeline_guard"

# Signals a signal_node() (or a kubelet) may send that must not end a guard (or the sentinel)
# before its command: it outlives them and lets the command decide.
GUARD_SURVIVES = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def _guard_main(argv: Sequence[str]) -> None:
    """Run COMMAND in this process group, which a sentinel kills when the lifeline closes.

    The sentinel is a fork of the guard, not a child of the actor: Ray SIGKILLs an exiting
    worker's direct children (the guard), but not their children, so the sentinel is still
    there to take the group down. The guard ends the way the command ended (same exit code
    or same signal), which is what the actor's wait() reports.
    """
    argv = list(argv)
    exit_file = ""
    if len(argv) > 2 and argv[1] == "--exit-file":
        exit_file = argv[2]
        del argv[1:3]
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write(
            f"usage: python -m {GUARD_MODULE} LIFELINE_FD [--exit-file PATH] -- COMMAND...\n"
        )
        os._exit(2)
    lifeline, command = int(argv[0]), list(argv[2:])
    if os.fork() == 0:
        _sentinel(lifeline)
    os.close(lifeline)
    for sig in GUARD_SURVIVES:
        # A handler (unlike SIG_IGN) is reset to the default in the command by exec.
        signal.signal(sig, lambda signum, frame: None)
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as e:
        sys.stderr.write(f"cannot run {command[0]!r}: {e}\n")
        sys.stderr.flush()
        write_exit_file(exit_file, EXIT_CANNOT_RUN)
        os._exit(EXIT_CANNOT_RUN)
    code = child.wait()
    write_exit_file(exit_file, code)
    if code < 0:
        if -code != signal.SIGKILL:  # SIGKILL's action cannot be set (nor needs to be)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def write_exit_file(path: str, code: int) -> None:
    """Record the command's exit status (negative: killed by that signal), atomically."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(code))
    os.replace(tmp, path)


def read_exit_file(path: str) -> int | None:
    """The exit status a guard recorded, or None if it recorded none (it was SIGKILLed)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _sentinel(lifeline: int) -> None:
    """Block until the actor's end of the lifeline closes, then SIGKILL the process group."""
    try:
        for sig in GUARD_SURVIVES:
            signal.signal(sig, signal.SIG_IGN)
        while os.read(lifeline, 64):
            pass
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


if __name__ == "__main__":
    _guard_main(sys.argv[1:])
