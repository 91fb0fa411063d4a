"""A spare worker process: imports torch ahead of time, then runs one training script on demand.

The agent starts it with ``python -u -m dlrover_torch.spare_worker MODULES FD`` and, when a worker
group starts, writes one JSON line to its stdin: the full environment, the argv, whether the entry
is a module, and where stdout/stderr go. The process then becomes that worker: the script runs as
``__main__`` exactly as ``python -u script.py ARGS`` would run it, minus the torch import time.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the agent that started it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the agent died before prctl took effect
        os._exit(1)


def _redirect(fd: int, path: str | None) -> None:
    """Point fd (1 or 2) at a log file, as the agent's redirects/tee settings ask."""
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _become_worker(job: dict[str, Any]) -> None:
    """Apply the job's environment, streams and argv, then run the script as __main__."""
    os.environ.clear()
    os.environ.update(job["env"])
    if job.get("cwd"):
        os.chdir(job["cwd"])
    _redirect(1, job.get("stdout"))
    _redirect(2, job.get("stderr"))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    argv = list(job["argv"])
    sys.argv = argv
    if job.get("module"):
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    """Preload modules, wait for a job line on stdin, and run it; EOF means retire."""
    _die_with_parent()
    preload = sys.argv[1] if len(sys.argv) > 1 else "torch,torch.distributed"
    for name in preload.split(","):
        if name.strip():
            try:
                importlib.import_module(name.strip())
            except ImportError:
                pass
    if len(sys.argv) > 2:  # the agent's ready pipe: one byte says the imports are done
        fd = int(sys.argv[2])
        try:
            os.write(fd, b"1")
        except OSError:  # the agent stopped listening (a cold start handed out at once)
            pass
        os.close(fd)
    line = sys.stdin.buffer.readline()
    if not line.strip():
        sys.exit(0)
    _become_worker(json.loads(line))


if __name__ == "__main__":
    main()
