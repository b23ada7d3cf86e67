"""What the job store keeps about a video job, and the small results of its operations.

Life of a job (every transition is one atomic statement or transaction in the store):

    queued --claim--> in_progress --complete--> completed
      |                   |-----fail--------> failed
      |                   |-----(cancel flag, runner stops)--> cancelled
      |                   '-----lease expired: no step ran and runs left --> queued (same place in line)
      |                                        otherwise --> failed (code worker_lost)
      '--cancel--> cancelled

A running job belongs to the runner holding its lease (`lease_owner`, a token unique per claim); only that
runner's writes land, so a runner that lost its lease (paused, partitioned) cannot overwrite the outcome.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass

from jobs.backend import VideoSpec, VideoStats, VideoTimings

__all__ = [
    "JOB_ID_PREFIX",
    "JobError",
    "JobPage",
    "JobRecord",
    "JobStatus",
    "LeaseStatus",
    "QueueStats",
    "ReapReport",
    "new_job_id",
]

JOB_ID_PREFIX = "video_"


def new_job_id() -> str:
    """`video_` + 128 random bits, URL-safe base64 (22 characters): unguessable, safe in paths and file names."""
    return JOB_ID_PREFIX + secrets.token_urlsafe(16)


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


class LeaseStatus(enum.Enum):
    """What a runner learns when it renews its lease or writes progress."""

    HELD = "held"  # still ours, carry on
    CANCEL_REQUESTED = "cancel_requested"  # still ours, but stop at the next step
    LOST = "lost"  # deleted, reaped, or claimed by another runner: stop and write nothing


@dataclass(frozen=True)
class JobError:
    """Why a job failed: `code` is one of invalid_request, server_error, worker_lost, timeout, queue_timeout."""

    code: str
    message: str


@dataclass(frozen=True)
class JobRecord:
    """One video job as stored. Times are Unix seconds (float)."""

    id: str
    seq: int  # creation order: the queue order and the list cursor
    owner: str | None  # API-key hash of the creator; None when auth is off
    status: JobStatus
    spec: VideoSpec
    progress: int  # 0-100; 99 at most until completed
    step: int  # denoising steps done in the current run
    num_steps: int
    created_at: float
    started_at: float | None
    completed_at: float | None
    error: JobError | None
    timings: VideoTimings | None
    stats: VideoStats | None
    output_key: str | None  # set while the outputs exist (completed and not expired)
    output_expires_at: float | None
    attempts: int  # runs started (claims)
    lease_owner: str | None
    lease_expires_at: float | None
    cancel_requested: bool
    jobs_ahead: int | None  # queued: queued jobs of the same model created earlier; else None

    @property
    def model(self) -> str:
        return self.spec.model


@dataclass(frozen=True)
class JobPage:
    """One page of a newest-first listing."""

    jobs: list[JobRecord]
    has_more: bool


@dataclass(frozen=True)
class QueueStats:
    """One model's queue, for admission and Retry-After."""

    num_queued: int
    num_running: int
    mean_run_s: float | None  # over recent completed runs; None before the first


@dataclass(frozen=True)
class ReapReport:
    """Jobs whose lease had expired, by what the reaper did with them."""

    retried: list[str]
    failed: list[str]
    cancelled: list[str]

    @property
    def job_ids(self) -> list[str]:
        return [*self.retried, *self.failed, *self.cancelled]
