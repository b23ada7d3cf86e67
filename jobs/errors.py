"""Errors of the job layer. Each maps to one HTTP status in deployments/videos.py."""

from __future__ import annotations

__all__ = [
    "InvalidVideoRequest",
    "JobConflict",
    "JobNotFound",
    "OutputExpired",
    "QueueFull",
    "StoreUnavailable",
    "UploadTooLarge",
]


class InvalidVideoRequest(ValueError):
    """A request outside the model's limits (422). `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UploadTooLarge(InvalidVideoRequest):
    """An uploaded file over the per-file limit (413), refused before anything decodes it."""


class JobNotFound(LookupError):
    """No such job, or not the caller's (404: one client cannot probe another's ids)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no video job with id {job_id!r}")
        self.job_id = job_id


class JobConflict(Exception):
    """The job is in the wrong state for the operation (409): cancel of a finished job, content of an
    unfinished one."""

    def __init__(self, job_id: str, status: str, message: str) -> None:
        super().__init__(message)
        self.job_id, self.status = job_id, status


class OutputExpired(Exception):
    """A completed job whose output was deleted by retention (410)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"the output of video job {job_id!r} expired and was deleted")
        self.job_id = job_id


class QueueFull(Exception):
    """The model's queue is at its bound (429 with Retry-After)."""

    def __init__(self, model: str, num_queued: int, limit: int, retry_after_s: int | None = None) -> None:
        super().__init__(
            f"the queue of model {model!r} is full ({num_queued} queued, max_queued_per_model={limit}); retry later"
        )
        self.model, self.num_queued, self.limit, self.retry_after_s = model, num_queued, limit, retry_after_s


class StoreUnavailable(RuntimeError):
    """The job database cannot be reached (503)."""
