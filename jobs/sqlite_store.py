"""The default job store: one SQLite file in the state directory.

WAL journal (readers never wait for the writer), every write transaction `BEGIN IMMEDIATE` (it takes the
database's write lock up front, so two processes never deadlock upgrading read locks; a busy database is
waited for up to `busy_timeout_s`). Several ingress replicas on one node can share the file; a cluster
across nodes needs PostgreSQL (SQLite's locking is not safe on network file systems).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from jobs.errors import StoreUnavailable
from jobs.store import Clock, Row, SqlJobStore

__all__ = ["SqliteJobStore"]


class _SqliteTransaction:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def fetch(self, sql: str, params: Sequence[object] = ()) -> list[Row]:
        return self._conn.execute(sql, tuple(params)).fetchall()


class SqliteJobStore(SqlJobStore):
    SEQ_COLUMN = "seq INTEGER PRIMARY KEY AUTOINCREMENT"  # AUTOINCREMENT: a deleted newest seq is never reused

    def __init__(self, path: str | Path, clock: Clock = time.time, busy_timeout_s: float = 30.0) -> None:
        super().__init__(clock)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection per store, used by one thread at a time (the lock); other processes are kept out by
        # SQLite's own file locks.
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        self._conn.row_factory = sqlite3.Row
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise StoreUnavailable(f"{self.path}: SQLite refused WAL mode (got {mode!r}); use a local file system")
        # NORMAL in WAL mode: a committed job survives a process crash; an OS crash may lose the last commits.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._create_schema()

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[_SqliteTransaction]:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            except sqlite3.OperationalError as exc:  # busy past the timeout, disk I/O error
                raise StoreUnavailable(f"job database {self.path}: {exc}") from exc
            try:
                yield _SqliteTransaction(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            try:
                self._conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                self._conn.execute("ROLLBACK")
                raise StoreUnavailable(f"job database {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._conn.close()
