"""What a restarted master needs beyond the nodes, ledgers and checkpoints, as it is stored."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

RUNTIME_KEY = "runtime"  # in the job table (master.state.job_record)


@dataclass
class RuntimeRecord:
    """The job master's own counters and choices, saved whenever one changes."""

    replicas: dict[str, int]
    cluster_version: int
    job_relaunches: int
    global_step: int
    started_wall: float  # time.time() when the job started
    fired_faults: list[int] = field(default_factory=list)  # indices into the faults given
    training_done: bool = False
    chief_reports_restores: bool = False
    addresses: dict[tuple[str, int], str] = field(default_factory=dict)  # (type, rank) -> addr

    def to_json(self) -> bytes:
        """The stored form (JSON; addresses as sorted [type, rank, address] triples)."""
        record = {
            "replicas": self.replicas,
            "cluster_version": self.cluster_version,
            "job_relaunches": self.job_relaunches,
            "global_step": self.global_step,
            "started_wall": self.started_wall,
            "fired_faults": self.fired_faults,
            "training_done": self.training_done,
            "chief_reports_restores": self.chief_reports_restores,
            "addresses": [[t, r, a] for (t, r), a in sorted(self.addresses.items())],
        }
        return json.dumps(record).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RuntimeRecord:
        """Read a stored record (one from before `chief_reports_restores` existed too)."""
        record = json.loads(raw)
        return cls(
            replicas=dict(record["replicas"]),
            cluster_version=record["cluster_version"],
            job_relaunches=record["job_relaunches"],
            global_step=record["global_step"],
            started_wall=record["started_wall"],
            fired_faults=list(record["fired_faults"]),
            training_done=record["training_done"],
            chief_reports_restores=record.get("chief_reports_restores", False),
            addresses={(t, int(r)): a for t, r, a in record["addresses"]},
        )
