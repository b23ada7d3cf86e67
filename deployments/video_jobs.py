"""The ingress replica's video job service, from start to stop.

`VideoJobs.start()` (called from the ingress's async constructor) returns at once and brings the service
up in the background: ask each served partition's Worker deployment to describe its model (waiting while no
worker replica is up yet, e.g. a large checkpoint still loading), take the served `ModelLimits` from them (a job's
`model`, or its task, picks one: `jobs.model_choice`), open the
job database and the output store, start a `JobService` (runners, lease keeper, reaper) on this replica's
event loop, and hand it to the `/v1/videos` routes through their `VideoApiSlot`. Until then the routes
answer 503 with the reason. A database that cannot be opened yet (PostgreSQL still starting) is retried; a
model the video API cannot describe (an engine without `describe()` limits) leaves the routes at 503 with
that reason, and the rest of the app serves on.

`stop()` (the ingress's `__del__`) stops the runners: a job running here is released (requeued when no
step ran, else failed with the cause) and its generation is cancelled at the worker. A replica that dies
without stopping leaves its jobs to the reaper of any replica, once their lease expires.
"""

from __future__ import annotations

import asyncio
import logging

from deployments.schemas import VideoOptions
from deployments.metrics import VideoJobMetrics
from deployments.partitions import ServedModels
from deployments.video_backend import ModelCard, ModelsVideoBackend, PipelineVideoBackend
from deployments.videos import VideoApi, VideoApiSlot
from jobs.config import AuthConfig, JobsConfig
from jobs.outputs import OutputStore
from jobs.service import JobService
from jobs.store import JobStore, open_job_store

__all__ = ["RETRY_S", "VideoJobs"]

logger = logging.getLogger("ray.serve")

#: Pause between attempts to reach the worker or the job database while starting.
RETRY_S = 1.0


class VideoJobs:
    """Owns one replica's JobService and publishes it into `slot` once started."""

    def __init__(
        self, models: ServedModels, slot: VideoApiSlot, jobs: JobsConfig, auth: AuthConfig,
        videos: VideoOptions, replica_id: str,
    ) -> None:
        self._models, self._slot = models, slot
        self._jobs, self._auth, self._videos = jobs, auth, videos
        self._replica_id = replica_id
        self._service: JobService | None = None
        self._store: JobStore | None = None
        self._starting: asyncio.Task[None] | None = None

    @property
    def service(self) -> JobService | None:
        """The running service; None while starting or after a start that gave up."""
        return self._service

    def start(self) -> None:
        if self._starting is not None:
            raise RuntimeError("VideoJobs.start() called twice")
        self._slot.unavailable("video jobs are starting (waiting for the worker to describe the model)")
        self._starting = asyncio.create_task(self._start(), name="video-jobs-start")

    async def wait_started(self) -> None:
        """Until the start finished or gave up (tests, and stop)."""
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)

    async def _start(self) -> None:
        backends, models = {}, []
        for index, served in enumerate(self._models.partitions):
            card = await self._describe(index)
            if card is None:
                return
            # The engine's own limits (what the video API resolves and checks jobs against): one model per partition.
            models.append(card.limits)
            backends[card.limits.name] = PipelineVideoBackend(served.runner, card, self._videos.high_quality,
                                                              self._videos.validate_timeout_s)
        backend = ModelsVideoBackend(backends)
        while True:
            try:
                store = await asyncio.to_thread(open_job_store, self._jobs.resolved_database_url)
                outputs = await asyncio.to_thread(OutputStore, self._jobs.resolved_output_url)
                break
            except ValueError as exc:  # a malformed URL: retrying will not help
                self._give_up(f"jobs config: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - a database that is not up yet: retry
                self._slot.unavailable(f"the job database is unavailable: {type(exc).__name__}")
                logger.warning("video jobs: cannot open %s / %s yet: %s", self._jobs.resolved_database_url,
                               self._jobs.resolved_output_url, exc)
                await asyncio.sleep(RETRY_S)
        service = JobService(store=store, outputs=outputs, backend=backend, models=models, config=self._jobs,
                             replica_id=self._replica_id, metrics=VideoJobMetrics())
        await service.start()
        self._service, self._store = service, store
        self._slot.set(VideoApi(service=service, auth=self._auth))
        logger.info("video jobs serving models %s (jobs in %s, outputs in %s)", [m.name for m in models],
                    self._jobs.resolved_database_url, self._jobs.resolved_output_url)

    async def _describe(self, index: int) -> ModelCard | None:
        """The `index`-th partition's worker's description of its model, asked until a worker replica answers;
        None (and the routes stay unavailable) when it is not one the video API can read."""
        while True:
            try:
                described = await self._models.card(index)
            except Exception as exc:  # noqa: BLE001 - no worker yet, or a busy one: ask again
                logger.info("video jobs: the worker did not describe the model yet (%s)", type(exc).__name__)
                await asyncio.sleep(RETRY_S)
                continue
            try:
                return ModelCard.from_describe(described)
            except ValueError as exc:
                self._give_up(f"the worker's describe() is not a model card the video API can read: {exc}")
                return None

    def _give_up(self, reason: str) -> None:
        logger.error("video jobs are off on this replica: %s", reason)
        self._slot.unavailable(f"video jobs are unavailable: {reason}")

    async def stop(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        service, self._service = self._service, None
        store, self._store = self._store, None
        if service is not None:
            self._slot.unavailable("video jobs are stopping on this replica")
            await service.stop()
        if store is not None:
            await asyncio.to_thread(store.close)
