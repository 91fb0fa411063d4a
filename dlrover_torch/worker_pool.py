"""Spare worker processes started ahead with torch imported, and a process context that uses them.

A fresh Python process spends a second or more importing torch and the script's libraries; a
restarted worker group that takes a spare skips that, so the launcher's share of a recovery is
rendezvous plus a pipe write.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.api import LogsSpecs, SubprocessContext

from dlrover_torch import priority
from dlrover_torch.preload import DEFAULT_PRELOAD, LATE_PRELOAD

log = logging.getLogger(__name__)

MAX_IDLE_DEATHS = 3  # spares that died before their job: after this many, no more spares
SPARE_EXIT_GRACE_S = 2.0  # for idle spares to exit on EOF before they are killed
SPARE_KILL_WAIT_S = 5.0  # for a killed spare to be gone; never blocks the agent longer


@dataclass(frozen=True)
class WorkerCommand:
    """What one worker runs: a script path or a module name, and its arguments."""

    target: str
    args: tuple[str, ...]
    module: bool = False
    executable: bool = False  # --no-python: target is a program, not a Python script

    def argv(self) -> list[str]:
        """sys.argv as the script sees it (torchrun runs ``python -u [-m] target args``)."""
        return [self.target, *self.args]


class SparePool:
    """Keeps up to ``size`` idle Python processes that already imported torch and the script's
    imports. Spares for the first group start at normal priority; refills start at low priority
    (see ``priority``) so they do not slow the group that trains, and get it back when taken."""

    def __init__(
        self,
        size: int,
        python: str = sys.executable,
        preload: tuple[str, ...] = DEFAULT_PRELOAD,
        command: WorkerCommand | None = None,
        late_preload: tuple[str, ...] = LATE_PRELOAD,
        lowering: str | None = None,
    ) -> None:
        self.size = size
        self._python = python
        self._preload = preload
        self._late_preload = late_preload
        self._command = command
        self._lowering = priority.lowering_method() if lowering is None else lowering
        self._nice = os.getpriority(os.PRIO_PROCESS, 0)
        self._idle: list[subprocess.Popen] = []
        self._ready_fds: dict[int, int] = {}  # pid -> read end of the spare's ready pipe
        self._ready: set[int] = set()
        self._low: set[int] = set()  # pids of spares started at low priority
        self._idle_deaths = 0
        self.cold_starts = 0

    def _spawn(self, low_priority: bool = False) -> subprocess.Popen:
        """One new spare in its own session, so a stop can signal its whole process group."""
        r, w = os.pipe()
        stdin = _dup_stdin()
        argv = [self._python, "-u", "-m", "dlrover_torch.spare_worker"]
        argv += ["--preload", ",".join(self._preload), "--ready-fd", str(w)]
        argv += ["--late-preload", ",".join(self._late_preload)]
        cmd = self._command
        if cmd is not None and not cmd.executable:
            argv += ["--module" if cmd.module else "--script", cmd.target]
        if stdin is not None:
            argv += ["--stdin-fd", str(stdin)]
        if low_priority:
            argv += ["--low-priority", self._lowering]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(w,) if stdin is None else (w, stdin),
                env=dict(os.environ),
            )
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
            if stdin is not None:
                os.close(stdin)
        self._ready_fds[proc.pid] = r
        if low_priority and self._lowering != priority.NONE:
            self._low.add(proc.pid)
        return proc

    def _forget(self, proc: subprocess.Popen) -> None:
        fd = self._ready_fds.pop(proc.pid, None)
        if fd is not None:
            os.close(fd)
        self._ready.discard(proc.pid)
        self._low.discard(proc.pid)

    def _is_ready(self, proc: subprocess.Popen) -> bool:
        """Whether the spare finished its imports (it writes one byte to its ready pipe)."""
        if proc.pid in self._ready:
            return True
        fd = self._ready_fds.get(proc.pid)
        if fd is not None and select.select([fd], [], [], 0)[0]:
            self._ready.add(proc.pid)
            return True
        return False

    def ready_count(self) -> int:
        """Idle spares done importing."""
        self._prune()
        return sum(1 for p in self._idle if self._is_ready(p))

    def _prune(self) -> None:
        """Forget spares that died while idle (e.g. killed by the OOM killer)."""
        alive = []
        for p in self._idle:
            if p.poll() is None:
                alive.append(p)
            else:
                self._forget(p)
                self._idle_deaths += 1
                log.warning(
                    "spare worker %s exited while idle (code %s); --no-spare-workers shows "
                    "what the script's imports do in a fresh process",
                    p.pid,
                    p.returncode,
                )
        self._idle = alive

    def fill(self, low_priority: bool = False) -> None:
        """Start spares until ``size`` are idle (not any more once spares keep dying idle:
        then every worker starts cold, as a fresh process would)."""
        self._prune()
        if self._idle_deaths >= MAX_IDLE_DEATHS:
            return
        while len(self._idle) < self.size:
            self._idle.append(self._spawn(low_priority))

    def refill(self) -> None:
        """Top the pool up at low priority (called as soon as a group has taken its spares)."""
        self.fill(low_priority=True)

    def take(self) -> subprocess.Popen:
        """An idle spare (ready ones first, oldest first), or a cold one if none; its CPU
        priority is back to normal before it is handed a job."""
        self._prune()
        if self._idle:
            ready = [p for p in self._idle if self._is_ready(p)]
            proc = ready[0] if ready else self._idle[0]
            self._idle.remove(proc)
            if proc.pid in self._low:
                priority.restore(proc.pid, self._lowering, self._nice)
            self._forget(proc)
            return proc
        self.cold_starts += 1
        proc = self._spawn()
        self._forget(proc)
        return proc

    def run_job(
        self,
        target: str,
        args: list[str],
        env: dict[str, str],
        module: bool = False,
        stdout: str | None = None,
        stderr: str | None = None,
    ) -> subprocess.Popen:
        """Hand one job to a spare: it becomes ``python -u [-m] target args`` with env."""
        proc = self.take()
        job = {
            "env": env,
            "argv": [target, *args],
            "module": module,
            "cwd": os.getcwd(),
            "stdout": stdout,
            "stderr": stderr,
        }
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            proc.stdin.close()
        except BrokenPipeError:
            log.warning("spare %s died before its job was sent; it counts as failed", proc.pid)
        return proc

    def close(self) -> None:
        """Retire every idle spare: EOF on stdin, then SIGKILL whatever is left.

        A low-priority spare gets its priority back first: on a busy machine its exit at nice 19
        took longer than a heartbeat timeout while the agent, its node's work done, waited."""
        for p in self._idle:
            if p.pid in self._low and p.poll() is None:
                priority.restore(p.pid, self._lowering, self._nice)
            try:
                if p.stdin:
                    p.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + SPARE_EXIT_GRACE_S
        for p in self._idle:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(p.pid, signal.SIGKILL)
                try:
                    p.wait(SPARE_KILL_WAIT_S)
                except subprocess.TimeoutExpired:  # killed; init reaps it once we are gone
                    log.warning(
                        "spare %s still exiting %.0f s after SIGKILL", p.pid, SPARE_KILL_WAIT_S
                    )
            self._forget(p)
        self._idle = []


def _dup_stdin() -> int | None:
    """A copy of this process's stdin for a spare to hand its script, None when closed."""
    try:
        return os.dup(0)
    except OSError:
        return None


def _kill_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _set_aside_if_unreadable(path: str) -> None:
    """Rename an error file that is not whole JSON to `<path>.partial`, so it is not read."""
    if not path or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            json.load(f)
    except ValueError:
        log.warning("worker error file %s was cut short (stopped while writing it)", path)
        os.replace(path, path + ".partial")
    except OSError:
        pass


class _PooledHandler:
    """A worker running in a former spare; the shape SubprocessContext expects of a handler."""

    def __init__(self, proc: subprocess.Popen, local_rank: int) -> None:
        self.proc = proc
        self.local_rank_id = local_rank

    def close(self, death_sig: signal.Signals | None = None) -> None:
        _kill_group(self.proc.pid, death_sig or signal.SIGTERM)


class HookedSubprocessContext(SubprocessContext):
    """torch's subprocess context with a callback run once before its workers are stopped."""

    def __init__(self, *args: Any, before_close: Callable[[], None] | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.before_close = before_close

    def _capture_process_failures(self, done_local_ranks: set[int]) -> None:
        # torch writes a worker's error file in place: a worker stopped while writing it (the
        # survivor of a crash, as the group is stopped) leaves it empty or cut short, and
        # torch's reader would then fail the whole agent. Such a file says nothing: set aside.
        for local_rank in self._running_local_ranks:
            if self.subprocess_handlers[local_rank].proc.poll() not in (None, 0):
                _set_aside_if_unreadable(self.error_files.get(local_rank, ""))
        super()._capture_process_failures(done_local_ranks)

    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        hook, self.before_close = self.before_close, None
        if hook is not None:
            try:
                hook()
            except Exception:
                log.exception("a before-stop hook failed; stopping the workers anyway")
        super().close(death_sig, timeout)


class PooledSubprocessContext(HookedSubprocessContext):
    """The subprocess context, except that workers are handed to pre-started spares."""

    def __init__(
        self,
        name: str,
        pool: SparePool,
        command: WorkerCommand,
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        before_close: Callable[[], None] | None = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        args = {rank: tuple(command.argv()) for rank in envs}
        super().__init__(
            name=name,
            entrypoint=sys.executable,
            args=args,
            envs=envs,
            logs_specs=logs_specs,
            log_line_prefixes=log_line_prefixes,
            before_close=before_close,
            duplicate_stdout_filters=duplicate_stdout_filters,
            duplicate_stderr_filters=duplicate_stderr_filters,
        )
        self._pool = pool
        self._command = command

    def _start(self) -> None:
        for local_rank in range(self.nprocs):
            env = dict(os.environ)
            env.update(self.envs[local_rank])
            proc = self._pool.run_job(
                self._command.target,
                list(self._command.args),
                env,
                module=self._command.module,
                stdout=self.stdouts.get(local_rank) or None,
                stderr=self.stderrs.get(local_rank) or None,
            )
            self.subprocess_handlers[local_rank] = _PooledHandler(proc, local_rank)
