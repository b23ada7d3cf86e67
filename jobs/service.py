"""The job service an ingress replica runs: admission, the runner loop, cancellation, the reaper, retention.

Every replica of the ingress runs one `JobService` on the same database and output store; they coordinate
only through the store's atomic operations:

- **Admission**: `submit` inserts a queued job unless the model's queue holds `max_queued_per_model`
  (QueueFull, with a Retry-After estimated from recent run times).
- **Runners**: `concurrency` tasks per replica, each claiming the oldest queued job under a lease and calling
  the `VideoBackend`. When the backend reports the denoiser done with a job (`VideoRun.denoised`), its runner
  claims the next job while the first one decodes and uploads (at most one such job per runner): decode of
  job k overlaps denoise of job k+1. A lease keeper renews the lease and writes progress after each step; when the store
  answers CANCEL_REQUESTED or LOST, `cancelled()` turns True and the backend stops at its next step. Outputs
  go under a key unique to the run, so a run that lost its lease can never delete the outputs of the run that
  replaced it.
- **A worker that died** (`VideoWorkerLost`): the job runs again (same place in line) when no denoising step
  had run and runs are left, else it fails with code `worker_lost` and the cause.
- **Reaper**: every `reap_interval_s`, jobs whose lease expired are retried (no step had run) or failed with
  the cause, and outputs past retention are deleted (their keys forgotten first, files second: a crash in
  between leaves an orphan file, never a record pointing at nothing).
- **Watching**: `watch` yields a job each time it changes (status, progress), woken at once by this
  replica's runners and by polling for the others.
- **Metrics** (`jobs.metrics.JobMetrics`): jobs created, each job's outcome reported by the replica whose store
  write settled it, and the queue depth of a model read from the store after each change seen here and at
  every reap.

Blocking store and output calls run in threads (`asyncio.to_thread`); the event loop never waits on I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TypeVar

from jobs.backend import (
    VideoBackend,
    VideoCancelled,
    VideoOutput,
    VideoRequestError,
    VideoRun,
    VideoServerError,
    VideoSpec,
    VideoWorkerLost,
)
from engine.limits import ModelLimits
from jobs.config import JobsConfig
from jobs.errors import JobConflict, JobNotFound, OutputExpired, QueueFull, StoreUnavailable
from jobs.events import ChangeFeed
from jobs.model_choice import choose_model
from jobs.limits import resolve_spec
from jobs.media import VideoMedia
from jobs.metrics import NO_JOB_METRICS, JobMetrics, JobOutcome
from jobs.outputs import OutputBlob, OutputMissing, OutputStore, VideoVariant
from jobs.records import JobError, JobPage, JobRecord, JobStatus, LeaseStatus, QueueStats, ReapReport
from jobs.schemas import VideoCreateRequest
from jobs.store import JobStore, open_job_store

__all__ = ["JobService", "open_job_service"]

logger = logging.getLogger("ditserve.jobs")

T = TypeVar("T")
MAX_RETRY_AFTER_S = 3600


class _Run:
    """One claimed job being run by this replica."""

    def __init__(self, job: JobRecord, lease_owner: str, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self.lease_owner = lease_owner
        # Unique per run: a run that lost its lease cleans up only its own files.
        self.output_key = f"{job.id}-{secrets.token_hex(4)}"
        self.progressed = asyncio.Event()
        self.denoised = asyncio.Event()  # the denoiser is done with this job: its runner may claim the next
        self.latest: tuple[int, int] = (0, 0)  # (step, num_steps) as last reported by the backend
        self.max_step = 0  # most steps any report said were done (0: no denoising step ran)
        self.stop_reason: LeaseStatus | None = None
        self.finished = False  # set once the run settled; the lease keeper stops
        self._loop = loop

    def on_progress(self, step: int, num_steps: int) -> None:
        """The backend's progress callback: safe from any thread."""
        self.latest = (step, num_steps)
        self.max_step = max(self.max_step, step)
        self._threadsafe(self.progressed.set)

    def on_denoised(self) -> None:
        """The backend's denoised callback: safe from any thread."""
        self._threadsafe(self.denoised.set)

    def _threadsafe(self, callback: Callable[[], None]) -> None:
        try:
            self._loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop closed (service stopped); the run is being released anyway
            pass

    def backend_run(self) -> VideoRun:
        return VideoRun(job_id=self.job.id, output_key=self.output_key, on_progress=self.on_progress,
                        cancelled=self.cancelled, denoised=self.on_denoised)

    def cancelled(self) -> bool:
        """The backend's cancel check."""
        return self.stop_reason is not None

    def stop(self, reason: LeaseStatus) -> None:
        # LOST wins over CANCEL_REQUESTED: a lost job must not be written at all.
        if self.stop_reason is None or reason is LeaseStatus.LOST:
            self.stop_reason = reason


class JobService:
    """Video jobs on one ingress replica. `start()` launches the runners and the reaper; `stop()` ends them
    and gives unfinished jobs back (requeued when no step ran)."""

    def __init__(
        self,
        *,
        store: JobStore,
        outputs: OutputStore,
        backend: VideoBackend,
        models: Sequence[ModelLimits],
        config: JobsConfig,
        replica_id: str | None = None,
        metrics: JobMetrics = NO_JOB_METRICS,
    ) -> None:
        if not models:
            raise ValueError("models must name at least one served model")
        self._models = {m.name: m for m in models}
        if len(self._models) != len(models):
            raise ValueError(f"model names must be unique, got {[m.name for m in models]}")
        self._store, self._outputs, self._backend, self._config = store, outputs, backend, config
        self._metrics = metrics
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._feed = ChangeFeed()
        self._wake = asyncio.Event()  # set when a job may be claimable (created or retried here)
        self._running: dict[str, _Run] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._runs: set[asyncio.Task[None]] = set()  # every run in flight (denoising or decoding)
        self._depth_wanted: set[str] = set()  # models whose queue depth read is scheduled, not started yet
        self._depth_reads: set[asyncio.Task[None]] = set()

    @property
    def config(self) -> JobsConfig:
        return self._config

    @property
    def models(self) -> list[ModelLimits]:
        return list(self._models.values())

    @property
    def num_running(self) -> int:
        """Jobs this replica is running now."""
        return len(self._running)

    # --- Lifecycle --------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._tasks:
            raise RuntimeError("JobService.start() called twice")
        self._tasks = [
            asyncio.create_task(self._runner(), name=f"video-runner-{i}") for i in range(self._config.concurrency)
        ]
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="video-reaper"))

    async def stop(self) -> None:
        """Cancel the runners (a running job is released: requeued if no step ran, else failed) and the reaper."""
        tasks, self._tasks = self._tasks, []
        tasks += [*self._runs, *self._depth_reads]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- Client operations (the API) --------------------------------------------------------------------

    def resolve(self, request: VideoCreateRequest, media: VideoMedia | None = None) -> VideoSpec:
        """The request (and its uploads) checked against its model's limits (InvalidVideoRequest names field and
        limit)."""
        task = media.task if media is not None else "t2va"
        field = "prompt" if media is None else (media.keyframes or media.references)[0].field
        limits = choose_model(list(self._models.values()), task, request.model, field)  # the task picks the model
        return resolve_spec(request, limits, media=media)

    async def submit(self, spec: VideoSpec, owner: str | None) -> JobRecord:
        """Queue a job once the backend accepts it (InvalidVideoRequest otherwise); QueueFull (with
        retry_after_s) when the model's queue is at its bound."""
        await self._backend.validate(spec)
        try:
            record = await asyncio.to_thread(self._store.create, spec, owner, self._config.max_queued_per_model)
        except QueueFull as full:
            stats = await asyncio.to_thread(self._store.queue_stats, spec.model)
            self._metrics.queue_depth(spec.model, stats.num_queued)
            raise QueueFull(full.model, full.num_queued, full.limit, self.retry_after_s(stats)) from None
        self._wake.set()
        self._metrics.job_created(spec.model)
        self._queue_changed(spec.model)
        return record

    def retry_after_s(self, stats: QueueStats) -> int:
        """Seconds until a queue slot likely frees: a queued job starts when a running one finishes."""
        if stats.mean_run_s is None:
            return self._config.default_retry_after_s
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(stats.mean_run_s / max(1, stats.num_running))))

    async def get(self, job_id: str, owner: str | None) -> JobRecord:
        """JobNotFound for unknown ids and for other owners' jobs (`owner` None: auth is off, all visible)."""
        record = await asyncio.to_thread(self._store.get, job_id)
        if record is None or not _visible(record, owner):
            raise JobNotFound(job_id)
        return record

    async def list_jobs(self, owner: str | None, limit: int, after: str | None = None) -> JobPage:
        return await asyncio.to_thread(self._store.list_jobs, owner, limit, after)

    async def cancel(self, job_id: str, owner: str | None) -> JobRecord:
        """queued -> cancelled; in_progress -> stops at its next step; JobConflict for a finished job."""
        await self.get(job_id, owner)
        record = await asyncio.to_thread(self._store.cancel, job_id)
        run = self._running.get(job_id)
        if run is not None:  # fast path: running here, no need to wait for the next lease write
            run.stop(LeaseStatus.CANCEL_REQUESTED)
        self._feed.notify(job_id)
        if record.status is JobStatus.CANCELLED:  # it was queued; a running one is settled by its runner
            self._metrics.job_finished(record.model, JobOutcome.CANCELLED)
            self._queue_changed(record.model)
        return record

    async def delete(self, job_id: str, owner: str | None) -> JobRecord:
        """Cancel if active, then remove the record and the outputs."""
        await self.get(job_id, owner)
        record = await asyncio.to_thread(self._store.delete, job_id)
        if record is None:
            raise JobNotFound(job_id)
        if not record.status.is_finished:  # its runner (if any) lost the job and writes nothing: settled here
            self._metrics.job_finished(record.model, JobOutcome.CANCELLED)
            if record.status is JobStatus.QUEUED:
                self._queue_changed(record.model)
        run = self._running.get(job_id)
        if run is not None:
            run.stop(LeaseStatus.LOST)
        if record.output_key is not None:
            await asyncio.to_thread(self._outputs.delete, record.output_key)
        self._feed.notify(job_id)
        return record

    async def open_output(self, job_id: str, owner: str | None, variant: VideoVariant) -> OutputBlob:
        """The MP4 or thumbnail of a completed job; JobConflict before completion, OutputExpired after
        retention."""
        record = await self.get(job_id, owner)
        if record.status is not JobStatus.COMPLETED:
            raise JobConflict(
                job_id, record.status, f"video job {job_id!r} is {record.status}; its content exists once completed"
            )
        if record.output_key is None:
            raise OutputExpired(job_id)
        try:
            return await asyncio.to_thread(self._outputs.open, record.output_key, variant)
        except OutputMissing:
            logger.warning("video job %s: output %s is missing from %s", job_id, record.output_key, self._outputs.url)
            raise OutputExpired(job_id) from None

    async def watch(self, job_id: str, owner: str | None) -> AsyncIterator[JobRecord]:
        """The job now, then again each time its status, progress or cancel flag changes, ending with its
        finished state. JobNotFound if it does not exist or is deleted meanwhile."""
        last: tuple[object, ...] | None = None
        with self._feed.subscribe(job_id) as changed:
            while True:
                changed.clear()
                record = await self.get(job_id, owner)
                seen = (record.status, record.progress, record.step, record.cancel_requested, record.attempts)
                if seen != last:
                    last = seen
                    yield record
                if record.status.is_finished:
                    return
                # Woken by this replica's changes; the timeout catches another replica's.
                await _wait_event(changed, self._config.events_poll_s)

    async def wait_finished(self, job_id: str, owner: str | None) -> JobRecord:
        record: JobRecord | None = None
        async for record in self.watch(job_id, owner):
            pass
        assert record is not None  # watch yields at least once or raises
        return record

    # --- Runners ----------------------------------------------------------------------------------------

    async def _runner(self) -> None:
        models = list(self._models)
        detached: asyncio.Task[None] | None = None  # this runner's previous job, still decoding
        while True:
            self._wake.clear()
            lease_owner = f"{self.replica_id}/{secrets.token_hex(4)}"
            try:
                job = await self._claim(models, lease_owner)
            except Exception:  # a runner never dies: the store may be back next time
                logger.exception("claiming a video job failed")
                job = None
            if job is None:
                await _wait_event(self._wake, self._config.poll_s)
                continue
            self._wake.set()  # another runner of this replica may take the next queued job now
            self._queue_changed(job.model)
            run = _Run(job, lease_owner, asyncio.get_running_loop())
            task = asyncio.create_task(self._run_logged(run), name=f"video-run-{job.id}")
            self._runs.add(task)
            task.add_done_callback(self._runs.discard)
            denoised = asyncio.ensure_future(run.denoised.wait())
            try:
                await asyncio.wait({task, denoised}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                denoised.cancel()
            # The job decodes on (or is done): before taking the next one, the previous job this runner left
            # decoding must be done, so one runner holds at most one job denoising and one decoding.
            if detached is not None:
                await asyncio.shield(detached)
            detached = None if task.done() else task

    async def _run_logged(self, run: _Run) -> None:
        try:
            await self._run(run)
        except Exception:  # a bug or a store outage while settling the job: its lease expires, the reaper decides
            logger.exception("running video job %s failed", run.job.id)

    async def _claim(self, models: list[str], lease_owner: str) -> JobRecord | None:
        claim = asyncio.ensure_future(asyncio.to_thread(self._store.claim, models, lease_owner, self._config.lease_s))
        try:
            return await asyncio.shield(claim)
        except asyncio.CancelledError:
            # Stopping while the claim ran in its thread: a job it took goes back now, not at lease expiry.
            job = await claim
            if job is not None:
                await asyncio.to_thread(self._store.release, job.id, lease_owner, self._config.max_attempts)
            raise

    async def _run(self, run: _Run) -> None:
        job = run.job
        self._running[job.id] = run
        self._feed.notify(job.id)
        keeper = asyncio.create_task(self._keep_lease(run), name=f"lease-{job.id}")
        try:
            await self._call_backend(run)
        finally:
            run.finished = True  # the keeper's loop ends even if its cancel is lost
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            if self._running.get(job.id) is run:  # not when this run lost the job and its retry started here
                del self._running[job.id]
            self._feed.notify(job.id)

    async def _call_backend(self, run: _Run) -> None:
        job = run.job
        # One deadline for the whole run, the upload of its output included: the lease keeper renews the lease
        # until the run returns, so nothing in it may wait without bound.
        deadline_at = asyncio.get_running_loop().time() + self._config.max_run_s
        try:
            async with asyncio.timeout_at(deadline_at) as deadline:
                output = await self._backend.run(job.spec, run.backend_run())
        except VideoCancelled:
            await self._cancelled(run)
        except VideoWorkerLost as exc:
            await self._worker_lost(run, str(exc))
        except VideoRequestError as exc:
            await self._fail(run, "invalid_request", str(exc))
        except VideoServerError as exc:
            logger.error("video job %s: backend failed: %s", job.id, exc)
            await self._fail(run, "server_error", str(exc))
        except asyncio.CancelledError:
            await self._give_back(run)
            raise
        except TimeoutError as exc:
            if not deadline.expired():
                logger.exception("video job %s: backend failed", job.id)
                await self._fail(run, "server_error", f"{type(exc).__name__}: {exc}")
            else:
                await self._fail(run, "timeout", f"the run took longer than max_run_s={self._config.max_run_s:g}")
        except Exception as exc:  # any other backend exception is a server fault
            logger.exception("video job %s: backend failed", job.id)
            await self._fail(run, "server_error", f"{type(exc).__name__}: {exc}")
        else:
            try:
                await self._finish(run, output, deadline_at)
            except asyncio.CancelledError:  # stopping while the output is stored or recorded: the same
                await self._give_back(run)
                raise

    async def _give_back(self, run: _Run) -> None:
        """This replica is stopping: give the job back now rather than after its lease expires."""
        release = asyncio.to_thread(self._store.release, run.job.id, run.lease_owner, self._config.max_attempts)
        self._released(run.job.model, await asyncio.shield(release))

    async def _worker_lost(self, run: _Run, cause: str) -> None:
        """The backend's worker died: run the job again if no denoising step had run (runs left), else fail it."""
        job = run.job
        logger.error("video job %s: %s (after %d steps)", job.id, cause, run.max_step)
        if run.max_step > 0:
            _, num_steps = run.latest
            message = f"lost at step {run.max_step}/{num_steps} of run {job.attempts}: {cause}"
            await self._fail(run, "worker_lost", message)
            return
        outcome = await self._write(self._store.release, job.id, run.lease_owner, self._config.max_attempts, cause)
        self._released(job.model, outcome)
        if outcome is JobStatus.QUEUED:
            self._wake.set()
            self._queue_changed(job.model)

    async def _finish(self, run: _Run, output: VideoOutput, deadline_at: float) -> None:
        job = run.job
        if run.stop_reason is not None:  # cancelled or lost after the last step: keep nothing
            await self._cancelled(run)
            return
        timings = output.timings.model_copy(
            update={"queued_s": max(0.0, (job.started_at or job.created_at) - job.created_at)}
        )
        upload = asyncio.timeout_at(deadline_at)
        try:
            start = time.perf_counter()
            async with upload:
                await asyncio.to_thread(self._outputs.put, run.output_key, VideoVariant.VIDEO, output.mp4)
                await asyncio.to_thread(self._outputs.put, run.output_key, VideoVariant.THUMBNAIL, output.thumbnail_png)
            upload_s = time.perf_counter() - start
            timings = timings.model_copy(update={"upload_s": upload_s, "total_s": timings.total_s + upload_s})
        except Exception as exc:  # full disk, unreachable or hung object store: the job fails, the runner goes on
            with contextlib.suppress(Exception):  # best effort: no half-stored outputs left behind
                await asyncio.to_thread(self._outputs.delete, run.output_key)
            if upload.expired():  # a put still hung in its thread may leave an orphan file later
                limit = f"max_run_s={self._config.max_run_s:g}"
                await self._fail(run, "timeout", f"the run took longer than {limit} (storing its output)")
                return
            logger.exception("video job %s: storing its output under %s failed", job.id, self._outputs.url)
            await self._fail(run, "server_error", f"storing the output failed: {type(exc).__name__}: {exc}")
            return
        completed = await self._write(
            self._store.complete, job.id, run.lease_owner, run.output_key, timings, output.stats,
            self._config.retention_s,
        )
        if completed is None:  # no answer from the store: the job may be completed, so its outputs stay (if it is
            return  # not, the reaper fails it and they are an orphan: never a completed job without its MP4)
        if not completed:  # cancelled, deleted or reaped meanwhile: the outputs belong to no job
            await asyncio.to_thread(self._outputs.delete, run.output_key)
            await self._cancelled(run)
            return
        self._metrics.job_finished(job.model, JobOutcome.SUCCEEDED)

    async def _fail(self, run: _Run, code: str, message: str) -> None:
        error = JobError(code=code, message=message)
        if await self._write(self._store.fail, run.job.id, run.lease_owner, error):
            self._metrics.job_finished(run.job.model, JobOutcome.FAILED)

    async def _cancelled(self, run: _Run) -> None:
        """The run stopped for a cancel (or lost its job): settled as cancelled if the job is still ours."""
        if await self._write(self._store.finish_cancelled, run.job.id, run.lease_owner):
            self._metrics.job_finished(run.job.model, JobOutcome.CANCELLED)

    def _released(self, model: str, status: JobStatus | None) -> None:
        """A job given back by its runner ended (cancel requested, or no runs left) or went back to the queue."""
        if status is JobStatus.FAILED:
            self._metrics.job_finished(model, JobOutcome.FAILED)
        elif status is JobStatus.CANCELLED:
            self._metrics.job_finished(model, JobOutcome.CANCELLED)

    def _queue_changed(self, model: str) -> None:
        """Read and report the model's queue depth soon, off the caller's path (a claim must not wait on it, nor
        be left unrun if the service stops meanwhile). Changes seen before the read starts share one read."""
        if model in self._depth_wanted:
            return
        self._depth_wanted.add(model)

        async def report() -> None:
            self._depth_wanted.discard(model)  # from here on, a new change needs a new read
            await self._report_queue_depth([model])

        task = asyncio.create_task(report(), name=f"queue-depth-{model}")
        self._depth_reads.add(task)
        task.add_done_callback(self._depth_reads.discard)

    async def _report_queue_depth(self, models: Iterable[str]) -> None:
        """The store's queue depth of each model to the metrics; a store that cannot answer skips a sample."""
        for model in models:
            try:
                stats = await asyncio.to_thread(self._store.queue_stats, model)
            except Exception as exc:  # noqa: BLE001 - a metric never fails the operation that reports it
                logger.warning("reading the queue depth of model %r failed: %s", model, exc)
                return
            self._metrics.queue_depth(model, stats.num_queued)

    async def _write(self, operation: Callable[..., T], *args: object) -> T | None:
        """A runner's final write; if the store is down, the lease expires and the reaper decides."""
        try:
            return await asyncio.to_thread(operation, *args)
        except StoreUnavailable as exc:
            logger.error("job store unavailable, leaving the job to the reaper: %s", exc)
            return None

    async def _keep_lease(self, run: _Run) -> None:
        """Renew the lease every heartbeat and write progress after each reported step (coalesced)."""
        job = run.job
        while not run.finished:
            await _wait_event(run.progressed, self._config.heartbeat_interval_s)
            if run.finished:
                return
            run.progressed.clear()
            step, num_steps = run.latest
            try:
                if num_steps > 0:
                    status = await asyncio.to_thread(
                        self._store.set_progress, job.id, run.lease_owner, max(0, min(step, num_steps)), num_steps,
                        self._config.lease_s,
                    )
                else:
                    status = await asyncio.to_thread(
                        self._store.renew_lease, job.id, run.lease_owner, self._config.lease_s
                    )
            except StoreUnavailable as exc:
                logger.warning("video job %s: could not renew its lease: %s", job.id, exc)
                continue
            if status is not LeaseStatus.HELD:
                run.stop(status)
            self._feed.notify(job.id)

    # --- Housekeeping -----------------------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        while True:
            try:
                await self.reap_once()
            except Exception:  # try again next interval
                logger.exception("reaping video jobs failed")
            await asyncio.sleep(self._config.reap_interval_s)

    async def reap_once(self) -> ReapReport:
        """Settle jobs whose lease expired, fail jobs queued past max_queued_s, delete outputs past retention."""
        report = await asyncio.to_thread(self._store.reap, self._config.max_attempts)
        for job_id in report.job_ids:
            self._feed.notify(job_id)
        if report.retried:
            self._wake.set()
        if report.failed:
            logger.warning("video jobs lost by their replica, failed: %s", report.failed)
        await self._report_finished(report.failed, JobOutcome.FAILED)
        await self._report_finished(report.cancelled, JobOutcome.CANCELLED)
        if self._config.max_queued_s is not None:
            expired = await asyncio.to_thread(self._store.expire_queued, self._config.max_queued_s)
            for job_id in expired:
                self._feed.notify(job_id)
            if expired:
                logger.warning("video jobs queued past jobs.max_queued_s=%g s, failed: %s", self._config.max_queued_s,
                               expired)
            await self._report_finished(expired, JobOutcome.EXPIRED)
        await self._report_queue_depth(self._models)  # also catches what other replicas changed
        await asyncio.to_thread(self._store.purge_media)  # finished jobs' uploads
        for key in await asyncio.to_thread(self._store.expire_outputs):
            try:
                await asyncio.to_thread(self._outputs.delete, key)
            except Exception:  # its key is forgotten already: an orphan file, but the rest of the batch goes
                logger.exception("deleting expired video output %s from %s failed", key, self._outputs.url)
        return report

    async def _report_finished(self, job_ids: list[str], outcome: JobOutcome) -> None:
        """Jobs the reaper settled, by their model (the store's answer names only ids; reaping is rare)."""
        for job_id in job_ids:
            record = await asyncio.to_thread(self._store.get, job_id)
            if record is not None:  # deleted since (its delete saw it finished): the sample is lost, rarely
                self._metrics.job_finished(record.model, outcome)


def open_job_service(
    config: JobsConfig, backend: VideoBackend, models: Sequence[ModelLimits], replica_id: str | None = None,
    metrics: JobMetrics = NO_JOB_METRICS,
) -> JobService:
    """A service on the configured database and output store (created if missing; SQLite and the outputs under
    `state_dir` unless URLs are given). Not started: `await service.start()` inside the serving event loop."""
    return JobService(
        store=open_job_store(config.resolved_database_url),
        outputs=OutputStore(config.resolved_output_url),
        backend=backend,
        models=models,
        config=config,
        replica_id=replica_id,
        metrics=metrics,
    )


async def _wait_event(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` passed. `asyncio.timeout`, not `wait_for`: Python 3.11's wait_for can
    swallow a cancel that arrives as the event is set, and a task that ignores its cancel never ends."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass


def _visible(record: JobRecord, owner: str | None) -> bool:
    return owner is None or record.owner == owner
