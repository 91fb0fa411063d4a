"""The job's own values: its state, where a run keeps its files, what a scale request changed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# How long a node the master stops gets to exit by itself before it is killed.
STOP_GRACE_SECONDS = 5.0


class MasterFencedError(RuntimeError):
    """A newer master instance runs this job: this one must not act any more."""


class JobState(str, enum.Enum):
    """Where a job stands. pending -> running when `JobMaster.run` launches (or adopts) its
    nodes; running -> succeeded (the success policy is met and no node runs), failed (a node
    failed past its budgets, a start-up error, `stuck_action: fail`, or a master error) or
    stopped (the user asked: Ctrl-C, SIGTERM). The three ended states are final."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def ended(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


@dataclass(frozen=True)
class ScaleResult:
    """What a scale request changed."""

    previous: int
    replicas: int
    cluster_version: int


@dataclass
class JobRuntime:
    """Where a job run keeps its files, and how nodes reach the master."""

    run_dir: str
    master_addr: str
    token_file: str
    dashboard_url: str = ""  # the master's HTTP dashboard (/metrics beneath it), once serving
    node_env: dict[str, str] = field(default_factory=dict)  # e.g. the TLS files nodes use


@dataclass(frozen=True)
class NodeStart:
    """A node incarnation a decision starts: its rank's relaunches so far, and its resources
    (0: its group's)."""

    node_type: str
    rank: int
    relaunches: int
    memory_mb: int = 0
    cpu: float = 0.0
