"""What the job service tells a metrics sink: jobs created, jobs finished (by outcome), queue depth per model.

The job layer stays free of Ray: `JobService(metrics=...)` takes any `JobMetrics`; the Serve ingress passes
`deployments.metrics.VideoJobMetrics` (Ray's counters and gauges), tests a recording fake, everyone else gets
`NO_JOB_METRICS`. Each outcome is reported once, by the replica whose store write settled the job (its runner,
a cancel, or the reaper of any replica), so summing over replicas counts every job once. Queue depth is the
store's, shared by every replica: each reports the same number (read it with `max`, not `sum`).

Calls come from the service's event loop and must not block or raise.
"""

from __future__ import annotations

import enum
from typing import Protocol

__all__ = ["JobMetrics", "JobOutcome", "NO_JOB_METRICS", "NoJobMetrics"]


class JobOutcome(enum.StrEnum):
    """How a job ended."""

    SUCCEEDED = "succeeded"  # completed, its MP4 stored
    FAILED = "failed"  # any error code but queue_timeout (invalid_request, server_error, worker_lost, timeout)
    CANCELLED = "cancelled"  # cancelled, or deleted before it finished
    EXPIRED = "expired"  # queued past jobs.max_queued_s without a replica taking it (queue_timeout)


class JobMetrics(Protocol):
    def job_created(self, model: str) -> None:
        """A job was queued."""

    def job_finished(self, model: str, outcome: JobOutcome) -> None:
        """A job reached its final state."""

    def queue_depth(self, model: str, num_queued: int) -> None:
        """The model's queued (not yet started) jobs, as the store counted them just now."""


class NoJobMetrics:
    """Records nothing: the default of a service run without Serve."""

    def job_created(self, model: str) -> None:
        pass

    def job_finished(self, model: str, outcome: JobOutcome) -> None:
        pass

    def queue_depth(self, model: str, num_queued: int) -> None:
        pass


NO_JOB_METRICS: JobMetrics = NoJobMetrics()
