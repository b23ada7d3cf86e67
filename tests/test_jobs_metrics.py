"""What the job service reports to its `JobMetrics`: every job created, and finished exactly once with its
outcome, on every path a job can end by (its runner, a cancel, a delete, the reaper, expiry); the queue depth
rising and falling with the store's queue. A recording fake stands in for the Serve metrics; SQLite, no Ray.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from jobs.errors import QueueFull
from jobs.metrics import JobOutcome
from jobs.outputs import OutputStore
from jobs.records import JobStatus
from jobs.service import JobService
from jobs.store import open_job_store
from tests.jobs_support import FakeClock, FakeVideoBackend
from tests.test_jobs_service import TINY, fast_config, finished, make_spec, wait_for_job, wait_until

pytestmark = pytest.mark.timeout(120)


class RecordingJobMetrics:
    """A `JobMetrics` that keeps every report in order."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self.finished: list[tuple[str, JobOutcome]] = []
        self.depths: dict[str, list[int]] = {}

    def job_created(self, model: str) -> None:
        self.created.append(model)

    def job_finished(self, model: str, outcome: JobOutcome) -> None:
        self.finished.append((model, outcome))

    def queue_depth(self, model: str, num_queued: int) -> None:
        self.depths.setdefault(model, []).append(num_queued)

    def depth(self, model: str = "tiny") -> int | None:
        """The last depth reported for `model` (None: none yet)."""
        return self.depths[model][-1] if self.depths.get(model) else None


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'jobs.sqlite3'}"


def make_service(sqlite_url: str, tmp_path: Path, backend: FakeVideoBackend, metrics: RecordingJobMetrics,
                 clock: FakeClock | None = None, **config: float) -> JobService:
    store = open_job_store(sqlite_url, clock=clock) if clock else open_job_store(sqlite_url)
    return JobService(store=store, outputs=OutputStore(str(tmp_path / "outputs")), backend=backend, models=[TINY],
                      config=fast_config(tmp_path, **config), metrics=metrics)


async def run_to_the_end(service: JobService, prompt: str) -> JobStatus:
    job = await service.submit(make_spec(prompt=prompt), None)
    await service.start()
    try:
        return (await wait_for_job(service, job.id, finished, "the job to finish")).status
    finally:
        await service.stop()


@pytest.mark.parametrize(("prompt", "status", "outcome"), [
    ("a lighthouse", JobStatus.COMPLETED, JobOutcome.SUCCEEDED),
    ("fail:request", JobStatus.FAILED, JobOutcome.FAILED),  # invalid_request
    ("fail:server", JobStatus.FAILED, JobOutcome.FAILED),  # server_error
    ("fail:crash", JobStatus.FAILED, JobOutcome.FAILED),  # a plain exception: server_error
    ("fail:worker@3", JobStatus.FAILED, JobOutcome.FAILED),  # worker_lost after steps ran
    ("fail:worker@1", JobStatus.FAILED, JobOutcome.FAILED),  # lost before any step on each run: no runs left
    ("fail:worker-once@1", JobStatus.COMPLETED, JobOutcome.SUCCEEDED),  # retried once: one outcome, not two
])
def test_a_run_reports_its_outcome_once(sqlite_url, tmp_path, prompt, status, outcome):
    async def scenario():
        metrics = RecordingJobMetrics()
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(), metrics)
        assert await run_to_the_end(service, prompt) is status
        assert metrics.created == ["tiny"]
        assert metrics.finished == [("tiny", outcome)]

    asyncio.run(scenario())


def test_a_run_over_max_run_s_is_failed(sqlite_url, tmp_path):
    async def scenario():
        metrics = RecordingJobMetrics()
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(step_s=0.2), metrics, max_run_s=0.1)
        assert await run_to_the_end(service, "slow") is JobStatus.FAILED
        assert metrics.finished == [("tiny", JobOutcome.FAILED)]

    asyncio.run(scenario())


@pytest.mark.parametrize("operation", [JobService.cancel, JobService.delete], ids=["cancel", "delete"])
def test_a_queued_job_cancelled_or_deleted_is_cancelled_once(sqlite_url, tmp_path, operation):
    async def scenario():
        metrics = RecordingJobMetrics()
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(), metrics)  # not started: stays queued
        job = await service.submit(make_spec(), None)
        await operation(service, job.id, None)
        assert metrics.finished == [("tiny", JobOutcome.CANCELLED)]
        await wait_until(lambda: metrics.depth() == 0, "the queue depth to fall back to 0")

    asyncio.run(scenario())


@pytest.mark.parametrize("operation", [JobService.cancel, JobService.delete], ids=["cancel", "delete"])
def test_a_running_job_cancelled_or_deleted_is_cancelled_once(sqlite_url, tmp_path, operation):
    """Cancel: its runner settles it at the next step. Delete: the delete settles it, the runner (its job gone)
    writes and reports nothing."""
    async def scenario():
        metrics = RecordingJobMetrics()
        backend = FakeVideoBackend(hold_before_step=2)
        service = make_service(sqlite_url, tmp_path, backend, metrics)
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            await wait_for_job(service, job.id, lambda r: r.step == 1, "step 1")
            await operation(service, job.id, None)
            await wait_until(lambda: service.num_running == 0, "the run to stop")
        finally:
            await service.stop()
        assert metrics.finished == [("tiny", JobOutcome.CANCELLED)]

    asyncio.run(scenario())


def test_a_cancelled_or_deleted_finished_job_reports_nothing_more(sqlite_url, tmp_path):
    async def scenario():
        metrics = RecordingJobMetrics()
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(), metrics)
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            await wait_for_job(service, job.id, finished, "completion")
        finally:
            await service.stop()
        await service.delete(job.id, None)
        assert metrics.finished == [("tiny", JobOutcome.SUCCEEDED)]

    asyncio.run(scenario())


def test_a_job_queued_past_max_queued_s_is_expired(sqlite_url, tmp_path):
    async def scenario():
        metrics = RecordingJobMetrics()
        clock = FakeClock()
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(), metrics, clock=clock, max_queued_s=60.0)
        old = await service.submit(make_spec(prompt="old"), None)
        clock.advance(30)
        await service.submit(make_spec(prompt="young"), None)
        clock.advance(31)
        await service.reap_once()
        assert (await service.get(old.id, None)).status is JobStatus.FAILED
        assert metrics.finished == [("tiny", JobOutcome.EXPIRED)]  # the young job waits on
        assert metrics.depth() == 1  # the reap reports every served model's depth

    asyncio.run(scenario())


@pytest.mark.parametrize(("cancel_requested", "outcome"), [
    (False, JobOutcome.FAILED),  # a step had run: worker_lost
    (True, JobOutcome.CANCELLED),
])
def test_a_job_whose_replica_vanished_is_settled_by_the_reaper(sqlite_url, tmp_path, cancel_requested, outcome):
    """Another replica claimed it, ran a step and stopped renewing its lease: this replica's reaper settles it."""
    async def scenario():
        metrics = RecordingJobMetrics()
        clock = FakeClock()
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(), metrics, clock=clock)
        job = await service.submit(make_spec(), None)
        store = service._store
        store.claim(["tiny"], "vanished-replica/1", 10)
        store.set_progress(job.id, "vanished-replica/1", 1, 4, 10)
        if cancel_requested:
            store.cancel(job.id)
        clock.advance(11)
        report = await service.reap_once()
        assert report.job_ids == [job.id]
        assert metrics.finished == [("tiny", outcome)]

    asyncio.run(scenario())


def test_stopping_mid_job_without_runs_left_reports_it_failed(sqlite_url, tmp_path):
    """A replica stopping gives its running job back: requeued while no step ran and runs are left (no outcome),
    failed once steps ran."""
    async def scenario():
        metrics = RecordingJobMetrics()
        backend = FakeVideoBackend(hold_before_step=2)
        service = make_service(sqlite_url, tmp_path, backend, metrics)
        job = await service.submit(make_spec(), None)
        await service.start()
        await wait_for_job(service, job.id, lambda r: r.step == 1, "step 1")
        await service.stop()
        assert (await service.get(job.id, None)).status is JobStatus.FAILED
        assert metrics.finished == [("tiny", JobOutcome.FAILED)]

    asyncio.run(scenario())


def test_the_queue_depth_rises_with_submits_and_falls_with_claims_and_cancels(sqlite_url, tmp_path):
    async def scenario():
        metrics = RecordingJobMetrics()
        backend = FakeVideoBackend(hold_before_step=1)
        service = make_service(sqlite_url, tmp_path, backend, metrics, max_queued_per_model=3)
        jobs = [await service.submit(make_spec(prompt=f"p{i}"), None) for i in range(3)]
        await wait_until(lambda: metrics.depth() == 3, "the depth to reach 3")
        with pytest.raises(QueueFull):
            await service.submit(make_spec(prompt="one too many"), None)
        assert metrics.depth() == 3  # the refusal reports the full queue
        await service.cancel(jobs[2].id, None)
        await wait_until(lambda: metrics.depth() == 2, "the depth to fall to 2 after a cancel")
        await service.start()
        try:
            await wait_until(lambda: metrics.depth() == 1, "the depth to fall to 1 once a runner claims a job")
            backend.release()
            for job in jobs[:2]:
                await wait_for_job(service, job.id, finished, "completion")
            await wait_until(lambda: metrics.depth() == 0, "the depth to fall to 0")
        finally:
            await service.stop()
        assert max(metrics.depths["tiny"]) == 3 and set(metrics.depths) == {"tiny"}
        assert Counter(outcome for _, outcome in metrics.finished) == {
            JobOutcome.SUCCEEDED: 2, JobOutcome.CANCELLED: 1,
        }
        assert len(metrics.created) == len(metrics.finished)  # every job created ends once

    asyncio.run(scenario())

