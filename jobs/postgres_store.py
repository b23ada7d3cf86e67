"""The cluster job store: PostgreSQL, shared by every ingress replica.

Concurrency comes from row locks: a claim picks the oldest queued row `FOR UPDATE SKIP LOCKED` (two
replicas claiming at once get different jobs, neither waits), the reaper skips rows another replica is
reaping, and admission takes a per-model transaction-scoped advisory lock around count + insert so the
queue bound holds exactly. Times come from the store's clock (the replicas' clocks; keep them in NTP sync).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import psycopg
from psycopg.rows import DictRow, dict_row

from jobs.errors import StoreUnavailable
from jobs.store import Clock, Row, SqlJobStore, Transaction

__all__ = ["PostgresJobStore"]

ADVISORY_NAMESPACE = 20261130  # first key of this store's advisory locks (the second: a hash of the model)
SCHEMA_LOCK_KEY = 0


class _PostgresTransaction:
    def __init__(self, conn: psycopg.Connection[DictRow]) -> None:
        self._conn = conn

    def fetch(self, sql: str, params: Sequence[object] = ()) -> list[Row]:
        cursor = self._conn.execute(sql.replace("?", "%s"), tuple(params))  # the shared SQL uses `?`
        if cursor.description is None:  # a statement without a result (DDL, UPDATE without RETURNING)
            return []
        return list(cursor.fetchall())


class PostgresJobStore(SqlJobStore):
    SEQ_COLUMN = "seq BIGSERIAL PRIMARY KEY"
    SKIP_LOCKED = " FOR UPDATE SKIP LOCKED"
    ROW_LOCK = " FOR UPDATE"

    def __init__(self, url: str, clock: Clock = time.time, connect_timeout_s: float = 10.0) -> None:
        super().__init__(clock)
        self._url = url
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[DictRow] | None = None
        self._create_schema()

    def _connection(self) -> psycopg.Connection[DictRow]:
        # A connection the server dropped is replaced on next use (the failed call already raised).
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.Connection.connect(
                self._url, autocommit=True, row_factory=dict_row, connect_timeout=max(1, int(self._connect_timeout_s))
            )
        return self._conn

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[_PostgresTransaction]:
        with self._lock:
            try:
                conn = self._connection()
                with conn.transaction():
                    yield _PostgresTransaction(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:  # server gone, connection closed
                raise StoreUnavailable(f"PostgreSQL job database: {exc}") from exc

    def _lock_schema(self, tx: Transaction) -> None:
        # CREATE ... IF NOT EXISTS races with itself (duplicate type) across replicas starting together.
        tx.fetch("SELECT pg_advisory_xact_lock(?::int, ?::int)", (ADVISORY_NAMESPACE, SCHEMA_LOCK_KEY))

    def _lock_queue(self, tx: Transaction, model: str) -> None:
        tx.fetch("SELECT pg_advisory_xact_lock(?::int, hashtext(?))", (ADVISORY_NAMESPACE, model))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
