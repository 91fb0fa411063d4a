"""Where a run of a job lives and how it is named, the same for every way of submitting it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from master.config import JobSpec

STATE_FILE = "state.sqlite"  # the run's SQLite state in its run dir, unless --state says else
TOKEN_FILE = ".job_token"  # the job token nodes read (owner-only)
MASTER_LOG = "master.log"  # the log of a master that runs away from this command (Ray actor)
_WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class RunLayout:
    """One run's run dir, state store, the master's host and ports, and its namespaces."""

    run_dir: str  # absolute
    state: str  # the state store URL: --state as given, else STATE_FILE in the run dir
    host: str  # where this command reaches the master (a wildcard bind address: loopback)
    namespace: str  # the run's own keys in a shared store: "<job name>/<run dir name>"
    port: int = 0  # the master's gRPC port; 0: not picked yet
    metrics_port: int = 0  # its /metrics and dashboard port; 0: not picked yet

    @property
    def token_file(self) -> str:
        return os.path.join(self.run_dir, TOKEN_FILE)

    @property
    def master_log(self) -> str:
        return os.path.join(self.run_dir, MASTER_LOG)

    @property
    def ray_namespace(self) -> str:
        """The run's Ray namespace (its anchor, node actors and master actor live there)."""
        return "dlrover-" + self.namespace.replace("/", "-")

    def with_ports(self, port: int, metrics_port: int) -> RunLayout:
        """This layout with these ports, each one that is 0 picked free on `host`."""
        from master.platform.local import free_port

        port = port or free_port(self.host)
        return replace(self, port=port, metrics_port=metrics_port or free_port(self.host))

    def master_flags(self) -> list[str]:
        """The flags that run a master (and every restart of it) in this run, on its ports."""
        flags = ["--run-dir", self.run_dir, "--port", str(self.port)]
        return [*flags, "--metrics-port", str(self.metrics_port)]


def default_run_dir(spec: JobSpec) -> str:
    """A new run dir under the job's workdir: its name, the time and this process's id."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(spec.workdir, "runs", f"{spec.name}-{stamp}-{os.getpid()}")


def state_namespace(spec: JobSpec, run_dir: str) -> str:
    """Each run's own keys in a shared store (etcd): the job name and the run dir's name."""
    return f"{spec.name}/{os.path.basename(os.path.normpath(run_dir))}"


def run_layout(
    spec: JobSpec, run_dir: str = "", state: str = "", host: str = "127.0.0.1"
) -> RunLayout:
    """The layout of a run of `spec` in `run_dir` (default: a new one), its state in `state`
    (default: the run dir's STATE_FILE), its master bound to `host`; ports not picked yet."""
    run_dir = os.path.abspath(run_dir or default_run_dir(spec))
    return RunLayout(
        run_dir=run_dir,
        state=state or os.path.join(run_dir, STATE_FILE),
        host="127.0.0.1" if host in _WILDCARDS else host,
        namespace=state_namespace(spec, run_dir),
    )
