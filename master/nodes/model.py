"""Node records: type, stable rank, per-incarnation id, status and exit reason."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class NodeState(str, enum.Enum):
    """A node incarnation's state. pending -> running once the platform launched (or the
    master adopted) it; running -> succeeded (exit 0) | deleted (stopped by the master: the
    job's end, a scale-in, a PS change) | failed (any other end). The ended states are final:
    a relaunch is a new incarnation with a new id."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DELETED = "deleted"

    @property
    def ended(self) -> bool:
        return self in (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.DELETED)


class ExitReason(str, enum.Enum):
    """Why a node's process ended."""

    NONE = ""
    SUCCEEDED = "succeeded"
    OOM = "oom"
    KILLED = "killed"
    USER_ERROR = "user_error"
    HARDWARE = "hardware"
    NODE_LOST = "node_lost"  # its host (Kubernetes node, Ray node) was lost with it
    COMM_ERROR = "comm_error"  # lost its peers or the master (unavailable, reset, timed out)
    HEARTBEAT_LOST = "heartbeat_lost"
    STOPPED = "stopped"  # stopped by the master (job end, scale-in)
    HANG = "hang"  # held shards but made no step progress for hang_timeout_seconds
    STRAGGLER = "straggler"  # replaced because its steps were much slower than its peers'
    UNKNOWN = "unknown"


TRAINING_TYPES = ("chief", "worker")
# A node's step time rests on the time per step of its last this many step reports.
STEP_SAMPLES_KEPT = 64


class Finding(str, enum.Enum):
    """What the master's health checks found about a node (each is found once per node, and
    read again when its exit is diagnosed)."""

    HEARTBEAT_LOST = "heartbeat_lost"
    HUNG = "hung"
    STRAGGLER = "straggler"
    STRAGGLER_REPLACED = "straggler_replaced"


@dataclass(frozen=True)
class Diagnosis:
    """The classified cause of a node's end, the log excerpt that shows it, and whether a
    relaunch could help (`deterministic`: the same code would fail the same way)."""

    reason: ExitReason
    summary: str
    excerpt: str = ""
    deterministic: bool = False


@dataclass(frozen=True)
class ReportedExit:
    """What a node said of its own end before it exited (its ReportExit call)."""

    reason: ExitReason
    message: str


@dataclass(frozen=True)
class GpuStat:
    """One GPU of a node, from its latest heartbeat."""

    index: int
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int


@dataclass
class Node:
    """One incarnation of a node."""

    type: str
    rank: int
    id: int
    state: NodeState = NodeState.PENDING
    exit_reason: ExitReason = ExitReason.NONE
    exit_code: int | None = None
    exit_message: str = ""
    relaunches: int = 0  # relaunches of this rank before this incarnation
    address: str = ""
    memory_mb: int = 0
    cpu: float = 0.0  # asked of the platform (0: the group's)
    log_path: str = ""
    registered: bool = False
    last_heartbeat: float = 0.0
    last_progress: float = 0.0  # monotonic time of the last shard taken or step reported
    global_step: int = 0
    steps: int = 0  # training steps this incarnation reported
    step_seconds: float = 0.0  # median time between its recent step reports
    last_step_at: float = 0.0  # monotonic time of its last step report
    cpu_percent: float = 0.0
    memory_rss_bytes: int = 0
    started_at: float = 0.0
    ended_at: float = 0.0
    stop_requested: bool = False
    stop_cause: str = ""  # why the master stopped it (e.g. "job done"), said with its end
    # How the platform finds the running process again (e.g. its pid), for a restarted master.
    platform_handle: dict = field(default_factory=dict)
    # What the master learns while the incarnation runs (not kept in the state store).
    memory_limit_bytes: int = 0  # the limit its heartbeats report (0: none known)
    gpus: tuple[GpuStat, ...] = ()
    step_samples: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_SAMPLES_KEPT))
    timed_reports: int = 0  # step reports timed so far (step_samples keeps the latest)
    findings: set[Finding] = field(default_factory=set)
    reported_exit: ReportedExit | None = None
    diagnosis: Diagnosis | None = None  # why it ended, once it has
    # The master kills this chief (a TF2 coordinator) after a PS loss and starts it again
    # without using a relaunch.
    coordinator_restart: bool = False
    # The master kills this PS and starts it again, without using a relaunch, so that it takes
    # the new address of these moved trainers (e.g. "worker-1"; master.job.moves).
    restart_for_move: str = ""

    @property
    def name(self) -> str:
        return f"{self.type}-{self.rank}"

    def to_record(self) -> dict:
        """The JSON-able record kept in the state store."""
        return {
            "type": self.type,
            "rank": self.rank,
            "id": self.id,
            "state": self.state.value,
            "exit_reason": self.exit_reason.value,
            "exit_code": self.exit_code,
            "exit_message": self.exit_message,
            "relaunches": self.relaunches,
            "address": self.address,
            "memory_mb": self.memory_mb,
            "cpu": self.cpu,
            "log_path": self.log_path,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "stop_requested": self.stop_requested,
            "stop_cause": self.stop_cause,
            "platform_handle": self.platform_handle,
        }

    @classmethod
    def from_record(cls, record: dict) -> Node:
        """Rebuild a node from its state-store record (a restarted master)."""
        return cls(
            type=record["type"],
            rank=int(record["rank"]),
            id=int(record["id"]),
            state=NodeState(record["state"]),
            exit_reason=ExitReason(record.get("exit_reason", "")),
            exit_code=record.get("exit_code"),
            exit_message=record.get("exit_message", ""),
            relaunches=int(record.get("relaunches", 0)),
            address=record.get("address", ""),
            memory_mb=int(record.get("memory_mb", 0)),
            cpu=float(record.get("cpu", 0.0)),
            log_path=record.get("log_path", ""),
            started_at=float(record.get("started_at", 0.0)),
            ended_at=float(record.get("ended_at", 0.0)),
            stop_requested=bool(record.get("stop_requested", False)),
            stop_cause=record.get("stop_cause", ""),
            platform_handle=dict(record.get("platform_handle") or {}),
        )
