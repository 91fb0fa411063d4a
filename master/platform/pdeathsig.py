"""Exec a command so that it is SIGKILLed when the master that launched it dies.

Usage: python -m master.platform.pdeathsig PARENT_PID -- COMMAND...
Linux only (prctl PR_SET_PDEATHSIG); elsewhere it just execs the command.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: python -m master.platform.pdeathsig PARENT_PID -- COMMAND...\n")
        sys.exit(2)
    parent = int(argv[0])
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # The parent may have died before prctl took effect.
        if os.getppid() != parent:
            sys.exit(1)
    command = argv[2:]
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"cannot run {command[0]!r}: {e}\n")
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
