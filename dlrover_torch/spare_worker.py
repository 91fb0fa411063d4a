"""A spare worker process: imports torch and the script's imports ahead, then becomes one worker.

The agent starts ``python -u -m dlrover_torch.spare_worker --preload MODULES --late-preload
MODULES [--script PATH | --module NAME] --ready-fd FD [--stdin-fd FD] [--low-priority METHOD]``
(the script's imports are preloaded between the two lists) and, when a worker group
starts, writes one JSON line to its stdin: the full environment, the argv, whether the entry is a
module, the working directory and where stdout/stderr go. The process then becomes that worker,
indistinguishable from ``python -u script.py`` started fresh: same ``__main__``, environment,
streams (what the imports printed ahead is replayed into them), stdin, priority and exit status.
One launcher policy differs on purpose: it keeps the spare's parent-death signal, so workers do
not outlive a SIGKILLed agent and hold their peers' process group.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import sys
from typing import Any

from dlrover_torch import priority
from dlrover_torch.preload import DEFAULT_PRELOAD, LATE_PRELOAD, modules_to_preload, preload
from dlrover_torch.script_main import run_as_main

PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when the agent dies (0: nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class CapturedOutput:
    """Stdout and stderr of the warm-up, kept in memory files until the job says where to go."""

    def __init__(self) -> None:
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        self._files = {fd: os.memfd_create(f"spare-warmup-{fd}") for fd in (1, 2)}
        for fd, mem in self._files.items():
            os.dup2(mem, fd)

    def stop(self) -> None:
        """Point stdout and stderr back where the spare started with."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)

    def replay(self) -> None:
        """Write what the warm-up printed to the current stdout and stderr, then forget it."""
        for fd, mem in self._files.items():
            os.lseek(mem, 0, os.SEEK_SET)
            while chunk := os.read(mem, 1 << 16):
                os.write(fd, chunk)
            os.close(mem)
        self._files = {}


def _redirect(fd: int, path: str | None) -> None:
    """Point fd (1 or 2) at a log file, as the agent's redirects/tee settings ask."""
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _attach_stdin(fd: int | None) -> None:
    """Give the worker the launcher's stdin (as torch gives a fresh worker), else /dev/null."""
    if fd is None:
        fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)


def _become_worker(job: dict[str, Any], warmup: CapturedOutput, stdin_fd: int | None) -> None:
    """Apply the job's environment, streams and argv, then run the script as __main__."""
    os.environ.clear()
    os.environ.update(job["env"])
    if job.get("cwd"):
        os.chdir(job["cwd"])
    _redirect(1, job.get("stdout"))
    _redirect(2, job.get("stderr"))
    warmup.replay()
    _attach_stdin(stdin_fd)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    run_as_main(list(job["argv"]), bool(job.get("module")))


def _job_arrived() -> bool:
    """Whether the agent wrote the job (or closed stdin) while this spare still warms up."""
    return bool(select.select([0], [], [], 0)[0])


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dlrover_torch.spare_worker")
    p.add_argument("--preload", default=",".join(DEFAULT_PRELOAD))
    p.add_argument("--late-preload", default=",".join(LATE_PRELOAD))
    p.add_argument("--script", default=None)
    p.add_argument("--module", default=None)
    p.add_argument("--ready-fd", type=int, default=None)
    p.add_argument("--stdin-fd", type=int, default=None)
    p.add_argument("--low-priority", default=priority.NONE)
    return p.parse_args(argv)


def main() -> None:
    """Warm up, signal readiness, wait for a job line on stdin and run it; EOF means retire."""
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() == 1:  # the agent died before prctl took effect
        os._exit(1)
    args = _parse(sys.argv[1:])
    priority.lower_self(args.low_priority)
    warmup = CapturedOutput()
    try:
        base = [m for m in args.preload.split(",") if m.strip()]
        late = [m for m in args.late_preload.split(",") if m.strip()]
        target = args.module or args.script
        names = modules_to_preload(base, target, bool(args.module), os.getcwd(), late)
        preload(names, os.getcwd(), stop=_job_arrived)
    finally:
        warmup.stop()
    if args.ready_fd is not None:  # one byte says the imports are done
        try:
            os.write(args.ready_fd, b"1")
        except OSError:  # the agent stopped listening (a cold start handed out at once)
            pass
        os.close(args.ready_fd)
    line = sys.stdin.buffer.readline()
    if not line.strip():
        os._exit(0)
    _become_worker(json.loads(line), warmup, args.stdin_fd)


if __name__ == "__main__":
    main()
