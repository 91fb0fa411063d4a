"""The job-history store: one record per finished run (configuration, resource use, throughput).

Embedded SQLite by default; a shared service (`dlrover brain serve`) keeps its own store and
masters reach it over HTTP (master.brain.client).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import sqlite3
import threading
from dataclasses import dataclass, field

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class JobRecord:
    """What one finished run of a job used and achieved."""

    job: str  # the job's name: runs of the same name are "the same job"
    run_dir: str
    finished_at: float
    status: str  # succeeded | failed | stopped
    wall_seconds: float
    replicas: dict[str, int] = field(default_factory=dict)  # by node type, at the end
    memory_mb: dict[str, int] = field(default_factory=dict)  # the spec's, by node type
    final_memory_mb: dict[str, int] = field(default_factory=dict)  # largest given, by type
    peak_rss_mb: dict[str, int] = field(default_factory=dict)  # largest reported, by type
    ooms: dict[str, int] = field(default_factory=dict)  # OOM failures by node type
    relaunches: int = 0
    records_done: int = 0
    records_per_second: float = 0.0

    def to_dict(self) -> dict:
        """JSON form (the service's wire format and the stored row)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> JobRecord:
        """Read a record back; unknown keys (a newer writer) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class HistoryStore(abc.ABC):
    """Where job records live."""

    @abc.abstractmethod
    def add(self, record: JobRecord) -> None:
        """Keep one finished run."""

    @abc.abstractmethod
    def runs(self, job: str, limit: int = 50) -> list[JobRecord]:
        """The latest runs of `job`, newest first."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store's resources."""


class SQLiteHistoryStore(HistoryStore):
    """Job history in one SQLite file (safe for several processes: SQLite locks the file)."""

    def __init__(self, path: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False, timeout=30)
        except (OSError, sqlite3.Error) as e:
            raise ValueError(
                f"cannot open the job history {path!r}: {e}; give a writable file path, "
                "or --brain off"
            ) from e
        self._lock = threading.Lock()
        with self._lock, self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                "job TEXT NOT NULL, finished_at REAL NOT NULL, record TEXT NOT NULL)"
            )
            self._db.execute("CREATE INDEX IF NOT EXISTS runs_job ON runs (job, finished_at)")

    def add(self, record: JobRecord) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO runs (job, finished_at, record) VALUES (?, ?, ?)",
                (record.job, record.finished_at, json.dumps(record.to_dict())),
            )

    def runs(self, job: str, limit: int = 50) -> list[JobRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM runs WHERE job = ? ORDER BY finished_at DESC, id DESC LIMIT ?",
                (job, limit),
            ).fetchall()
        return [JobRecord.from_dict(json.loads(r[0])) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
