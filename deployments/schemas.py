"""Pydantic models at the HTTP / handle edge, and the app's config (`args` of serve_config.yaml).

The request type is the engine's own (`engine.api.GenerationRequest`), re-exported here.
"""

from __future__ import annotations

import base64
import io
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from engine.api import CacheDitOverrides, GenerationRequest, GenerationResult, GenerationTimings
from engine.config import EngineConfig
from jobs.config import AuthConfig, JobsConfig

__all__ = [
    "AdminOptions",
    "AppConfig",
    "AutoscalingOptions",
    "CacheDitOverrides",
    "ErrorBody",
    "ErrorResponse",
    "FieldError",
    "GenerationRequest",
    "GenerationResponse",
    "HttpOptions",
    "ProgressEvent",
    "ServeTimings",
    "StageOptions",
    "Timings",
    "VideoOptions",
    "WeightUpdateRequest",
    "WorkerOptions",
    "decode_latents",
]

PREVIEW_PX = 128


# --------------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------------


#: Seconds spent per phase inside the engine: the engine's own type, serialized as is.
Timings = GenerationTimings


class ServeTimings(BaseModel):
    """Seconds one generation spent as the ingress saw it, beside the engine's own phases (`timings`): what the
    client waited minus `timings.total_s` (the stages' work) is the serving overhead, and these split it by hop.
    Client latency - `ingress_s`: the client <-> ingress hop (HTTP proxy or handle); `encode_call_s` -
    `timings.encode_s`: the TextEncoder round trip; `engine_call_s` - the phases the worker ran in it: the
    worker's queue, request checks, transfers; `decode_call_s` - decode and mux: the Decoder round trip."""

    ingress_s: float = Field(0.0, description="The ingress: request received (body read) to response ready.")
    encode_call_s: float | None = Field(
        None, description="The TextEncoder call. None: the worker's engine encodes (stages: fused).")
    engine_call_s: float = Field(
        0.0, description="The worker call (queue wait included): plan + denoise (stages: split), or every stage "
        "(stages: fused).")
    decode_call_s: float | None = Field(
        None, description="The Decoder call. None: no decode, or the worker's engine decodes (stages: fused).")
    respond_s: float = Field(0.0, description="Encoding this response in the ingress (preview PNG; latents if asked).")


class GenerationResponse(BaseModel):
    """A finished generation."""

    id: str = Field(..., description="Generation id (`gen-...`), also in the ingress logs.")
    model: str = Field(
        ..., description="Model name and the fingerprint of the transformer weights that produced it "
        "(`minimax-h3@...`; a weight update changes it).",
    )
    seed: int = Field(..., description="Seed of the initial noise (the drawn one when the request gave none).")
    video_shape: list[int] = Field(..., description="Video latent shape [C, F, H, W].")
    audio_shape: list[int] = Field(..., description="Audio latent rows [2A, Ca] (left channel's A rows, then the right's).")
    video_mp4: str | None = Field(
        None, description="Base64 of the MP4 (H.264 at 24 fps + AAC stereo 32 kHz). None when return_video is false.",
    )
    latents: str | None = Field(
        None,
        description="Base64 of safetensors bytes with fp32 tensors `video` [C,F,H,W] and `audio` [2A,Ca] "
        "(`safetensors.torch.load(base64.b64decode(latents))`). None unless return_latents is true.",
    )
    preview_png: str = Field(
        ..., description="Base64 PNG: the first decoded frame, or (without return_video) the first latent frame's "
        "channels 0-2, min-max normalized and upscaled.",
    )
    timings: Timings = Field(..., description="Engine phase timings.")
    stats: dict[str, Any] = Field(
        default_factory=dict, description="Engine counters (`engine.api.GenerationStats`, serialized): steps, "
        "forwards, frames, tokens, text_tokens, adaln_mode, schedule_key, adaln (plan cache), prompt_cache, and "
        "cache_dit / offload / parallel when on.",
    )
    serve_timings: ServeTimings | None = Field(
        None, description="Where the time outside the engine went (hops between the app's processes); "
        "None on a streamed result.")

    @classmethod
    def from_result(cls, result: GenerationResult, *, request_id: str, return_latents: bool) -> "GenerationResponse":
        video = result.video.detach().to("cpu", torch.float32).contiguous()
        audio = result.audio.detach().to("cpu", torch.float32).contiguous()
        latents = None
        if return_latents:
            latents = base64.b64encode(save_safetensors({"video": video, "audio": audio})).decode("ascii")
        if result.thumbnail_png is not None:
            preview = base64.b64encode(result.thumbnail_png).decode("ascii")
        else:
            preview = preview_png(video)
        return cls(
            id=request_id,
            model=result.model,
            seed=result.seed,
            video_shape=list(video.shape),
            audio_shape=list(audio.shape),
            video_mp4=base64.b64encode(result.mp4).decode("ascii") if result.mp4 is not None else None,
            latents=latents,
            preview_png=preview,
            timings=result.timings,
            stats=result.stats.model_dump(mode="json"),
        )


def decode_latents(latents_b64: str) -> dict[str, torch.Tensor]:
    """The inverse of `GenerationResponse.latents`: {"video": [C,F,H,W], "audio": [2A,Ca]}."""
    return load_safetensors(base64.b64decode(latents_b64))


def preview_png(video: torch.Tensor, size_px: int = PREVIEW_PX) -> str:
    """Base64 PNG of video[0:3, 0] (channels as RGB), each channel min-max normalized, nearest-upscaled."""
    frame = video[:3, 0].float()  # [c<=3, H, W]
    if frame.shape[0] < 3:
        frame = torch.cat([frame, frame[-1:].expand(3 - frame.shape[0], -1, -1)])
    lo = frame.amin(dim=(1, 2), keepdim=True)
    hi = frame.amax(dim=(1, 2), keepdim=True)
    frame = (frame - lo) / (hi - lo).clamp_min(1e-12)
    pixels = (frame.nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)  # [H, W, 3]
    height, width = pixels.shape[:2]
    factor = max(1, size_px // max(height, width))
    image = Image.fromarray(np.ascontiguousarray(pixels.numpy()), mode="RGB")
    image = image.resize((width * factor, height * factor), Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class ProgressEvent(BaseModel):
    """One transformer forward done (streaming): SSE event `progress`, or an item of `generate_stream`."""

    step: int = Field(..., description="Transformer forwards done (0: accepted, before the first forward).")
    steps: int = Field(..., description="Transformer forwards of the request: its `steps` - 1.")
    elapsed_s: float = Field(..., description="Seconds since the worker accepted the request.")


class WeightUpdateRequest(BaseModel):
    """Body of `POST /admin/weights`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(..., description="Checkpoint directory under one of admin.weight_roots (relative: to the first).")


class FieldError(BaseModel):
    """One bad field of a refused request."""

    loc: list[str | int] = Field(..., description="Where: the field name (and index) in the body or query.")
    msg: str = Field(..., description="What is wrong with it.")
    type: str = Field(..., description="Validation error kind (pydantic's, or value_error for a model limit).")


class ErrorBody(BaseModel):
    type: str = Field(
        ..., description="invalid_request | invalid_json | invalid_id | unauthorized | not_found | conflict | "
        "expired | method_not_allowed | payload_too_large | unsupported_media_type | range_not_satisfiable | "
        "queue_full | overloaded | unavailable | timeout | server_error | cancelled.",
    )
    message: str = Field(..., description="What was wrong and, where possible, how to fix it.")
    errors: list[FieldError] | None = Field(None, description="Per-field errors (the field, what is wrong).")


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body of every route (`/v1/generations`, `/v1/videos`, admin, routing refusals)."""

    error: ErrorBody


# --------------------------------------------------------------------------------------------------
# App config (serve_config.yaml `args`)
# --------------------------------------------------------------------------------------------------


#: GPU shares of one device when `stages: split` puts the three stages on it: the worker's 0.6 keeps a second
#: worker off a device (two transformers and their activations do not fit one H200 beside the encoder), the
#: text encoder and the decoder take 0.2 each. H3 on one H200: transformer 37.4 GiB (online AdaLN) + text
#: encoder 46.9 + video VAE 5.2 + audio VAE 0.6 = 90.1 GiB of 139, the rest for activations and the plan slab.
SPLIT_WORKER_GPUS = 0.6
SPLIT_STAGE_GPUS = 0.2


def one_share_or_whole_gpus(num_gpus: float | None) -> float | None:
    """A replica's GPUs: a share of one device (< 1) or whole devices, never a fraction spanning two."""
    if num_gpus is not None and num_gpus > 1 and num_gpus != int(num_gpus):
        raise ValueError(f"num_gpus={num_gpus:g}: a replica takes a share of one GPU (< 1) or whole GPUs")
    return num_gpus


class AutoscalingOptions(BaseModel):
    """Worker autoscaling (Ray Serve `autoscaling_config`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min_replicas: int | None = Field(
        None, ge=0, description="Fewest worker replicas. None: as many as the cluster's GPUs hold at build time "
        "(GPUs / GPUs per replica), so every GPU serves from the start; 1 without GPUs.",
    )
    max_replicas: int | None = Field(
        None, ge=1, description="Most worker replicas. None: as many as the cluster's GPUs hold at build time "
        "(GPUs / GPUs per replica) and at least min_replicas, or 1 without GPUs.",
    )
    target_ongoing_requests: float = Field(1.0, gt=0, description="Requests per replica the autoscaler aims for.")

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscalingOptions":
        if self.max_replicas is not None and self.min_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}")
        return self


class WorkerOptions(BaseModel):
    """How the worker deployment is replicated and placed."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_replicas: int | None = Field(None, ge=1, description="Fixed replica count; None: use `autoscaling`.")
    autoscaling: AutoscalingOptions = Field(default_factory=AutoscalingOptions, description="Used when num_replicas is None.")
    num_gpus: float | None = Field(
        None, ge=0, description=f"GPUs per replica; None: 1 if the Ray cluster has GPUs at build time "
        f"({SPLIT_WORKER_GPUS} with stages: split, the text encoder and decoder sharing the device) and its models "
        "do not all run on the CPU (engine.device: cpu), else 0. With "
        "engine.parallel.sp > 1 a replica takes sp GPUs, one per rank actor (any other value is refused)."
    )
    _num_gpus = field_validator("num_gpus")(one_share_or_whole_gpus)
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per replica.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica (e.g. a node or accelerator tag), "
        "beside num_gpus / num_cpus.",
    )
    max_ongoing_requests: int = Field(
        4, ge=1, description="Requests one replica holds (it runs one generation at a time; the rest wait in order)."
    )
    router: Literal["schedule_affinity", "default"] = Field(
        "schedule_affinity",
        description="schedule_affinity: requests with the same sampling schedule go to the same replica (warm AdaLN "
        "plans), spilling over under load (deployments/routing/); default: Serve's power-of-two-choices router.",
    )
    load_factor: float = Field(
        1.25, ge=1.0, description="schedule_affinity: a replica takes a key's request while its load stays under "
        "load_factor x the mean; larger keeps affinity longer under skew.",
    )
    hold_factor: float = Field(
        3.0, ge=1.0, description="schedule_affinity: a replica whose GPU plan slab holds the request's schedule "
        "takes it while its load stays under hold_factor x the mean (a slab hit is far cheaper than a rebuild).",
    )
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="schedule_affinity: how often each replica reports its load and what its GPU plan "
        "slab holds to the routers (Serve's request_routing_stats_period_s; Serve's own default is 10 s).",
    )
    graceful_shutdown_timeout_s: float = Field(
        5.0, ge=0, description="When a replica stops (Ctrl-C on `serve run`, a redeploy, a downscale), how long it "
        "may keep running its queued and in-flight generations before they are cancelled and it is killed. "
        "Short, so `serve run` stops within seconds; raise it to let long generations finish on a downscale.",
    )




class StageOptions(BaseModel):
    """How a stage deployment (TextEncoder, Decoder) of `stages: split` is replicated and placed."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_replicas: int | None = Field(None, ge=1, description="Fixed replica count; None: use `autoscaling`.")
    autoscaling: AutoscalingOptions = Field(
        default_factory=AutoscalingOptions,
        description="Used when num_replicas is None; max_replicas None: one per GPU in the cluster (1 without GPUs).",
    )
    num_gpus: float | None = Field(
        None, ge=0, description=f"GPUs per replica; None: {SPLIT_STAGE_GPUS} of a device if the Ray cluster has GPUs "
        "at build time (it shares the device with a worker) and its device is not the CPU, else 0.",
    )
    _num_gpus = field_validator("num_gpus")(one_share_or_whole_gpus)
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per replica.")
    max_ongoing_requests: int = Field(
        8, ge=1, description="Requests one replica holds (it runs one at a time on its device; the rest wait in order)."
    )
    graceful_shutdown_timeout_s: float = Field(
        5.0, ge=0, description="How long a stopping replica may finish what it holds before it is killed.",
    )


class HttpOptions(BaseModel):
    """Limits the ingress enforces before anything reaches a worker."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_body_bytes: int = Field(64 * 1024, ge=256, description="Request bodies above this get HTTP 413.")
    request_timeout_s: float = Field(600.0, gt=0, description="Longest a generation may take before HTTP 504.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray resources per ingress replica, e.g. a custom resource of the "
        "cluster's CPU/head nodes, so that losing a GPU node never takes an ingress replica (and every request it "
        "holds, answered by Serve's proxy as a bare 500) with it.")
    health_timeout_s: float = Field(10.0, gt=0, description="Longest /healthz waits for the worker.")
    max_ongoing_requests: int = Field(
        256, ge=1, description="Requests one ingress replica holds at once; the HTTP proxy queues the rest. Open "
        "video event streams and /v1/videos/sync waits count, so keep it well above the expected watchers.",
    )
    max_pending_generations: int | None = Field(
        None, ge=1, description="Generations (HTTP /v1/generations and its stream, handle generate and "
        "generate_stream) one ingress replica holds at once, running or waiting for a worker; one more is refused at "
        "once with 503 + Retry-After instead of waiting in Serve's queue until request_timeout_s (504). null: no "
        "bound. Video jobs are not counted (jobs.max_queued_per_model bounds them).",
    )
    graceful_shutdown_timeout_s: float = Field(
        2.0, ge=0, description="When the ingress stops, how long its open requests may still wait for their "
        "generations before they are cut; at least the stages' graceful_shutdown_timeout_s + 2 s (deployments."
        "app.ingress_graceful_shutdown_s), so that when the whole app stops each open generation hears its worker "
        "stop (a 503 naming it) instead of the proxy's bare 500.",
    )
    playground: bool = Field(
        True, description="GET / serves the playground page (a prompt form, live progress, the clip and the job "
        "list, over the public API only); false for API-only deployments (GET / then answers 404).",
    )


class AdminOptions(BaseModel):
    """Admin routes (`/admin/*`): off unless a token is configured here or in $DITSERVE_ADMIN_TOKEN."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    token: str | None = Field(
        None, description="Bearer token of the admin routes; null: $DITSERVE_ADMIN_TOKEN of the ingress process, "
        "and with neither the admin routes answer 404.",
    )
    weight_roots: list[str] = Field(
        default_factory=list, description="Directories weight updates may read from (symlinks resolved); "
        "empty: [engine.checkpoint_root].",
    )
    update_timeout_s: float = Field(
        600.0, gt=0, description="Longest POST /admin/weights waits for every live worker replica to apply the "
        "update (a replica finishes its queued requests first).",
    )


#: `quality: high` of a video job: Cache-DiT DBCache F1B0 W4 R0.04 MC1 (shared/reference.md: H3 on 4 H200,
#: 1.40x at 28.16 dB PSNR against exact sampling).
HIGH_QUALITY_CACHE_DIT = CacheDitOverrides(
    enabled=True, Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=4, residual_diff_threshold=0.04,
    max_continuous_cached_steps=1,
)


class VideoOptions(BaseModel):
    """How the ingress turns a video job into an engine request (`POST /v1/videos`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    high_quality: CacheDitOverrides = Field(
        HIGH_QUALITY_CACHE_DIT,
        description="Cache-DiT settings of `quality: high` (`lossless` always runs with Cache-DiT off). Needs "
        "engine.cache_dit.enabled: true; without it `quality: high` is refused with a 422.",
    )
    validate_timeout_s: float = Field(
        5.0, gt=0, description="How long POST /v1/videos waits for what holds the tokenizer (the Worker, or the "
        "TextEncoder with stages: split) to count the prompt's tokens; every other bound is checked against the "
        "served ModelLimits without a call. One that does not answer in time does not block creation: the job is "
        "queued and checked again when it runs.",
    )

    @model_validator(mode="after")
    def _high_quality_caches(self) -> "VideoOptions":
        if self.high_quality.enabled is not True:
            raise ValueError("high_quality.enabled must be true: quality high is a Cache-DiT profile")
        return self


class AppConfig(BaseModel):
    """`args` of serve_config.yaml: validated once in `build_app`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    engine: EngineConfig = Field(default_factory=EngineConfig, description="The engine each worker replica runs.")
    stages: Literal["split", "fused"] = Field(
        "split",
        description="split: the text encoder, the denoiser (Worker) and the decoder are three deployments, so the "
        "denoiser never waits for a prompt encode or a VAE decode (a job decodes while the next one denoises); "
        "fused: one Worker deployment runs every stage. An app of more than one partition runs split either way "
        "(fused, each partition's Worker would load its own text encoder and VAEs; split, one TextEncoder and one "
        "Decoder serve them all). A sequence-parallel engine (engine.parallel.sp > 1) always runs fused (its rank 0 "
        "decodes), so with two partitions each replica holds its own text encoder and VAEs.",
    )
    text_encoder: StageOptions = Field(default_factory=StageOptions,
                                       description="The TextEncoder deployment (stages: split).")
    decoder: StageOptions = Field(default_factory=StageOptions, description="The Decoder deployment (stages: split).")
    worker: WorkerOptions = Field(default_factory=WorkerOptions, description="Worker replication and placement.")
    http: HttpOptions = Field(default_factory=HttpOptions, description="Ingress request limits.")
    admin: AdminOptions = Field(default_factory=AdminOptions, description="Admin routes: fleet weight updates.")
    jobs: JobsConfig = Field(
        default_factory=JobsConfig,
        description="Video jobs (/v1/videos): job database, output store, queue bound, leases, retention. A "
        "relative state_dir lies next to engine.checkpoint_root (in the same parent directory).",
    )
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Optional API keys of the video routes.")
    videos: VideoOptions = Field(default_factory=VideoOptions, description="What video jobs ask the engine for.")

    partitions: tuple[Literal["fl2va", "ref2va"], ...] | None = Field(
        None, min_length=1,
        description="The MiniMax-H3 partitions this app serves behind its one ingress, each a Worker (denoiser) "
        "deployment of its own, with its own AdaLN plan cache (keyed by its transformer's weights) and router; the "
        "request's task picks one (t2va, fl2va -> fl2va; ref2va -> ref2va), GET /v1/models lists each. The first "
        "is the `Worker` deployment, the others `Worker-<partition>`. split: one TextEncoder and one Decoder serve "
        "them all (the text encoder and VAEs are loaded once); more than one partition runs split even with stages: "
        "fused, except a sequence-parallel engine (each Worker then holds its own). null: engine.partition alone.")

    @model_validator(mode="after")
    def _partitions_once(self) -> AppConfig:
        if self.partitions is None:
            return self
        if len(set(self.partitions)) != len(self.partitions):
            raise ValueError(f"partitions: {list(self.partitions)} lists a partition twice")
        if "partition" in self.engine.model_fields_set and self.engine.partition not in self.partitions:
            raise ValueError(f"engine.partition: {self.engine.partition} is not in partitions: "
                             f"{list(self.partitions)}; leave engine.partition out (partitions names what is served)")
        return self

    @model_validator(mode="after")
    def _adapters_of_served_partitions(self) -> AppConfig:
        # An adapter of a partition this app does not serve would load nowhere and be listed nowhere: say so.
        for name, adapter in self.engine.adapters.items():
            if adapter.partition not in self.served_partitions:
                raise ValueError(f"engine.adapters.{name}.partition: {adapter.partition} is not served by this app "
                                 f"(partitions: {list(self.served_partitions)}): remove it, or serve its partition")
        return self

    @property
    def served_partitions(self) -> tuple[Literal["fl2va", "ref2va"], ...]:
        """The partitions served, the first the app's default model (`Worker`)."""
        return self.partitions if self.partitions is not None else (self.engine.partition,)
