"""The job's master as a detached, restartable Ray actor (`dlrover submit --master-actor`)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from master.platform.ray.connect import AUTH_MODE_ENV, LOOPBACK_ENV, connect
from master.platform.ray.job_anchor import ANCHOR_MAX_CONCURRENCY, ANCHOR_NAME, JobAnchor

log = logging.getLogger(__name__)

MASTER_ACTOR_NAME = "dlrover-master"
# After the job ends, the master actor keeps its exit code this long for `dlrover submit`
# (which kills it once read), then ends itself, so a detached run leaves no actor behind.
MASTER_LINGER_SECONDS = 300.0


class MasterActor:
    """The job's master as a detached Ray actor that Ray restarts (`max_restarts`).

    It runs `dlrover master ... --resume-if-started` as a child process (SIGKILLed if this
    actor's process dies), log appended to `log_path`. When the child ends with the job
    still running in the state store (it was killed, or crashed), this actor exits its process
    so that Ray restarts it; the new instance starts a master that resumes the job and adopts
    the node actors, which a detached job anchor keeps alive meanwhile. When the job has ended,
    the anchor is killed (and with it any node actor left) and `wait()` returns the exit code.
    """

    def __init__(
        self, argv: list[str], state: str, state_job: str, namespace: str, log_path: str
    ) -> None:
        import ray

        self._ray = ray
        self._state, self._state_job, self._namespace = state, state_job, namespace
        self._done = threading.Event()
        self._code: int | None = None
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        keep = (AUTH_MODE_ENV, LOOPBACK_ENV)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k in keep}
        guard = [sys.executable, "-m", "master.platform.pdeathsig", str(os.getpid()), "--"]
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        with open(log_path, "ab", buffering=0) as logf:
            logf.write(f"# master actor pid {os.getpid()} restarted={self.restarted}\n".encode())
            self._proc = subprocess.Popen(
                [*guard, sys.executable, "-m", "master.cli", "master", *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
            )
        threading.Thread(target=self._watch, name="master-child", daemon=True).start()

    def _watch(self) -> None:
        code = self._proc.wait()
        from master.state.job_record import recorded_job_state

        try:
            state = recorded_job_state(self._state, self._state_job)
        except Exception as e:  # the state cannot be read: let Ray try again
            log.error("master actor: cannot read the job's state: %s", e)
            state = "running"
        if state == "running":
            log.error("master exited with %d while the job runs; Ray restarts this actor", code)
            os._exit(1)
        try:
            self._ray.kill(self._ray.get_actor(ANCHOR_NAME, namespace=self._namespace))
        except Exception as e:  # already gone
            log.debug("job anchor: %s", e)
        self._code = code if code >= 0 else 1
        self._done.set()
        timer = threading.Timer(MASTER_LINGER_SECONDS, self._end_self)
        timer.daemon = True
        timer.start()

    def _end_self(self) -> None:
        try:
            me = self._ray.get_runtime_context().current_actor
            self._ray.kill(me, no_restart=True)
        except Exception as e:
            log.debug("master actor: ending itself: %s", e)

    def wait(self, timeout: float) -> int | None:
        """The master's exit code once the job has ended; None while it runs."""
        self._done.wait(timeout)
        return self._code

    def stop(self) -> None:
        """Ask the master to stop the job (as Ctrl-C would)."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)


def start_master_actor(
    address: str,
    namespace: str,
    argv: list[str],
    state: str,
    state_job: str,
    log_path: str,
    max_restarts: int,
) -> Any:
    """From `dlrover submit`: a detached job anchor and the detached, restartable master actor,
    both pinned to this machine's Ray node (the run dir and the master's port are here)."""
    ray = connect(address, namespace)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    anchor = (
        ray.remote(JobAnchor)
        .options(
            name=ANCHOR_NAME,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=ANCHOR_MAX_CONCURRENCY,
            scheduling_strategy=here,
        )
        .remote()
    )
    ray.get(anchor.ping.remote(), timeout=120)
    master = (
        ray.remote(MasterActor)
        .options(
            name=MASTER_ACTOR_NAME,
            lifetime="detached",
            num_cpus=0,
            max_restarts=max_restarts,
            max_concurrency=4,
            scheduling_strategy=here,
        )
        .remote(argv, state, state_job, namespace, log_path)
    )
    return master
