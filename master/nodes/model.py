"""Node records: type, stable rank, per-incarnation id, status and exit reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class NodeState(str, enum.Enum):
    """pending -> running -> succeeded | failed | deleted."""

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
    COMM_ERROR = "comm_error"  # lost its peers or the master (unavailable, reset, timed out)
    HEARTBEAT_LOST = "heartbeat_lost"
    STOPPED = "stopped"  # stopped by the master (job end, scale-in)
    HANG = "hang"  # held shards but made no step progress for hang_timeout_seconds
    STRAGGLER = "straggler"  # replaced because its steps were much slower than its peers'
    UNKNOWN = "unknown"


TRAINING_TYPES = ("chief", "worker")


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
    extra: dict = field(default_factory=dict)

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
