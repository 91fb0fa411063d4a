"""Job history in PostgreSQL, for a Brain service shared by many masters (needs `psycopg`)."""

from __future__ import annotations

import json
import threading

from master.brain.history import HistoryStore, JobRecord


class PostgresHistoryStore(HistoryStore):
    """The same table as the SQLite store, in a PostgreSQL database given by URL."""

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError as e:
            raise ValueError(
                f"{url.split('@')[-1]!r}: a PostgreSQL history needs the psycopg package "
                "(pip install 'psycopg[binary]'); or give a SQLite file path"
            ) from e
        try:
            self._db = psycopg.connect(url, autocommit=True)
        except psycopg.Error as e:
            # The URL may hold a password: name only the host part.
            raise ValueError(f"cannot connect to PostgreSQL at {url.split('@')[-1]}: {e}") from e
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS dlrover_runs (id BIGSERIAL PRIMARY KEY, "
                "job TEXT NOT NULL, finished_at DOUBLE PRECISION NOT NULL, record JSONB NOT NULL)"
            )
            self._db.execute(
                "CREATE INDEX IF NOT EXISTS dlrover_runs_job ON dlrover_runs (job, finished_at)"
            )

    def add(self, record: JobRecord) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO dlrover_runs (job, finished_at, record) VALUES (%s, %s, %s)",
                (record.job, record.finished_at, json.dumps(record.to_dict())),
            )

    def runs(self, job: str, limit: int = 50) -> list[JobRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM dlrover_runs WHERE job = %s "
                "ORDER BY finished_at DESC, id DESC LIMIT %s",
                (job, limit),
            ).fetchall()
        return [
            JobRecord.from_dict(r[0] if isinstance(r[0], dict) else json.loads(r[0])) for r in rows
        ]

    def close(self) -> None:
        with self._lock:
            self._db.close()
