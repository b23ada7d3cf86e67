"""The video job API's request and response bodies (pydantic at the edge, every field described).

Shapes follow the OpenAI-style video job API that vllm-omni and sglang also serve: a job object with
`object: "video"`, `status`, `progress`, `seconds` and `size` as strings, `error: {code, message}`; lists as
`{object: "list", data, first_id, last_id, has_more}`. ditserve adds its queue position, timings and stats.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jobs.backend import Quality, VideoLora, VideoStats, VideoTimings
from jobs.media import VideoTask
from jobs.records import JobRecord, JobStatus

__all__ = ["MAX_PROMPT_CHARS", "VideoCreateRequest", "VideoDeleted", "VideoJob", "VideoJobError", "VideoList"]

MAX_PROMPT_CHARS = 65536  # schema bound, before any model's (smaller) limit
MAX_SEED = 2**63 - 1


class VideoCreateRequest(BaseModel):
    """Body of POST /v1/videos and /v1/videos/sync (JSON, or multipart / urlencoded form fields)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, min_length=1, max_length=256, description="Served model name (GET /v1/models); null: the first one."
    )
    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS, description="What to generate.")
    seconds: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Duration in seconds, a number or a numeric string "
        "(\"8\"); within the model's min_seconds..max_seconds (H3: 4-15); null: the model's default.",
    )
    size: str | None = Field(
        None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$", description="`WIDTHxHEIGHT` in pixels, e.g. \"1344x768\": multiples "
        "of the model's size_multiple, within its edge and pixel limits. Give size or aspect_ratio, not both; "
        "neither: the model's default size.",
    )
    aspect_ratio: str | None = Field(
        None, pattern=r"^[0-9]{1,3}:[0-9]{1,3}$", description="`W:H`, e.g. \"16:9\": the short edge is short_edge, "
        "the long edge the largest size_multiple within the ratio (16:9 at 768 -> 1344x768).",
    )
    short_edge: int | None = Field(
        None, ge=1, le=65536,
        description="Short edge in pixels with aspect_ratio; null: the model's default (H3: 768).",
    )
    num_inference_steps: int | None = Field(
        None, ge=1, le=10000, description="Sampling grid points including the terminal 0 (50 -> 49 model passes); "
        "within the model's min_steps..max_steps; null: the model's default.",
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of the initial noise; null: drawn at random.")
    flow_shift: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Video timestep shift; null: the model's default (H3: 12).",
    )
    audio_flow_shift: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Audio timestep shift; null: the model's default (H3: 3).",
    )
    quality: Quality | None = Field(
        None, description="lossless: exact sampling (bf16 linears); high: the measured Cache-DiT profile (faster, not "
        "exact); fp8: exact sampling of float8 block linears. The served ones: GET /v1/models limits.qualities; "
        "null: the server's first of lossless, fp8.",
    )
    # Media (jobs.media): in JSON each a base64 `data:` URL; in a multipart form a file (or a data: URL field).
    input_reference: str | None = Field(
        None, description="fl2va keyframe image (PNG/JPEG/WebP): the first frame, or where frame_indices says.")
    input_references: list[str] | None = Field(
        None, max_length=2, description="fl2va keyframe images: first and last (or as frame_indices says).")
    frame_indices: list[int] | None = Field(
        None, max_length=2, description="Frame of each keyframe, in order: 0 first, -1 last (a form may send "
        "\"0,-1\"). Default: one keyframe [0], two [0, -1].")
    image_reference: str | None = Field(None, description="ref2va reference image (PNG/JPEG/WebP).")
    image_references: list[str] | None = Field(None, max_length=9, description="ref2va reference images.")
    video_reference: str | None = Field(None, description="ref2va reference video (its soundtrack too, if any).")
    audio_reference: str | None = Field(None, description="ref2va reference soundtrack (with an image or video).")

    @field_validator("frame_indices", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        # Forms send "0,-1" (or the field repeated: a list of strings).
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, list) and all(isinstance(item, str) for item in items):
            try:
                return [int(item.strip()) for item in items]
            except ValueError:
                raise ValueError(f"frame_indices={value!r}: integers, e.g. 0,-1") from None
        return value

    lora: VideoLora | None = Field(
        None, description="A configured LoRA adapter (GET /v1/models lists them): its name, or {name, scale}. The "
        "fields left out (num_inference_steps, flow_shift, audio_flow_shift) take the adapter's defaults.",
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_by_name(cls, value: object) -> object:
        # vllm-omni's form: `"lora": "turbo"`; the object form adds a scale.
        return {"name": value} if isinstance(value, str) else value

    @field_validator("seconds", mode="before")
    @classmethod
    def _numeric_string(cls, value: object) -> object:
        # OpenAI clients send seconds as a string ("8"); forms send every field as one.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"seconds={value!r} is not a number") from None
        return value

    @model_validator(mode="after")
    def _one_way_to_give_the_size(self) -> VideoCreateRequest:
        if self.size is not None and self.aspect_ratio is not None:
            raise ValueError("give size or aspect_ratio (+ short_edge), not both")
        if self.short_edge is not None and self.aspect_ratio is None:
            raise ValueError("short_edge needs aspect_ratio (or give size)")
        return self


class VideoJobError(BaseModel):
    code: str = Field(
        ..., description="invalid_request (the model could not serve it), server_error, worker_lost (the replica "
        "running it died; a job lost before its first step is retried once first), timeout, queue_timeout (still "
        "queued jobs.max_queued_s after it was created: no replica serving its model took it).",
    )
    message: str = Field(..., description="What went wrong.")


class VideoJob(BaseModel):
    """A video job, as every video route returns it."""

    id: str = Field(..., description="Job id: `video_` + 22 URL-safe characters (128 random bits).")
    object: Literal["video"] = Field("video", description="Always `video`.")
    status: JobStatus = Field(..., description="queued, in_progress, completed, failed or cancelled.")
    progress: int = Field(..., ge=0, le=100, description="Percent of denoising steps done; 100 once the MP4 is ready.")
    created_at: int = Field(..., description="Unix seconds when the job was created.")
    started_at: int | None = Field(None, description="Unix seconds when its current run started.")
    completed_at: int | None = Field(None, description="Unix seconds when it completed, failed or was cancelled.")
    expires_at: int | None = Field(None, description="Unix seconds when its MP4 is deleted (retention).")
    model: str = Field(..., description="Model that serves it.")
    prompt: str = Field(..., description="The prompt.")
    seconds: str = Field(..., description="Duration in seconds, as a string (\"5\", \"4.5\").")
    size: str = Field(..., description="`WIDTHxHEIGHT`.")
    num_inference_steps: int = Field(..., description="Sampling grid points.")
    seed: int = Field(..., description="Seed of the initial noise (the drawn one when the request gave none).")
    flow_shift: float = Field(..., description="Video timestep shift.")
    audio_flow_shift: float = Field(..., description="Audio timestep shift.")
    quality: Quality = Field(..., description="lossless, high or fp8.")
    task: VideoTask = Field("t2va", description="t2va, fl2va (keyframes) or ref2va (references).")
    queue_position: int | None = Field(
        None, description="While queued: jobs of the same model ahead of this one (0: it starts next)."
    )
    cancel_requested: bool = Field(False, description="A cancel was asked for; a running job stops at its next step.")
    attempts: int = Field(..., description="Runs started (a job lost before its first step runs again once).")
    error: VideoJobError | None = Field(None, description="Why it failed.")
    timings: VideoTimings | None = Field(None, description="Seconds per stage, once completed.")
    stats: VideoStats | None = Field(None, description="Backend counters (steps, frames, plan cache), once completed.")

    @classmethod
    def from_record(cls, record: JobRecord) -> VideoJob:
        spec = record.spec
        return cls(
            id=record.id,
            status=record.status,
            progress=record.progress,
            created_at=_unix(record.created_at),
            started_at=_unix_or_none(record.started_at),
            completed_at=_unix_or_none(record.completed_at),
            expires_at=_unix_or_none(record.output_expires_at),
            model=spec.model,
            prompt=spec.prompt,
            seconds=f"{spec.seconds:g}",
            size=spec.size,
            num_inference_steps=spec.num_inference_steps,
            seed=spec.seed,
            flow_shift=spec.flow_shift,
            audio_flow_shift=spec.audio_flow_shift,
            quality=spec.quality,
            task=spec.task,
            queue_position=record.jobs_ahead,
            cancel_requested=record.cancel_requested,
            attempts=record.attempts,
            error=None if record.error is None else VideoJobError(code=record.error.code, message=record.error.message),
            timings=record.timings,
            stats=record.stats,
        )


def _unix(t: float) -> int:
    return math.floor(t)


def _unix_or_none(t: float | None) -> int | None:
    return None if t is None else _unix(t)


class VideoList(BaseModel):
    """A page of GET /v1/videos, newest first."""

    object: Literal["list"] = Field("list", description="Always `list`.")
    data: list[VideoJob] = Field(..., description="Jobs, newest first.")
    first_id: str | None = Field(None, description="Id of the first job on this page.")
    last_id: str | None = Field(None, description="Id of the last job on this page: pass it as `after` for the next.")
    has_more: bool = Field(..., description="More (older) jobs follow.")


class VideoDeleted(BaseModel):
    """Answer of DELETE /v1/videos/{id}."""

    id: str = Field(..., description="The deleted job's id.")
    object: Literal["video.deleted"] = Field("video.deleted", description="Always `video.deleted`.")
    deleted: bool = Field(True, description="Always true.")
