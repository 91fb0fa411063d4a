"""The default state store: one embedded SQLite file (or memory), safe to share between threads."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator

from master.state.api import StateStore, StateStoreError

logger = logging.getLogger(__name__)

MEMORY_PATH = ":memory:"
_BUSY_TIMEOUT_MS = 5000  # another process holding the file: wait this long before failing
# The WAL is copied into the database file (and both fsynced) by a thread of the store's own
# this often, not inside the commit that happens to cross SQLite's page threshold: a checkpoint
# fsyncs, which takes tens of milliseconds on a busy disk, and would hold every writer.
CHECKPOINT_SECONDS = 1.0

# WITHOUT ROWID: rows live in the primary-key b-tree itself, so a write touches one b-tree, not
# a table and its key index (a shard grant's commit measured ~25% cheaper). Files made before
# keep their table as it is; both behave the same.
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv ("
    "tbl TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, PRIMARY KEY (tbl, key)"
    ") WITHOUT ROWID"
)


class SQLiteStateStore(StateStore):
    """StateStore on SQLite: WAL journal for files, one connection guarded by a re-entrant lock.

    A transaction holds the lock until it ends, so writes of other threads never join it.
    """

    def __init__(self, path: str = MEMORY_PATH) -> None:
        self.path = os.fspath(path)
        self._lock = threading.RLock()
        self._depth = 0  # nesting level of the open transaction; only the lock holder touches it
        self._conn: sqlite3.Connection | None = self._open()
        self._closed = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if self.path != MEMORY_PATH:
            self._checkpointer = threading.Thread(
                target=self._checkpoint_loop, name="state-checkpoint", daemon=True
            )
            self._checkpointer.start()

    def _checkpoint_loop(self) -> None:
        """Checkpoint the WAL from a connection of its own: PASSIVE never blocks the writer."""
        try:
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as e:
            logger.warning("state store %s: no background checkpoints: %s", self.path, e)
            return
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            while not self._closed.wait(CHECKPOINT_SECONDS):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as e:  # the writer's own threshold still bounds the WAL
                    logger.debug("state store %s: checkpoint: %s", self.path, e)
        finally:
            conn.close()

    def _open(self) -> sqlite3.Connection:
        in_memory = self.path == MEMORY_PATH
        if not in_memory:
            parent = os.path.dirname(os.path.abspath(self.path))
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as e:
                raise self._open_error(f"cannot create directory {parent!r}: {e}") from None
            if os.path.isdir(self.path):
                raise self._open_error("it is a directory")
        conn: sqlite3.Connection | None = None
        try:
            # isolation_level=None: autocommit, so transactions are exactly the ones we BEGIN.
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            if not in_memory:
                conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    logger.warning(
                        "state store %s: WAL unavailable, journal mode is %s", self.path, mode
                    )
                # WAL + synchronous=NORMAL: a commit is in the WAL file (the OS page cache) when
                # it returns, so it survives the master process dying, which is what a restarted
                # master needs; the WAL is fsynced at checkpoints only, so an OS crash or power
                # loss may drop the last commits (never corrupts). FULL would fsync every commit:
                # 3-4 ms each on this machine's disk against ~0.2 ms.
                conn.execute("PRAGMA synchronous = NORMAL")
                # Checkpoints run in the background (see CHECKPOINT_SECONDS); a WAL that grows
                # past 10,000 pages all the same (the checkpointer starved) is still
                # checkpointed by the committing writer.
                conn.execute("PRAGMA wal_autocheckpoint = 10000")
            conn.execute(_SCHEMA)
            # Probe that the file is really writable now, rather than failing at the first put.
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT OR REPLACE INTO kv VALUES ('', '', x'')")
            conn.execute("ROLLBACK")
        except sqlite3.Error as e:
            if conn is not None:
                conn.close()
            raise self._open_error(str(e)) from None
        logger.info("state store opened at %s", self.path)
        return conn

    def _open_error(self, reason: str) -> StateStoreError:
        return StateStoreError(
            f"state store {self.path!r}: cannot open it for writing: {reason}. "
            "Set the state path to a writable file (its directory is created if missing), "
            f"or to {MEMORY_PATH!r} for a state that does not survive a master restart."
        )

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateStoreError(f"state store {self.path!r} is closed")
        return self._conn

    def get(self, table: str, key: str) -> bytes | None:
        _check_names(table, key)
        with self._lock:
            row = (
                self._connection()
                .execute("SELECT value FROM kv WHERE tbl = ? AND key = ?", (table, key))
                .fetchone()
            )
        return None if row is None else bytes(row[0])

    def put(self, table: str, key: str, value: bytes) -> None:
        _check_names(table, key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"state store value must be bytes, got {type(value).__name__}")
        with self._lock:
            self._connection().execute(
                "INSERT OR REPLACE INTO kv (tbl, key, value) VALUES (?, ?, ?)",
                (table, key, bytes(value)),
            )

    def delete(self, table: str, key: str) -> None:
        _check_names(table, key)
        with self._lock:
            self._connection().execute("DELETE FROM kv WHERE tbl = ? AND key = ?", (table, key))

    def scan(self, table: str) -> dict[str, bytes]:
        _check_names(table)
        with self._lock:
            rows = (
                self._connection()
                .execute("SELECT key, value FROM kv WHERE tbl = ? ORDER BY key", (table,))
                .fetchall()
            )
        return {key: bytes(value) for key, value in rows}

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            conn = self._connection()
            if self._depth == 0:
                begin, commit, rollback = "BEGIN IMMEDIATE", ("COMMIT",), ("ROLLBACK",)
            else:
                # A savepoint: released into the outer transaction, or undone on its own.
                name = f"sp{self._depth}"
                begin, commit = f"SAVEPOINT {name}", (f"RELEASE {name}",)
                rollback = (f"ROLLBACK TO {name}", f"RELEASE {name}")
            conn.execute(begin)
            self._depth += 1
            try:
                yield
            except BaseException:
                self._depth -= 1
                for statement in rollback:
                    conn.execute(statement)
                raise
            self._depth -= 1
            try:
                for statement in commit:
                    conn.execute(statement)
            except sqlite3.Error as e:
                if self._depth == 0 and conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise StateStoreError(f"state store {self.path!r}: commit failed: {e}") from e

    def close(self) -> None:
        with self._lock:
            if self._conn is None:
                return
            if self._depth:
                raise StateStoreError(
                    f"state store {self.path!r}: close() called inside a transaction; "
                    "close it after the transaction block ends"
                )
            self._closed.set()
            if self._checkpointer is not None:
                self._checkpointer.join(timeout=5)  # it never takes the lock
            self._conn.close()
            self._conn = None


def _check_names(*names: object) -> None:
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"state store table and key must be str, got {type(name).__name__}")
