"""The video job layer's `VideoBackend` over the app's `GenerationRunner` (`deployments/generation.py`): a job's
`VideoSpec` becomes the engine's `GenerationRequest`, runs through the one pipeline (split over the stage
deployments, or inside a fused worker), and comes back as the job's MP4.

- Request: pixels, seconds, `num_inference_steps` -> `steps`, shifts, seed, `return_video=True`,
  `return_latents=False`; `quality: lossless` runs with Cache-DiT off, `quality: high` with the
  `videos.high_quality` Cache-DiT profile (refused when the server has no Cache-DiT).
- Progress: each `progress` event of the worker's stream goes to `on_progress(step, steps)` (step 0 out of
  the request's steps once accepted, then forwards done out of `steps - 1`).
- Cancellation: `cancelled()` is polled every `generation.CANCEL_POLL_S`; when it turns true the worker's
  stream is cancelled, which stops the engine at its next step and releases its plan references.
- Split stages: the service is told (`VideoRun.denoised`) the moment denoising ends, so the next job starts on
  the worker while this one decodes. Timings: each stage's own seconds plus what each call took beyond them
  (`*_wait_s`: a replica's queue, transfers).
- Errors: the engine's `ClientError` -> `VideoRequestError` under the video API's name of its `field`
  (`VIDEO_FIELDS`) or of the upload it is about (its typed `upload`: list and index), a cancel the job did not ask for (the worker replica stopping) or any other failure ->
  `VideoServerError` with a message fit for the job record (no server paths). A worker replica that died
  mid-run (`RayActorError`) is `VideoWorkerLost`: the service retries the job when no denoising step had run.
- Limits: the worker's `describe()["limits"]` is the engine's `ModelLimits` (`ModelCard`), what the job layer
  resolves and checks a job against, so a tiny CPU model accepts the small sizes it is configured for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray.serve.exceptions import RequestCancelledError

from deployments.errors import engine_error, fault_summary, unwrap
from deployments.generation import GenerationRunner
from engine.api import (AdalnStats, AdapterChoice, CacheDitOverrides, GenerationRequest, GenerationStats,
                        KeyframeInput, ReferenceInput)
from engine.errors import ClientError, EngineError, GenerationCancelled, ServerFault, Unavailable, UploadKind
from engine.limits import ModelLimits
from engine.pipeline import PipelineResult
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
    "LOSSLESS_CACHE_DIT",
    "ModelCard",
    "ModelsVideoBackend",
    "VIDEO_FIELDS",
    "PipelineVideoBackend",
    "generation_request",
    "invalid_request",
    "video_output",
]

logger = logging.getLogger("ray.serve")

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
    """The engine request of a video job (an MP4, no latents): its keyframes (fl2va) or references (ref2va) from
    the job's media; without a size the canvas is the model's for the first image (width and height left out)."""
    if spec.task != "t2va" and spec.media is None:
        raise VideoServerError(f"the job's {spec.task} uploads are missing from the job store")
    media = spec.media
    size = {"width": spec.width, "height": spec.height} if spec.size_given else {}
    return GenerationRequest(
        prompt=spec.prompt,
        steps=spec.num_inference_steps,
        seconds=spec.seconds,
        **size,
        flow_shift=spec.flow_shift,
        audio_flow_shift=spec.audio_flow_shift,
        seed=spec.seed,
        return_video=True,
        return_latents=False,
        cache_dit=high_quality if spec.quality == "high" else LOSSLESS_CACHE_DIT,
        keyframes=tuple(KeyframeInput(image=k.image, frame_index=k.frame_index) for k in media.keyframes)
        if media is not None and media.keyframes else None,
        references=tuple(ReferenceInput(kind=r.kind, data=r.data) for r in media.references)
        if media is not None and media.references else None,
        adapters=(AdapterChoice(name=spec.lora.name, scale=spec.lora.scale),) if spec.lora is not None else (),
        quality=spec.quality,
    )


def video_output(finished: PipelineResult, total_s: float) -> VideoOutput:
    """The job's output: the MP4 and thumbnail, the stages' timings and what each call took beyond them, and the
    clip's facts as the decoder made it."""
    result, calls = finished.result, finished.calls
    if result.mp4 is None or result.thumbnail_png is None or result.clip is None:
        raise VideoServerError("the worker returned no MP4 for a request that asked for one")
    timings, clip = result.timings, result.clip
    engine_work = timings.plan_s + timings.denoise_s
    if calls.encode_call_s is None:  # fused: the worker call ran every stage
        engine_work += timings.encode_s + timings.decode_s + timings.mux_s
    return VideoOutput(
        mp4=result.mp4,
        thumbnail_png=result.thumbnail_png,
        timings=VideoTimings(
            plan_s=timings.plan_s, encode_s=timings.encode_s, denoise_s=timings.denoise_s, decode_s=timings.decode_s,
            mux_s=timings.mux_s,
            encode_wait_s=max(0.0, (calls.encode_call_s or 0.0) - (timings.encode_s if calls.encode_call_s else 0.0)),
            denoise_wait_s=max(0.0, calls.denoise_call_s - engine_work),
            decode_wait_s=max(0.0, (calls.decode_call_s or 0.0) - (timings.decode_s + timings.mux_s
                                                                    if calls.decode_call_s else 0.0)),
            total_s=total_s),
        stats=video_stats(result.stats, clip.num_frames, clip.fps, clip.sample_rate),
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
        linears=stats.linears,
        adapters=dict(stats.adapters.scales) if stats.adapters is not None else {},
        compiles_since_warmup=stats.compile.since_warmup if stats.compile is not None else None,
    )


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------

#: The video API's name of each engine request field (`ClientError.field`) a job's request can be refused on:
#: a job's VideoSpec becomes the engine request's fields by `generation_request` above.
VIDEO_FIELDS = {
    "prompt": "prompt", "steps": "num_inference_steps", "seconds": "seconds", "width": "size", "height": "size",
    "flow_shift": "flow_shift", "audio_flow_shift": "audio_flow_shift", "seed": "seed", "cache_dit": "quality", "quality": "quality",
    "adapters": "lora",
    # The uploads as a whole (an upload of the list: `ClientError.upload`, named as the client sent it).
    "keyframes": "input_reference", "references": "references",
}


def invalid_request(error: ClientError, spec: VideoSpec | None = None) -> InvalidVideoRequest:
    """An engine refusal as the video API's 422, under the video API's name of its field: `keyframes[i]...` and
    `references[i]` (its typed `upload`) are the job's uploads in order, named as the client sent them
    (`input_references[1]`)."""
    return InvalidVideoRequest(video_field(error, spec), error.detail)


def video_field(error: ClientError, spec: VideoSpec | None) -> str:
    """The video API's name of the field `error` is about: the upload it names by list and index (`upload`), else
    its engine field's (`VIDEO_FIELDS`; "request" for a field no job sends)."""
    upload = error.upload
    if upload is None:
        return VIDEO_FIELDS.get(error.field, "request")
    uploads = () if spec is None or spec.media is None else (
        spec.media.keyframes if upload.kind is UploadKind.KEYFRAMES else spec.media.references)
    if upload.index < len(uploads):
        return uploads[upload.index].field
    return VIDEO_FIELDS[upload.kind.value]


def backend_error(exc: BaseException, cancel_asked: bool, spec: VideoSpec | None = None) -> Exception:
    """A failed worker call as the job layer's error type (messages fit for the job record)."""
    if isinstance(unwrap(exc), (RequestCancelledError, asyncio.CancelledError)):
        error: EngineError | None = GenerationCancelled("the call was cancelled")
    else:
        error = engine_error(exc)
    if error is None:
        logger.error("video generation failed", exc_info=exc)
        return VideoServerError(f"generation failed: {type(unwrap(exc)).__name__}")
    if isinstance(error, ClientError):
        return VideoRequestError(str(invalid_request(error, spec)))
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


class PipelineVideoBackend:
    """`jobs.backend.VideoBackend` over the app's `GenerationRunner` (the pipeline split over the stage
    deployments, or one fused worker call)."""

    def __init__(self, runner: GenerationRunner, card: ModelCard, high_quality: CacheDitOverrides,
                 validate_timeout_s: float) -> None:
        self._runner = runner
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
            await asyncio.wait_for(self._runner.check(request), timeout=self._validate_timeout_s)
        except Exception as exc:  # noqa: BLE001 - sorted below
            cause = unwrap(exc)
            if isinstance(cause, ClientError):
                raise invalid_request(cause, spec) from None
            logger.warning("video request check skipped (the worker did not answer): %s", type(exc).__name__)

    async def run(self, spec: VideoSpec, run: VideoRun) -> VideoOutput:
        start = time.perf_counter()
        try:
            request = self.request(spec)
        except InvalidVideoRequest as exc:  # e.g. Cache-DiT turned off since the job was queued
            raise VideoRequestError(str(exc)) from None
        try:
            # `run.denoised`: the worker is free (split: while the Decoder decodes) and the next job may start.
            finished = await self._runner.run(request, run.on_progress, run.cancelled, run.denoised)
        except Exception as exc:  # noqa: BLE001 - sorted by backend_error
            raise backend_error(exc, run.cancelled(), spec) from exc
        return video_output(finished, time.perf_counter() - start)


class ModelsVideoBackend:
    """`jobs.backend.VideoBackend` of an app serving several models (one per partition): a job runs on the backend
    of the model it was resolved to (`spec.model`, chosen by its task or named: `jobs.model_choice`)."""

    def __init__(self, backends: Mapping[str, PipelineVideoBackend]) -> None:
        if not backends:
            raise ValueError("ModelsVideoBackend needs at least one model's backend")
        self._backends = dict(backends)

    def _backend(self, spec: VideoSpec) -> PipelineVideoBackend:
        backend = self._backends.get(spec.model)
        if backend is None:  # a job queued for a model this replica does not serve (the job service claims its own)
            raise VideoServerError(f"model {spec.model!r} is not served by this replica: {sorted(self._backends)}")
        return backend

    async def validate(self, spec: VideoSpec) -> None:
        await self._backend(spec).validate(spec)

    async def run(self, spec: VideoSpec, run: VideoRun) -> VideoOutput:
        return await self._backend(spec).run(spec, run)
