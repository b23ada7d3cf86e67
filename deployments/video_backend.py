"""The video job layer's `VideoBackend` over the Worker deployment: a job's `VideoSpec` becomes the engine's
`GenerationRequest`, streamed through `Worker.generate_stream`, and comes back as the job's MP4.

- Request: pixels, seconds, `num_inference_steps` -> `steps`, shifts, seed, `return_video=True`,
  `return_latents=False`; `quality: lossless` runs with Cache-DiT off, `quality: high` with the
  `videos.high_quality` Cache-DiT profile (refused when the server has no Cache-DiT).
- Progress: each `progress` event of the worker's stream goes to `on_progress(step, steps)` (step 0 out of
  the request's steps once accepted, then forwards done out of `steps - 1`).
- Cancellation: `cancelled()` is polled every `CANCEL_POLL_S`; when it turns true the stream is cancelled,
  which stops the engine at its next step and releases its plan references.
- Errors: the engine's `ClientError` -> `VideoRequestError` under the video API's name of its `field`
  (`VIDEO_FIELDS`), a cancel the job did not ask for (the worker
  replica stopping) or any other failure -> `VideoServerError` with a message fit for the job record (no
  server paths).
- Stages (`StagedVideoBackend`, `stages: split`): the job drives TextEncoder.encode -> Worker.denoise_stream
  -> Decoder.decode_to_store through the three handles; the worker is free (and the service told, via
  `VideoRun.denoised`) the moment denoising ends, while the Decoder decodes, muxes and uploads to the output
  store. Timings: each stage's own seconds plus what each call took beyond them (`*_wait_s`: a replica's
  queue, transfers).
- A worker replica that died mid-run (`RayActorError`) is `VideoWorkerLost`: the service retries the job when
  no denoising step had run.
- Limits: the worker's `describe()["limits"]` is the engine's `ModelLimits` (`ModelCard`), what the job layer
  resolves and checks a job against, so a tiny CPU model accepts the small sizes it is configured for.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from typing import Any

import av
from pydantic import BaseModel, ConfigDict, Field
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle

from deployments.errors import engine_error, fault_summary, unwrap
from deployments.schemas import ProgressEvent
from deployments.stages import StoredVideo
from deployments.worker import StageHandles
from engine.api import AdalnStats, CacheDitOverrides, GenerationRequest, GenerationResult, GenerationStats
from engine.errors import ClientError, EngineError, GenerationCancelled, ServerFault, Unavailable
from engine.limits import ModelLimits
from engine.stages import PromptEmbedding
from jobs.backend import (
    VideoCancelled,
    VideoOutput,
    VideoRequestError,
    VideoRun,
    VideoServerError,
    VideoSpec,
    VideoStats,
    VideoTimings,
    VideoWorkerLost,
)
from jobs.errors import InvalidVideoRequest

__all__ = [
    "CANCEL_POLL_S",
    "LOSSLESS_CACHE_DIT",
    "ModelCard",
    "VIDEO_FIELDS",
    "StagedVideoBackend",
    "WorkerVideoBackend",
    "generation_request",
    "invalid_request",
    "video_output",
]

logger = logging.getLogger("ray.serve")

#: How often a running job's cancel flag is looked at while waiting for the worker's next event.
CANCEL_POLL_S = 0.1
#: `quality: lossless`: exact sampling, whatever the server's own Cache-DiT default is.
LOSSLESS_CACHE_DIT = CacheDitOverrides(enabled=False)


# --------------------------------------------------------------------------------------------------
# The served model, as the worker describes it
# --------------------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    """The parts of the worker's `describe()` the video API needs: the engine's own `ModelLimits`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str = Field(..., min_length=1, description="`minimax-h3@<fingerprint>`: name and weights.")
    limits: ModelLimits = Field(..., description="What the loaded model accepts; `limits.name` is what clients "
                                "put in `model` (no fingerprint: stable across weight updates).")
    cache_dit_enabled: bool = Field(..., description="engine.cache_dit.enabled: per-request Cache-DiT is possible.")

    @classmethod
    def from_describe(cls, card: dict[str, Any]) -> ModelCard:
        """ValueError naming what is missing when the engine describes itself differently."""
        engine_config = card.get("engine_config") or {}
        cache_dit = engine_config.get("cache_dit") or {}
        return cls.model_validate(
            {"id": card.get("id"), "limits": card.get("limits"), "cache_dit_enabled": cache_dit.get("enabled")}
        )


# --------------------------------------------------------------------------------------------------
# Request and result
# --------------------------------------------------------------------------------------------------


def generation_request(spec: VideoSpec, high_quality: CacheDitOverrides) -> GenerationRequest:
    """The engine request of a video job (an MP4, no latents)."""
    return GenerationRequest(
        prompt=spec.prompt,
        steps=spec.num_inference_steps,
        seconds=spec.seconds,
        width=spec.width,
        height=spec.height,
        flow_shift=spec.flow_shift,
        audio_flow_shift=spec.audio_flow_shift,
        seed=spec.seed,
        return_video=True,
        return_latents=False,
        cache_dit=high_quality if spec.quality == "high" else LOSSLESS_CACHE_DIT,
    )


def video_output(result: GenerationResult) -> VideoOutput:
    """The job's output: the MP4 and thumbnail, the engine's timings, and counts read from the MP4 itself."""
    if result.mp4 is None or result.thumbnail_png is None:
        raise VideoServerError("the worker returned no MP4 for a request that asked for one")
    with av.open(io.BytesIO(result.mp4)) as container:
        video = container.streams.video[0]
        audio = container.streams.audio[0] if container.streams.audio else None
        num_frames, fps = video.frames, float(video.average_rate or 0)
        sample_rate = audio.rate if audio is not None else 0
    stats, timings = result.stats, result.timings
    return VideoOutput(
        mp4=result.mp4,
        thumbnail_png=result.thumbnail_png,
        timings=VideoTimings(plan_s=timings.plan_s, encode_s=timings.encode_s, denoise_s=timings.denoise_s,
                             decode_s=timings.decode_s, mux_s=timings.mux_s, total_s=timings.total_s),
        stats=video_stats(stats, num_frames, fps, sample_rate),
    )


def video_stats(stats: GenerationStats, num_frames: int, fps: float, sample_rate: int) -> VideoStats:
    """A job's stats: the engine's counters and what the MP4 holds."""
    adaln = stats.adaln if stats.adaln is not None else AdalnStats()  # resident AdaLN: no plans
    return VideoStats(
        num_steps=stats.forwards,
        num_frames=num_frames,
        fps=fps,
        audio_sample_rate=sample_rate,
        plan_cache_hits=adaln.gpu_hit_plans + adaln.host_hit_plans + adaln.pool_hit_plans,
        plan_cache_misses=adaln.built_plans,
        cached_steps=stats.cache_dit.num_cached_steps if stats.cache_dit is not None else 0,
    )


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------

#: The video API's name of each engine request field (`ClientError.field`) a job's request can be refused on:
#: a job's VideoSpec becomes the engine request's fields by `generation_request` above.
VIDEO_FIELDS = {
    "prompt": "prompt", "steps": "num_inference_steps", "seconds": "seconds", "width": "size", "height": "size",
    "flow_shift": "flow_shift", "audio_flow_shift": "audio_flow_shift", "seed": "seed", "cache_dit": "quality",
}


def invalid_request(error: ClientError) -> InvalidVideoRequest:
    """An engine refusal as the video API's 422, under the video API's name of its field."""
    return InvalidVideoRequest(VIDEO_FIELDS.get(error.field, "request"), error.detail)


def backend_error(exc: BaseException, cancel_asked: bool) -> Exception:
    """A failed worker call as the job layer's error type (messages fit for the job record)."""
    if isinstance(unwrap(exc), (RequestCancelledError, asyncio.CancelledError)):
        error: EngineError | None = GenerationCancelled("the call was cancelled")
    else:
        error = engine_error(exc)
    if error is None:
        logger.error("video generation failed", exc_info=exc)
        return VideoServerError(f"generation failed: {type(unwrap(exc)).__name__}")
    if isinstance(error, ClientError):
        return VideoRequestError(str(invalid_request(error)))
    if isinstance(error, GenerationCancelled):
        if cancel_asked:
            return VideoCancelled("cancelled")
        return VideoServerError("the worker replica stopped the generation (it was shutting down)")
    if isinstance(error, ServerFault) and error.cause.replica_lost:  # like a replica that died: retried
        return VideoWorkerLost(f"a rank of the multi-GPU replica running it failed ({error})")
    if isinstance(error, ServerFault):
        logger.error("video generation failed: %s", error.cause.description, exc_info=exc)
        return VideoServerError(f"generation failed: {fault_summary(error)}")
    if isinstance(error, Unavailable) and error.replica_lost:
        return VideoWorkerLost(f"the replica running it died ({type(unwrap(exc)).__name__})")
    return VideoServerError(f"the job could not run: {error}")


# --------------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------------


class WorkerVideoBackend:
    """`jobs.backend.VideoBackend` over a `Worker` deployment handle."""

    def __init__(
        self, worker: DeploymentHandle, card: ModelCard, high_quality: CacheDitOverrides, validate_timeout_s: float
    ) -> None:
        self._worker = worker
        self._card = card
        self._high_quality = high_quality
        self._validate_timeout_s = validate_timeout_s

    def request(self, spec: VideoSpec) -> GenerationRequest:
        if spec.quality == "high" and not self._card.cache_dit_enabled:
            raise InvalidVideoRequest(
                "quality", "'high' runs Cache-DiT, which is off on this server (engine.cache_dit.enabled: false); "
                "send quality 'lossless'",
            )
        return generation_request(spec, self._high_quality)

    async def validate(self, spec: VideoSpec) -> None:
        """The prompt's token count, by what holds the tokenizer (one call; sizes, duration and steps were
        checked against the served ModelLimits already). One that does not answer within validate_timeout_s
        does not refuse the job: the run checks again."""
        request = self.request(spec)
        try:
            await asyncio.wait_for(self._prompt_check(request), timeout=self._validate_timeout_s)
        except Exception as exc:  # noqa: BLE001 - sorted below
            cause = unwrap(exc)
            if isinstance(cause, ClientError):
                raise invalid_request(cause) from None
            logger.warning("video request check skipped (the worker did not answer): %s", type(exc).__name__)

    def _prompt_check(self, request: GenerationRequest) -> Any:
        """The call that checks the prompt: the fused worker holds the tokenizer (its check is the engine's)."""
        return self._worker.validate.remote(request)

    async def run(self, spec: VideoSpec, run: VideoRun) -> VideoOutput:
        try:
            request = self.request(spec)
        except InvalidVideoRequest as exc:  # e.g. Cache-DiT turned off since the job was queued
            raise VideoRequestError(str(exc)) from None
        stream = self._worker.options(stream=True).generate_stream.remote(request, schedule_key=request.schedule_key)
        result = await self._follow(stream, run)
        # Reading the MP4's header is blocking work: keep it off the event loop.
        return await asyncio.to_thread(video_output, result)

    async def _follow(self, stream: Any, run: VideoRun) -> GenerationResult:
        """The worker stream's progress to `run.on_progress`, its result returned; cancelled when `run.cancelled()`."""
        job_id, on_progress, cancelled = run.job_id, run.on_progress, run.cancelled
        pending: asyncio.Future[Any] | None = None
        try:
            while True:
                if cancelled():
                    raise VideoCancelled(f"video job {job_id} cancelled")
                if pending is None:
                    pending = asyncio.ensure_future(stream.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=CANCEL_POLL_S)
                if not done:
                    continue
                finished, pending = pending, None
                try:
                    event = finished.result()
                except StopAsyncIteration:
                    raise VideoServerError("the worker's stream ended without a result") from None
                except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - sorted by backend_error
                    raise backend_error(exc, cancelled()) from exc
                if isinstance(event, ProgressEvent):
                    on_progress(event.step, event.steps)
                else:
                    return event
        finally:
            # Leaving early (cancelled, failed, the service stopping): the engine stops at its next step.
            # A no-op once the worker finished.
            stream.cancel()
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)  # retrieved: no "never retrieved" warning


class StagedVideoBackend(WorkerVideoBackend):
    """`jobs.backend.VideoBackend` over the three stage deployments of `stages: split`."""

    def __init__(self, worker: DeploymentHandle, stages: StageHandles, card: ModelCard,
                 high_quality: CacheDitOverrides, validate_timeout_s: float) -> None:
        super().__init__(worker, card, high_quality, validate_timeout_s)
        self._stages = stages

    def _prompt_check(self, request: GenerationRequest) -> Any:
        return self._stages.text_encoder.validate.remote(request.prompt)  # the TextEncoder holds the tokenizer

    async def run(self, spec: VideoSpec, run: VideoRun) -> VideoOutput:
        start = time.perf_counter()
        try:
            request = self.request(spec)
        except InvalidVideoRequest as exc:
            raise VideoRequestError(str(exc)) from None
        try:
            embedding: PromptEmbedding = await self._stages.text_encoder.encode.remote(request.prompt)
        except Exception as exc:  # noqa: BLE001 - sorted by backend_error
            raise backend_error(exc, run.cancelled()) from exc
        encoded = time.perf_counter()
        if run.cancelled():
            raise VideoCancelled(f"video job {run.job_id} cancelled")
        stream = self._worker.options(stream=True).denoise_stream.remote(
            request, embedding, schedule_key=request.schedule_key)
        result = await self._follow(stream, run)
        denoised = time.perf_counter()
        run.denoised()  # the worker is free: the service may start the next job while this one decodes
        if run.cancelled():
            raise VideoCancelled(f"video job {run.job_id} cancelled")
        try:
            stored: StoredVideo = await self._stages.decoder.decode_to_store.remote(
                result.latents, run.output_key)
        except Exception as exc:  # noqa: BLE001 - sorted by backend_error (a dead decoder: steps ran, so failed)
            raise backend_error(exc, run.cancelled()) from exc
        done = time.perf_counter()
        plan_s, denoise_s = result.timings.plan_s, result.timings.denoise_s
        return VideoOutput(
            timings=VideoTimings(
                plan_s=plan_s, encode_s=embedding.encode_s, denoise_s=denoise_s, decode_s=stored.decode_s,
                mux_s=stored.mux_s, upload_s=stored.upload_s,
                encode_wait_s=max(0.0, encoded - start - embedding.encode_s),
                denoise_wait_s=max(0.0, denoised - encoded - plan_s - denoise_s),
                decode_wait_s=max(0.0, done - denoised - stored.decode_s - stored.mux_s - stored.upload_s),
                total_s=done - start,
            ),
            stats=video_stats(result.stats, stored.num_frames, stored.fps, stored.sample_rate),
        )
