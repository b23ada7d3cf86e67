"""Job records in a real database: the `JobStore` protocol and the SQL both implementations share.

`SqliteJobStore` (jobs/sqlite_store.py, the default: one file, WAL, safe across processes) and
`PostgresJobStore` (jobs/postgres_store.py, for clusters) differ only in how they connect, how a transaction
takes its locks, and two DDL words; every query lives here once.

Invariants (each kept by one statement or transaction, so they hold with many replicas on one database):
- a queued job is claimed by at most one runner, oldest first (`seq` order);
- only the lease holder's writes land on a running job (every runner write matches `lease_owner`);
- a job whose lease expired is retried (no step ran, runs left) or finished with the cause, never left
  in_progress;
- a model never has more than `max_queued` queued jobs (admission counts and inserts under one lock).
All times come from the store's `clock`, so tests can move time instead of sleeping.
"""

from __future__ import annotations

import dataclasses
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

from jobs.backend import VideoSpec, VideoStats, VideoTimings
from jobs.errors import JobConflict, JobNotFound, QueueFull
from jobs.media import VideoMedia
from jobs.records import JobError, JobPage, JobRecord, JobStatus, LeaseStatus, QueueStats, ReapReport, new_job_id

__all__ = ["Clock", "JobStore", "SqlJobStore", "Transaction", "open_job_store"]

Clock = Callable[[], float]
Row = Mapping[str, Any]  # a result row by column name (internal to the store implementations)

REAP_CAUSE = "the replica running it stopped renewing its lease"
RELEASE_CAUSE = "the replica running it shut down"
RECENT_RUNS = 20  # completed runs averaged for the Retry-After estimate


class JobStore(Protocol):
    """Durable job records. Every method is one atomic operation; all are blocking (call them off the event
    loop). Runner writes name the `lease_owner` token they claimed with and return False / LOST when the job
    is no longer theirs."""

    def create(self, spec: VideoSpec, owner: str | None, max_queued: int) -> JobRecord:
        """A new queued job with a fresh id; QueueFull when the model already has `max_queued` queued."""
        ...

    def get(self, job_id: str) -> JobRecord | None: ...

    def list_jobs(self, owner: str | None, limit: int, after: str | None = None) -> JobPage:
        """Newest first. `owner` None: every job. `after`: the page after that job (JobNotFound if unknown
        or not the owner's)."""
        ...

    def claim(self, models: Sequence[str], lease_owner: str, lease_s: float) -> JobRecord | None:
        """The oldest queued job of `models`, now in_progress under a lease; None when none is queued."""
        ...

    def renew_lease(self, job_id: str, lease_owner: str, lease_s: float) -> LeaseStatus: ...

    def set_progress(self, job_id: str, lease_owner: str, step: int, num_steps: int, lease_s: float) -> LeaseStatus:
        """Record steps done (progress = step/num_steps, 99 at most) and renew the lease."""
        ...

    def complete(
        self, job_id: str, lease_owner: str, output_key: str, timings: VideoTimings, stats: VideoStats,
        retention_s: float,
    ) -> bool:
        """False (nothing written) when the job is no longer ours or a cancel was requested."""
        ...

    def fail(self, job_id: str, lease_owner: str, error: JobError) -> bool: ...

    def finish_cancelled(self, job_id: str, lease_owner: str) -> bool:
        """The runner stopped on a cancel: in_progress -> cancelled."""
        ...

    def release(self, job_id: str, lease_owner: str, max_attempts: int, cause: str = RELEASE_CAUSE) -> JobStatus | None:
        """The runner gives a job back unfinished (shutting down, or its worker died: `cause`): requeued when no
        step ran and runs are left, else failed with the cause (or cancelled if a cancel was requested). None
        when it was not ours."""
        ...

    def cancel(self, job_id: str) -> JobRecord:
        """queued -> cancelled at once; in_progress -> cancel flag (the runner stops at its next step).
        JobNotFound; JobConflict for a finished job."""
        ...

    def delete(self, job_id: str) -> JobRecord | None:
        """Remove the record (a runner still on it loses its lease); the record as it was, or None."""
        ...

    def reap(self, max_attempts: int) -> ReapReport:
        """Every in_progress job whose lease expired: requeued, failed or cancelled as in `release`."""
        ...

    def expire_outputs(self) -> list[str]:
        """Forget the output keys of completed jobs past their retention; the keys, for deletion."""
        ...

    def expire_queued(self, max_queued_s: float) -> list[str]:
        """Fail (`queue_timeout`) the jobs still queued `max_queued_s` after they were created; their ids."""
        ...

    def purge_media(self) -> int:
        """Drop the uploads of jobs that are finished or deleted (a queued or running job keeps its own: a retry
        runs from them); how many were dropped."""
        ...

    def queue_stats(self, model: str) -> QueueStats: ...

    def close(self) -> None: ...


class Transaction(Protocol):
    """One open transaction: `fetch` runs a statement with `?` placeholders and returns its rows."""

    def fetch(self, sql: str, params: Sequence[object] = ()) -> list[Row]: ...


_COLUMNS = (
    "seq", "id", "owner", "model", "status", "progress", "step", "num_steps", "spec", "created_at", "started_at",
    "completed_at", "error_code", "error_message", "timings", "stats", "output_key", "output_expires_at",
    "attempts", "lease_owner", "lease_expires_at", "cancel_requested",
)
# jobs_ahead: the queue position, derived (never stored, so it cannot go stale).
_SELECT_JOBS = (
    "SELECT " + ", ".join(f"j.{c}" for c in _COLUMNS) + ", CASE WHEN j.status = 'queued' THEN "
    "(SELECT COUNT(*) FROM video_jobs q WHERE q.model = j.model AND q.status = 'queued' AND q.seq < j.seq) "
    "END AS jobs_ahead FROM video_jobs j"
)
_RUNNING_IS_MINE = "id = ? AND lease_owner = ? AND status = 'in_progress'"


def _schema(seq_column: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS video_jobs (
            {seq_column},
            id TEXT NOT NULL UNIQUE,
            owner TEXT,
            model TEXT NOT NULL,
            status TEXT NOT NULL,
            progress INTEGER NOT NULL DEFAULT 0,
            step INTEGER NOT NULL DEFAULT 0,
            num_steps INTEGER NOT NULL,
            seconds DOUBLE PRECISION NOT NULL,
            size TEXT NOT NULL,
            spec TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            started_at DOUBLE PRECISION,
            completed_at DOUBLE PRECISION,
            error_code TEXT,
            error_message TEXT,
            timings TEXT,
            stats TEXT,
            output_key TEXT,
            output_expires_at DOUBLE PRECISION,
            attempts INTEGER NOT NULL DEFAULT 0,
            lease_owner TEXT,
            lease_expires_at DOUBLE PRECISION,
            cancel_requested INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX IF NOT EXISTS video_jobs_queue ON video_jobs (model, status, seq)",
        "CREATE INDEX IF NOT EXISTS video_jobs_owner ON video_jobs (owner, seq)",
        "CREATE INDEX IF NOT EXISTS video_jobs_lease ON video_jobs (status, lease_expires_at)",
        # A job's uploads (`jobs.media.VideoMedia` as JSON, bytes base64), apart from the record so reading and
        # listing jobs never loads them; only the claim that runs the job reads them (`purge_media` drops them
        # once the job is finished).
        "CREATE TABLE IF NOT EXISTS video_job_media (job_id TEXT PRIMARY KEY, media TEXT NOT NULL)",
    ]


Reported = TypeVar("Reported", VideoTimings, VideoStats)


def reported_from_json(model: type[Reported], text: str) -> Reported:
    """A job's stored timings or stats, keeping the fields this code knows. A replica of a newer ditserve may share
    the store (a rolling update, a rollback) and write counters this one has no field for: a report, so they are
    left out, not a failed read of the job. (The spec stays strict: a request field dropped would run another job.)"""
    data = json.loads(text)
    return model.model_validate({name: value for name, value in data.items() if name in model.model_fields})


def _record(row: Row) -> JobRecord:
    error = None
    if row["error_code"] is not None:
        error = JobError(code=str(row["error_code"]), message=str(row["error_message"] or ""))
    timings = reported_from_json(VideoTimings, str(row["timings"])) if row["timings"] is not None else None
    stats = reported_from_json(VideoStats, str(row["stats"])) if row["stats"] is not None else None
    return JobRecord(
        id=str(row["id"]),
        seq=int(row["seq"]),
        owner=None if row["owner"] is None else str(row["owner"]),
        status=JobStatus(str(row["status"])),
        spec=VideoSpec.model_validate_json(str(row["spec"])),
        progress=int(row["progress"]),
        step=int(row["step"]),
        num_steps=int(row["num_steps"]),
        created_at=float(row["created_at"]),
        started_at=_float_or_none(row["started_at"]),
        completed_at=_float_or_none(row["completed_at"]),
        error=error,
        timings=timings,
        stats=stats,
        output_key=None if row["output_key"] is None else str(row["output_key"]),
        output_expires_at=_float_or_none(row["output_expires_at"]),
        attempts=int(row["attempts"]),
        lease_owner=None if row["lease_owner"] is None else str(row["lease_owner"]),
        lease_expires_at=_float_or_none(row["lease_expires_at"]),
        cancel_requested=bool(row["cancel_requested"]),
        jobs_ahead=None if row["jobs_ahead"] is None else int(row["jobs_ahead"]),
    )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _lease_status(rows: list[Row]) -> LeaseStatus:
    if not rows:
        return LeaseStatus.LOST
    return LeaseStatus.CANCEL_REQUESTED if rows[0]["cancel_requested"] else LeaseStatus.HELD


class SqlJobStore(ABC):
    """`JobStore` over SQL. Subclasses provide `_transaction` and the dialect hooks below."""

    #: DDL of the creation-order column (an ever-increasing integer key).
    SEQ_COLUMN: str
    #: Appended to a SELECT of rows updated next in the same transaction, where other transactions' rows are
    #: skipped (the claim's pick, the reaper's scan): how concurrent replicas stay off each other's rows.
    SKIP_LOCKED: str = ""
    #: Appended to a single-row SELECT whose row is updated next in the same transaction.
    ROW_LOCK: str = ""

    def __init__(self, clock: Clock = time.time) -> None:
        self._clock = clock

    @abstractmethod
    def _transaction(self, write: bool) -> AbstractContextManager[Transaction]:
        """A transaction that commits on success and rolls back on an exception. `write`: it will write, so
        take the write lock up front (no lock upgrades, no deadlocks between replicas)."""

    def _lock_queue(self, tx: Transaction, model: str) -> None:
        """Serialize admission for `model` (count + insert) against other transactions; no-op where a write
        transaction is already exclusive."""

    def _lock_schema(self, tx: Transaction) -> None:
        """Serialize schema creation against other processes creating it at the same time."""

    def _create_schema(self) -> None:
        with self._transaction(write=True) as tx:
            self._lock_schema(tx)
            for statement in _schema(self.SEQ_COLUMN):
                tx.fetch(statement)

    # --- Reads ------------------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord | None:
        with self._transaction(write=False) as tx:
            return self._get(tx, job_id)

    def _get(self, tx: Transaction, job_id: str) -> JobRecord | None:
        rows = tx.fetch(_SELECT_JOBS + " WHERE j.id = ?", (job_id,))
        return _record(rows[0]) if rows else None

    def list_jobs(self, owner: str | None, limit: int, after: str | None = None) -> JobPage:
        if limit < 1:
            raise ValueError(f"limit={limit} must be at least 1")
        conditions: list[str] = []
        params: list[object] = []
        with self._transaction(write=False) as tx:
            if owner is not None:
                conditions.append("j.owner = ?")
                params.append(owner)
            if after is not None:
                cursor = tx.fetch("SELECT seq, owner FROM video_jobs WHERE id = ?", (after,))
                if not cursor or (owner is not None and cursor[0]["owner"] != owner):
                    raise JobNotFound(after)
                conditions.append("j.seq < ?")
                params.append(cursor[0]["seq"])
            where = " WHERE " + " AND ".join(conditions) if conditions else ""
            rows = tx.fetch(_SELECT_JOBS + where + " ORDER BY j.seq DESC LIMIT ?", (*params, limit + 1))
        return JobPage(jobs=[_record(r) for r in rows[:limit]], has_more=len(rows) > limit)

    def queue_stats(self, model: str) -> QueueStats:
        with self._transaction(write=False) as tx:
            counts = tx.fetch(
                "SELECT status, COUNT(*) AS n FROM video_jobs WHERE model = ? AND status IN ('queued', 'in_progress') "
                "GROUP BY status", (model,),
            )
            runs = tx.fetch(
                "SELECT completed_at - started_at AS run_s FROM video_jobs WHERE model = ? AND status = 'completed' "
                "AND started_at IS NOT NULL ORDER BY seq DESC LIMIT ?", (model, RECENT_RUNS),
            )
        by_status = {str(r["status"]): int(r["n"]) for r in counts}
        run_s = [float(r["run_s"]) for r in runs]
        return QueueStats(
            num_queued=by_status.get("queued", 0), num_running=by_status.get("in_progress", 0),
            mean_run_s=sum(run_s) / len(run_s) if run_s else None,
        )

    # --- Client operations ------------------------------------------------------------------------------

    def create(self, spec: VideoSpec, owner: str | None, max_queued: int) -> JobRecord:
        job_id = new_job_id()
        with self._transaction(write=True) as tx:
            self._lock_queue(tx, spec.model)
            rows = tx.fetch(
                "SELECT COUNT(*) AS n FROM video_jobs WHERE model = ? AND status = 'queued'", (spec.model,)
            )
            num_queued = int(rows[0]["n"])
            if num_queued >= max_queued:
                raise QueueFull(spec.model, num_queued, max_queued)
            tx.fetch(
                "INSERT INTO video_jobs (id, owner, model, status, num_steps, seconds, size, spec, created_at) "
                "VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?)",
                (job_id, owner, spec.model, spec.num_inference_steps, spec.seconds, spec.size,
                 spec.model_dump_json(), self._clock()),
            )
            if spec.media is not None:
                tx.fetch("INSERT INTO video_job_media (job_id, media) VALUES (?, ?)",
                         (job_id, spec.media.model_dump_json()))
            record = self._get(tx, job_id)
        assert record is not None  # inserted in this transaction
        return record

    def cancel(self, job_id: str) -> JobRecord:
        with self._transaction(write=True) as tx:
            rows = tx.fetch("SELECT status FROM video_jobs WHERE id = ?" + self.ROW_LOCK, (job_id,))
            if not rows:
                raise JobNotFound(job_id)
            status = JobStatus(str(rows[0]["status"]))
            if status is JobStatus.QUEUED:
                tx.fetch(
                    "UPDATE video_jobs SET status = 'cancelled', completed_at = ? WHERE id = ?",
                    (self._clock(), job_id),
                )
            elif status is JobStatus.IN_PROGRESS:
                tx.fetch("UPDATE video_jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
            else:
                raise JobConflict(job_id, status, f"video job {job_id!r} is already {status}; nothing to cancel")
            record = self._get(tx, job_id)
        assert record is not None
        return record

    def delete(self, job_id: str) -> JobRecord | None:
        with self._transaction(write=True) as tx:
            # Lock first, then read: a write in flight (the runner's complete) lands before we read, so the
            # record answered carries the output key the caller must delete.
            tx.fetch("SELECT id FROM video_jobs WHERE id = ?" + self.ROW_LOCK, (job_id,))
            record = self._get(tx, job_id)
            if record is not None:
                tx.fetch("DELETE FROM video_jobs WHERE id = ?", (job_id,))
                tx.fetch("DELETE FROM video_job_media WHERE job_id = ?", (job_id,))
        return record

    # --- Runner operations ------------------------------------------------------------------------------

    def claim(self, models: Sequence[str], lease_owner: str, lease_s: float) -> JobRecord | None:
        if not models:
            return None
        now = self._clock()
        marks = ", ".join("?" for _ in models)
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                "UPDATE video_jobs SET status = 'in_progress', started_at = ?, attempts = attempts + 1, step = 0, "
                "progress = 0, lease_owner = ?, lease_expires_at = ? "
                f"WHERE seq = (SELECT seq FROM video_jobs WHERE status = 'queued' AND model IN ({marks}) "
                f"ORDER BY seq LIMIT 1{self.SKIP_LOCKED}) AND status = 'queued' RETURNING id",
                (now, lease_owner, now + lease_s, *models),
            )
            if not rows:
                return None
            record = self._get(tx, str(rows[0]["id"]))
            assert record is not None  # claimed in this transaction
            media = tx.fetch("SELECT media FROM video_job_media WHERE job_id = ?", (record.id,))
        if media:
            spec = record.spec.model_copy(update={"media": VideoMedia.model_validate_json(str(media[0]["media"]))})
            record = dataclasses.replace(record, spec=spec)
        return record

    def purge_media(self) -> int:
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                "DELETE FROM video_job_media WHERE job_id NOT IN "
                "(SELECT id FROM video_jobs WHERE status IN ('queued', 'in_progress')) RETURNING job_id")
        return len(rows)

    def renew_lease(self, job_id: str, lease_owner: str, lease_s: float) -> LeaseStatus:
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                f"UPDATE video_jobs SET lease_expires_at = ? WHERE {_RUNNING_IS_MINE} RETURNING cancel_requested",
                (self._clock() + lease_s, job_id, lease_owner),
            )
        return _lease_status(rows)

    def set_progress(self, job_id: str, lease_owner: str, step: int, num_steps: int, lease_s: float) -> LeaseStatus:
        if not 0 <= step <= num_steps or num_steps < 1:
            raise ValueError(f"step={step} must be within 0..num_steps={num_steps} (num_steps >= 1)")
        progress = min(99, step * 100 // num_steps)  # 100 means the MP4 is ready, not the last step
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                "UPDATE video_jobs SET step = ?, num_steps = ?, progress = ?, lease_expires_at = ? "
                f"WHERE {_RUNNING_IS_MINE} RETURNING cancel_requested",
                (step, num_steps, progress, self._clock() + lease_s, job_id, lease_owner),
            )
        return _lease_status(rows)

    def complete(
        self, job_id: str, lease_owner: str, output_key: str, timings: VideoTimings, stats: VideoStats,
        retention_s: float,
    ) -> bool:
        now = self._clock()
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                "UPDATE video_jobs SET status = 'completed', progress = 100, completed_at = ?, output_key = ?, "
                "output_expires_at = ?, timings = ?, stats = ?, lease_owner = NULL, lease_expires_at = NULL "
                f"WHERE {_RUNNING_IS_MINE} AND cancel_requested = 0 RETURNING id",
                (now, output_key, now + retention_s, timings.model_dump_json(), stats.model_dump_json(),
                 job_id, lease_owner),
            )
        return bool(rows)

    def fail(self, job_id: str, lease_owner: str, error: JobError) -> bool:
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                "UPDATE video_jobs SET status = 'failed', completed_at = ?, error_code = ?, error_message = ?, "
                f"lease_owner = NULL, lease_expires_at = NULL WHERE {_RUNNING_IS_MINE} RETURNING id",
                (self._clock(), error.code, error.message, job_id, lease_owner),
            )
        return bool(rows)

    def finish_cancelled(self, job_id: str, lease_owner: str) -> bool:
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                "UPDATE video_jobs SET status = 'cancelled', completed_at = ?, lease_owner = NULL, "
                f"lease_expires_at = NULL WHERE {_RUNNING_IS_MINE} RETURNING id",
                (self._clock(), job_id, lease_owner),
            )
        return bool(rows)

    def release(self, job_id: str, lease_owner: str, max_attempts: int, cause: str = RELEASE_CAUSE) -> JobStatus | None:
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                f"SELECT id, lease_owner, step, num_steps, attempts, cancel_requested FROM video_jobs "
                f"WHERE {_RUNNING_IS_MINE}" + self.ROW_LOCK, (job_id, lease_owner),
            )
            return self._lose(tx, rows[0], cause, max_attempts) if rows else None

    # --- Housekeeping -----------------------------------------------------------------------------------

    def reap(self, max_attempts: int) -> ReapReport:
        retried: list[str] = []
        failed: list[str] = []
        cancelled: list[str] = []
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                "SELECT id, lease_owner, step, num_steps, attempts, cancel_requested FROM video_jobs "
                "WHERE status = 'in_progress' AND lease_expires_at < ? ORDER BY seq" + self.SKIP_LOCKED,
                (self._clock(),),
            )
            for row in rows:
                outcome = self._lose(tx, row, REAP_CAUSE, max_attempts)
                {JobStatus.QUEUED: retried, JobStatus.FAILED: failed, JobStatus.CANCELLED: cancelled}[outcome].append(
                    str(row["id"])
                )
        return ReapReport(retried=retried, failed=failed, cancelled=cancelled)

    def _lose(self, tx: Transaction, row: Row, cause: str, max_attempts: int) -> JobStatus:
        """A running job its runner no longer holds (row selected and locked in this transaction)."""
        step, num_steps, attempts = int(row["step"]), int(row["num_steps"]), int(row["attempts"])
        params_tail = (row["id"], row["lease_owner"])
        if row["cancel_requested"]:
            tx.fetch(
                "UPDATE video_jobs SET status = 'cancelled', completed_at = ?, lease_owner = NULL, "
                f"lease_expires_at = NULL WHERE {_RUNNING_IS_MINE}", (self._clock(), *params_tail),
            )
            return JobStatus.CANCELLED
        if step == 0 and attempts < max_attempts:
            # Nothing was computed: run it again, at its old place in line (seq is unchanged).
            tx.fetch(
                "UPDATE video_jobs SET status = 'queued', started_at = NULL, lease_owner = NULL, "
                f"lease_expires_at = NULL WHERE {_RUNNING_IS_MINE}", params_tail,
            )
            return JobStatus.QUEUED
        if step == 0:
            message = f"lost before its first step on each of its {attempts} runs: {cause}"
        else:
            message = f"lost at step {step}/{num_steps} of run {attempts}: {cause}"
        tx.fetch(
            "UPDATE video_jobs SET status = 'failed', completed_at = ?, error_code = 'worker_lost', "
            f"error_message = ?, lease_owner = NULL, lease_expires_at = NULL WHERE {_RUNNING_IS_MINE}",
            (self._clock(), message, *params_tail),
        )
        return JobStatus.FAILED

    def expire_queued(self, max_queued_s: float) -> list[str]:
        now = self._clock()
        message = (f"queued for more than jobs.max_queued_s={max_queued_s:g} s: no replica serving its model took "
                   "it (is the model still served?)")
        with self._transaction(write=True) as tx:  # a row a claim holds is re-checked once it commits
            rows = tx.fetch(
                "UPDATE video_jobs SET status = 'failed', completed_at = ?, error_code = 'queue_timeout', "
                "error_message = ? WHERE status = 'queued' AND created_at <= ? RETURNING id",
                (now, message, now - max_queued_s),
            )
        return [str(row["id"]) for row in rows]

    def expire_outputs(self) -> list[str]:
        keys: list[str] = []
        with self._transaction(write=True) as tx:
            rows = tx.fetch(
                "SELECT id, output_key FROM video_jobs WHERE status = 'completed' AND output_key IS NOT NULL "
                "AND output_expires_at <= ? ORDER BY seq" + self.SKIP_LOCKED,
                (self._clock(),),
            )
            for row in rows:  # RETURNING shows the new (NULL) key: forget each key we read, if still set
                if tx.fetch(
                    "UPDATE video_jobs SET output_key = NULL WHERE id = ? AND output_key = ? RETURNING id",
                    (row["id"], row["output_key"]),
                ):
                    keys.append(str(row["output_key"]))
        return keys


def open_job_store(database_url: str, clock: Clock = time.time) -> JobStore:
    """`sqlite:///PATH` or `postgresql://...` -> a store with its schema created."""
    if database_url.startswith("sqlite:///"):
        from jobs.sqlite_store import SqliteJobStore

        return SqliteJobStore(database_url.removeprefix("sqlite:///"), clock=clock)
    if database_url.startswith(("postgresql://", "postgres://")):
        from jobs.postgres_store import PostgresJobStore  # psycopg only where PostgreSQL is used

        return PostgresJobStore(database_url, clock=clock)
    raise ValueError(f"database_url={database_url!r}: expected sqlite:///PATH or postgresql://...")
