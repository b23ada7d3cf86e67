"""The seam between the job layer and the generation side: what a video job asks for and gets back.

The job service hands a `VideoBackend` a validated, model-independent `VideoSpec` (pixels and seconds,
not latents) and receives a finished MP4 plus a thumbnail, with typed timings and stats. Failures come
back as one of three exception types, so the job record can say whose fault it was:

- `VideoRequestError` (a ValueError): the request cannot be served (e.g. its prompt is longer than the
  text encoder takes); the job fails with code `invalid_request`.
- `VideoServerError`: the server broke (a checkpoint it cannot read, a lost worker); code `server_error`.
- `VideoCancelled`: the backend saw `cancelled()` return True and stopped at a step boundary.

- `VideoWorkerLost` (a VideoServerError): the process running the job died (a worker replica killed or
  crashed); the service runs the job again when no denoising step had run yet, else fails it with the cause
  (code `worker_lost`).

Any other exception is treated as a server fault. `on_progress(step, num_steps)` may be called from any
thread (a Ray callback, an engine thread); the service makes it thread-safe.

Each run gets a `VideoRun`: beside progress and cancel, the key its outputs go under and `denoised()`, which a
backend calls once the denoiser is done with the job, so the service can start the next job while this one
decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from jobs.media import VideoMedia, VideoTask
from engine.limits import ADAPTER_NAME_PATTERN, Linears, Quality

__all__ = [
    "CancelCheck",
    "ProgressCallback",
    "Quality",
    "VideoBackend",
    "VideoCancelled",
    "VideoOutput",
    "VideoRequestError",
    "VideoRun",
    "VideoServerError",
    "VideoSpec",
    "VideoStats",
    "VideoTimings",
    "VideoWorkerLost",
]

ProgressCallback = Callable[[int, int], None]  # (steps done, steps in the request)
CancelCheck = Callable[[], bool]  # True: stop at the next step boundary, raise VideoCancelled


class VideoLora(BaseModel):
    """A configured LoRA adapter a video runs with (vllm-omni's `lora`), by name, optionally at its own scale."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., pattern=ADAPTER_NAME_PATTERN, description="An adapter `GET /v1/models` lists.")
    scale: float | None = Field(None, ge=-8, le=8, allow_inf_nan=False,
                                description="Strength (a multiplier of alpha / rank); null: the adapter's own.")


class VideoSpec(BaseModel):
    """One video to generate, resolved against a model's limits (every default filled in)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(..., description="Served model name.")
    prompt: str = Field(..., description="Text prompt, verbatim.")
    seconds: float = Field(..., gt=0, description="Clip duration in seconds.")
    width: int = Field(..., gt=0, description="Frame width in pixels.")
    height: int = Field(..., gt=0, description="Frame height in pixels.")
    num_inference_steps: int = Field(..., ge=1, description="Sampling grid points, the terminal 0 included.")
    seed: int = Field(..., ge=0, description="Seed of the initial noise.")
    flow_shift: float = Field(..., gt=0, description="Video timestep shift of the flow-matching schedule.")
    audio_flow_shift: float = Field(..., gt=0, description="Audio timestep shift of the flow-matching schedule.")
    quality: Quality = Field(..., description="lossless: exact sampling (bf16); high: the measured Cache-DiT "
                             "profile; fp8: exact sampling of the float8 block linears.")
    task: VideoTask = Field("t2va", description="t2va, fl2va (keyframes) or ref2va (references): what `media` holds.")
    size_given: bool = Field(True, description="False: a keyframe or reference job without a size, whose canvas "
                             "the model derives from its first image (width and height are then the default's).")
    # Not in the spec's JSON (the store keeps it in its own row, read only by the claim that runs the job).
    media: VideoMedia | None = Field(None, exclude=True, description="The uploads; None for t2va, and on records "
                                     "read for display (only a claimed job carries them).")
    lora: VideoLora | None = Field(None, description="The LoRA adapter it runs with; null: none.")

    @property
    def size(self) -> str:
        """`WIDTHxHEIGHT`, as the API writes sizes; `auto` for a canvas the model takes from the keyframe."""
        return f"{self.width}x{self.height}" if self.size_given else "auto"


class VideoTimings(BaseModel):
    """Seconds per stage of one job, as measured by the backend."""

    model_config = ConfigDict(extra="forbid")

    plan_s: float = Field(0.0, ge=0, description="AdaLN modulation plans for the schedule (cache tiers or rebuild).")
    encode_s: float = Field(0.0, ge=0, description="Prompt encoding.")
    denoise_s: float = Field(0.0, ge=0, description="The denoising loop.")
    decode_s: float = Field(0.0, ge=0, description="Video and audio VAE decode (the earlier clips' H.264 encode "
                            "runs under it).")
    mux_s: float = Field(0.0, ge=0, description="The H.264 + AAC encode and MP4 mux the decode did not hide "
                         "(waits for a slower encoder, the clips still with it, the flush, the audio, the thumbnail).")
    upload_s: float = Field(0.0, ge=0, description="Writing the MP4 and thumbnail to the output store.")
    queued_s: float = Field(0.0, ge=0, description="Waiting in the job queue, from creation to the run's start.")
    encode_wait_s: float = Field(
        0.0, ge=0, description="The text-encoder call beyond its own work: waiting for a replica, transfers."
    )
    denoise_wait_s: float = Field(
        0.0, ge=0, description="The worker call beyond planning and denoising: waiting for the worker, transfers."
    )
    decode_wait_s: float = Field(
        0.0, ge=0, description="The decoder call beyond decode, mux and upload: waiting for a replica, transfers."
    )
    total_s: float = Field(0.0, ge=0, description="The whole run: the backend call and the upload.")

    @property
    def stage_s(self) -> float:
        """The stages' own work added up (no waits): what a job costs on an idle system."""
        return self.plan_s + self.encode_s + self.denoise_s + self.decode_s + self.mux_s + self.upload_s


class VideoStats(BaseModel):
    """Counters of one job, as reported by the backend."""

    model_config = ConfigDict(extra="forbid")

    num_steps: int = Field(0, ge=0, description="Denoising steps run.")
    num_frames: int = Field(0, ge=0, description="Frames in the MP4.")
    fps: float = Field(0.0, ge=0, description="Frames per second of the MP4.")
    audio_sample_rate: int = Field(0, ge=0, description="Audio sample rate of the MP4 in Hz (0: no audio).")
    plan_cache_hits: int = Field(0, ge=0, description="AdaLN plans served from a cache tier.")
    plan_cache_misses: int = Field(0, ge=0, description="AdaLN plans rebuilt.")
    cached_steps: int = Field(0, ge=0, description="Steps Cache-DiT served from its cache (quality=high).")
    linears: Linears = Field("bf16", description="The weights the transformer's block linears ran with: bf16, or "
                             "fp8 (float8, `engine.quantization` fp8 or a bf16+fp8 server's quality=fp8 tier).")
    adapters: dict[str, float] = Field(default_factory=dict, description="The LoRA adapters the job ran with, "
                                       "name -> the scale it ran at (the lora field's, else the served default); "
                                       "empty: none.")
    compiles_since_warmup: int | None = Field(
        None, ge=0, description="Graphs the replica's compiled blocks (engine.compile.mode blocks) had compiled since "
        "its start-up warm-up when this job's denoise ended, this job's included: 0 while every canvas served was "
        "warmed. None: compile off (or a record written before this field).")


@dataclass(frozen=True)
class VideoOutput:
    """A finished video: the MP4 (H.264 + AAC) and a PNG of one frame; the service stores both."""

    timings: VideoTimings
    stats: VideoStats
    mp4: bytes
    thumbnail_png: bytes


@dataclass(frozen=True)
class VideoRun:
    """One run of a job, as the service hands it to the backend."""

    job_id: str
    output_key: str  # the `jobs.outputs.OutputStore` key this run's MP4 and thumbnail go under
    on_progress: ProgressCallback
    cancelled: CancelCheck
    denoised: Callable[[], None]  # the denoiser is done with this job (decode may still run): next job may start


class VideoRequestError(ValueError):
    """The request cannot be served by this model; the message names the value and the limit."""


class VideoServerError(RuntimeError):
    """The server failed to produce the video; not the client's fault."""


class VideoWorkerLost(VideoServerError):
    """The process running the job died mid-run (the message names what died); retried if no step had run."""


class VideoCancelled(Exception):
    """The backend stopped at a step boundary because `cancelled()` returned True."""


class VideoBackend(Protocol):
    """The generation side as the job service sees it."""

    async def validate(self, spec: VideoSpec) -> None:
        """Check `spec` against what is actually loaded (e.g. the prompt's tokens), before it is queued; raises
        `jobs.errors.InvalidVideoRequest` naming the field. Cheap; a backend that cannot tell right now (no
        worker answers) returns: the run checks again."""
        ...

    async def run(self, spec: VideoSpec, run: VideoRun) -> VideoOutput:
        """Generate `spec`. Calls `run.on_progress(step, num_steps)` after each denoising step (and may call it
        with step 0 once accepted), checks `run.cancelled()` between steps, calls `run.denoised()` once the
        denoiser is free (or never). Raises VideoRequestError, VideoServerError (VideoWorkerLost) or
        VideoCancelled."""
        ...
