"""The engine's API types: request, result, and the protocol a fake engine implements (no Ray).

`GenerationRequest` lives here rather than in `deployments/` so the engine does not import the Serve
layer (dependencies point one way: deployments -> engine); `deployments.schemas` re-exports it.

Geometry is the model's own: pixels and seconds in (the engine snaps frames to 17n+5 and derives the latent
grid and the audio length, `model.geometry`); `steps` counts sampling grid points, so a request runs
`steps - 1` transformer forwards (`model.schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Callable, Literal, Protocol

import torch
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, SerializerFunctionWrapHandler, field_validator,
                      model_serializer, model_validator)

from cache.cache_dit import CacheDitOverrides, CacheDitStats
from cache.plan_cache import AdalnStats
from engine.compiled import CompileStats
from engine.config import MAX_STEPS
from engine.errors import ClientError
from engine.limits import ADAPTER_NAME_PATTERN, MAX_PROMPT_CHARS, Linears, ModelLimits, Quality
from engine.media import has_audio_stream
from engine.startup import EngineStartup
from engine.wire import TensorsAsArrays
from model.geometry import GeometryError
from model.schedule import AUDIO_SHIFT, VIDEO_SHIFT, ScheduleError, Task, schedule_key
from model.prompts import PromptCacheStats
from offload.layerwise import OffloadStats

__all__ = [
    "AdalnStats", "AdapterChoice", "CacheDitStats", "CancelledFn", "ClipFacts", "EngineProtocol", "GenerationRequest", "GenerationResult",
    "GenerationStats", "GenerationTimings", "KeyframeInput", "OffloadStats", "ParallelStats", "ProgressFn",
    "PromptCacheStats", "RankStats", "ReferenceInput", "Task", "request_schedule_key", "request_size",
]

MAX_SEED = 2**63 - 1

#: progress(forwards_done, num_forwards) after each transformer forward.
ProgressFn = Callable[[int, int], None]
#: cancelled() -> True stops the request between steps with GenerationCancelled.
CancelledFn = Callable[[], bool]


#: Most keyframes (first and last) and references (the released model's 12) a request carries.
MAX_KEYFRAMES = 2
MAX_REFERENCES = 12


class KeyframeInput(BaseModel):
    """One keyframe of a fl2va request: an encoded image and where the clip shows it."""

    # In JSON the bytes are base64 (what a `data:` URL carries after its comma).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, val_json_bytes="base64",
                              ser_json_bytes="base64")

    image: bytes = Field(..., min_length=1, description="PNG, JPEG or WebP file bytes (the HTTP layer decodes "
                                                        "multipart uploads and data: URLs into these).")
    anchor: Literal["first", "last"] | None = Field(
        None, description="first: the clip starts on the image; last: it ends on it. Or give frame_index.")
    frame_index: int | None = Field(
        None, description="The frame-index form the APIs use: 0 (first) or -1 / the clip's last frame (last).")

    @model_validator(mode="after")
    def _one_position(self) -> KeyframeInput:
        if (self.anchor is None) == (self.frame_index is None):
            raise ValueError("give exactly one of anchor (first | last) and frame_index")
        return self


class ReferenceInput(BaseModel):
    """One reference of a ref2va request, encoded: an image, a video (with its soundtrack) or a soundtrack."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, val_json_bytes="base64",
                              ser_json_bytes="base64")

    kind: Literal["image", "video", "audio"] = Field(..., description="What the file is.")
    data: bytes = Field(..., min_length=1, description="The file bytes: PNG/JPEG/WebP, a video, or audio.")
    _has_audio: bool | None = PrivateAttr(None)

    @property
    def has_audio(self) -> bool:
        """Whether it adds the reference audio rows to the plans: a soundtrack, or a video whose file carries one
        (its header, read once: the router keys a request before any worker decodes it)."""
        if self._has_audio is None:
            self._has_audio = self.kind == "audio" or (self.kind == "video" and has_audio_stream(self.data))
        return self._has_audio


#: Most adapters one request composes (e.g. a distilled-step adapter and a style one).
MAX_ADAPTERS = 2


class AdapterChoice(BaseModel):
    """One configured LoRA adapter a request runs with (`engine.adapters`), by name, optionally at its own scale."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(..., pattern=ADAPTER_NAME_PATTERN, description="A name `GET /v1/models` lists under adapters.")
    scale: float | None = Field(None, ge=-8, le=8, allow_inf_nan=False,
                                description="Strength, a multiplier of the file's alpha / rank; null: the "
                                "adapter's configured scale.")


class GenerationRequest(BaseModel):
    """One generation of MiniMax-H3: t2va (text only), fl2va (`keyframes`) or ref2va (`references`).

    Checks here are model-independent; limits that depend on the loaded model and server (size rules,
    duration, prompt tokens, steps) are checked by the engine, which raises `engine.errors.ClientError`
    (a ValueError) naming the field and the limit.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS,
                        description="Text prompt, tokenized verbatim (no chat template); the server limits its tokens.")
    model: str | None = Field(None, min_length=1, max_length=128,
                              description="A served model's name (`GET /v1/models`: `limits.name`); null: the one "
                              "that serves the request's task (an app serving both partitions: the task picks it).")
    steps: int = Field(50, ge=2, le=MAX_STEPS,
                       description="Sampling grid points including the final 0: `steps - 1` transformer forwards.")
    seconds: float = Field(5.0, gt=0, le=60, allow_inf_nan=False,
                           description="Clip length at 24 fps; frames are snapped up to 17n+5 (5 s -> 124 frames).")
    width: int | None = Field(
        None, ge=32, le=8192, description="Width in pixels (a multiple of 32). null: the served "
        "model's default canvas's (`GET /v1/models` limits.default_size: 1344x768 for the release, 64x32 for the "
        "tiny model); fl2va: the first keyframe's aspect ratio on the model's canvas rule.")
    height: int | None = Field(None, ge=32, le=8192,
                               description="Height in pixels (a multiple of 32). null: see width.")
    flow_shift: float = Field(VIDEO_SHIFT, gt=0, le=1e4, allow_inf_nan=False,
                              description="Sigma shift of the video schedule (the model's: 12).")
    audio_flow_shift: float = Field(AUDIO_SHIFT, gt=0, le=1e4, allow_inf_nan=False,
                                    description="Sigma shift of the audio schedule (the model's: 3).")
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Seed of the initial noise; same seed, same bits. None: drawn at random."
    )
    guidance_scale: float = Field(
        1.0, allow_inf_nan=False,
        description="MiniMax-H3 is CFG-distilled: guidance is fixed at 1; any other value is refused.",
    )
    return_video: bool = Field(True, description="Decode the latents and return an MP4 (H.264 + AAC stereo).")
    return_latents: bool = Field(False, description="Include the latents (base64 safetensors) in the response.")
    cache_dit: CacheDitOverrides | None = Field(
        None, description="Per-request changes to the server's Cache-DiT settings (null: the server's)."
    )
    keyframes: tuple[KeyframeInput, ...] | None = Field(
        None, max_length=MAX_KEYFRAMES,
        description="fl2va: the first and/or last keyframe. Without width/height the canvas is the model's for "
        "the first keyframe's aspect ratio (768 short edge for the release).")
    references: tuple[ReferenceInput, ...] | None = Field(
        None, max_length=MAX_REFERENCES,
        description="ref2va, in the order the model reads them: up to 9 images, 3 videos, 3 soundtracks (never "
        "soundtracks alone). Served by the Ref2VA partition.")
    adapters: tuple[AdapterChoice, ...] = Field(
        (), max_length=MAX_ADAPTERS,
        description="LoRA adapters to run with (at most 2, composed). Fields left out (steps, flow_shift, "
        "audio_flow_shift) take the first adapter naming a default, else the model's.")

    quality: Quality | None = Field(
        None, description="lossless: bf16 block linears, Cache-DiT off; high: bf16 with Cache-DiT (the request's "
        "cache_dit, else the server's); fp8: float8 block linears, Cache-DiT off. Served tiers: `GET /v1/models` "
        "limits.qualities. null: the server's default tier (lossless where served, else fp8), Cache-DiT as today.")

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, prompt: str) -> str:
        # Only whitespace would generate from an empty conditioning: refused, as the video API does (jobs.limits).
        if not prompt.strip():
            raise ValueError("must not be blank")
        return prompt

    @field_validator("adapters")
    @classmethod
    def _distinct_adapters(cls, adapters: tuple[AdapterChoice, ...]) -> tuple[AdapterChoice, ...]:
        names = [adapter.name for adapter in adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"{names} names an adapter twice: give each adapter once, with its scale")
        return adapters

    @model_validator(mode="after")
    def _one_task(self) -> GenerationRequest:
        if self.keyframes and self.references:
            raise ValueError("keyframes (fl2va) and references (ref2va) are different tasks: send one of them")
        return self

    @property
    def task(self) -> Task:
        return Task.FL2VA if self.keyframes else Task.REF2VA if self.references else Task.T2VA

    @property
    def size_given(self) -> bool:
        """Whether the request names its canvas, or one edge of it (the other edge is then the default canvas's;
        one naming neither takes the model's: `request_size`)."""
        return self.width is not None or self.height is not None

    @property
    def schedule_key(self) -> str:
        """The AdaLN plan group this request needs (routes it to a warm replica); no tensors are built."""
        return request_schedule_key(self)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The adapters this request runs with, by name (routes it to a replica holding them)."""
        return tuple(choice.name for choice in self.adapters)


def request_size(request: GenerationRequest, limits: ModelLimits) -> tuple[int, int]:
    """(width, height) of a t2va request: its own edges, each one it leaves out the served model's default canvas's
    (`limits.default_size`, the checkpoint's rule). A fl2va / ref2va request without a size is placed by its conditioning stage."""
    width, _, height = limits.default_size.partition("x")
    return (request.width if request.width is not None else int(width),
            request.height if request.height is not None else int(height))


def request_schedule_key(request: GenerationRequest) -> str:
    # A soundtrack reference, or a video reference's own soundtrack, adds the t = 1 audio rows to every plan.
    reference_audio = any(reference.has_audio for reference in request.references or ())
    return schedule_key(request.steps, request.flow_shift, request.audio_flow_shift, request.task, reference_audio)


class GenerationTimings(BaseModel):
    """Seconds spent per phase inside the engine (`timings` of a response, as is)."""

    plan_s: float = Field(
        0.0, description="AdaLN plans for the schedule (a rebuild from the checkpoint on a cache miss).")
    encode_s: float = Field(
        0.0, description="Prompt encoding (Qwen3-VL, or the prompt-embedding cache) and seeded noise.")
    denoise_s: float = Field(0.0, description="The denoising loop (steps - 1 transformer forwards).")
    decode_s: float = Field(0.0, description="Video and audio VAE decode, the earlier clips' H.264 encode running "
                            "under it (0 without return_video).")
    mux_s: float = Field(0.0, description="The H.264 + AAC encode and MP4 mux the decode did not hide: waits for a "
                         "slower encoder, then the clips still with it, the flush, the audio and the thumbnail "
                         "(0 without return_video).")
    total_s: float = Field(0.0, description="Whole engine call.")

    def with_stages(self, *, encode_s: float, decode_s: float = 0.0, mux_s: float = 0.0) -> GenerationTimings:
        """The denoiser's timings (plan_s, denoise_s) with the prompt and decode stages' added; total_s their sum
        (`engine.pipeline.Pipeline`, wherever it runs)."""
        total = encode_s + self.plan_s + self.denoise_s + decode_s + mux_s
        return self.model_copy(update={"encode_s": encode_s, "decode_s": decode_s, "mux_s": mux_s, "total_s": total})


@dataclass
class RankStats:
    """Which rank of a multi-device replica produced a result (each rank's own engine reports it)."""

    sp: int  # ranks of the replica
    rank: int


@dataclass
class ParallelStats:
    """A multi-device replica's request as its coordinator (`actors.gpu_worker.ParallelEngine`) reports it."""

    sp: int  # ranks of the replica
    ranks_agree: bool  # every rank ended with rank 0's latents
    cached_steps_by_rank: list[list[int]] | None = None  # with Cache-DiT: each rank's cached forwards
    adaln_by_rank: list[AdalnStats] | None = None  # online AdaLN: each rank's plan cache counters


@dataclass
class AdapterStats:
    """The LoRA adapters a request ran with (`engine.adapters.AdapterSet`)."""

    scales: dict[str, float]  # adapter -> scale it ran at (fused ones included)
    fused: str | None = None  # the adapter added into the base weights for this request
    loaded: list[str] = dataclass_field(default_factory=list)  # adapters read from their files for this request (not held)
    load_s: float = 0.0  # seconds reading, installing, fusing or restoring weights for this request


class GenerationStats(BaseModel):
    """One generation's counters, each section typed by the module that counts it. Serialized (`model_dump`)
    it is the response's `stats` object, whose shape clients parse: `adaln` is `{}` without a plan cache
    (resident AdaLN), `cache_dit` carries `config` and `cached_steps`, `offload` leaves out the per-step
    bytes, and the sections of features that are off are absent."""

    steps: int = Field(..., description="Sampling grid points of the request.")
    forwards: int = Field(..., description="Transformer forwards run: steps - 1.")
    frames: int = Field(..., description="Video frames (snapped to 17n+5).")
    tokens: int = Field(..., description="Packed sequence length of one forward: text, audio and video tokens.")
    text_tokens: int = Field(..., description="Prompt tokens.")
    adaln_mode: str = Field(..., description="engine.adaln.mode: resident or online.")
    linears: Linears = Field("bf16", description="The weights the block linears ran with (the request's tier).")
    schedule_key: str = Field(..., description="The request's AdaLN plan group (router affinity key).")
    adaln: AdalnStats | None = Field(None, description="This request's plan cache counters; None: resident AdaLN.")
    prompt_cache: PromptCacheStats | None = Field(None, description="The prompt-embedding cache (cumulative).")
    cache_dit: CacheDitStats | None = Field(None, description="Cache-DiT's decisions; None: off on the server.")
    offload: OffloadStats | None = Field(
        None, description="Layerwise offload counters since it was applied (cumulative); None: offload off.")
    parallel: RankStats | ParallelStats | None = Field(None, description="Multi-device replicas only.")
    adapters: AdapterStats | None = Field(None, description="The LoRA adapters it ran with; None: none.")
    compile: CompileStats | None = Field(
        None, description="Compiled blocks' counters (cumulative; frames_compiled: graphs traced and compiled in "
        "this process; graphs_loaded: whole graphs loaded from compile.cache_dir at start, compile.precompiled, in "
        "graphs_load_s seconds; since_warmup: compiles after the start-up warm-up, 0 when every shape was warmed); "
        "None: engine.compile.mode off.")

    @model_serializer(mode="wrap")
    def _response_shape(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        data["adaln"] = data["adaln"] or {}
        if self.cache_dit is not None:
            data["cache_dit"] = {"config": self.cache_dit.config, "cached_steps": data["cache_dit"]["cached_steps"]}
        if self.offload is not None:
            data["offload"].pop("h2d_bytes_per_step")  # one number per forward: too long for a response
        if self.parallel is not None:
            data["parallel"] = {k: v for k, v in data["parallel"].items() if v is not None}
        return {k: v for k, v in data.items() if v is not None}


@dataclass(frozen=True)
class Latents(TensorsAsArrays):
    """A generation's latents, as the Decoder stage takes them (on the CPU, fp32)."""

    video: torch.Tensor  # [C, F, H, W]
    audio: torch.Tensor  # [2A, Ca] (left channel's A rows, then the right's)


@dataclass(frozen=True)
class ClipFacts:
    """What a decoded clip holds, as the decoder made it (no need to re-open the MP4 to learn it)."""

    num_frames: int
    fps: float
    sample_rate: int  # Hz of the soundtrack


@dataclass
class GenerationResult(TensorsAsArrays):
    """What the engine returns: latents on the CPU in fp32, the MP4 when asked, phase timings and counters.
    Its tensors cross processes as arrays (`engine.wire`)."""

    video: torch.Tensor  # [C, F, H, W] fp32 video latents, cpu
    audio: torch.Tensor  # [2A, Ca] fp32 audio latent rows (left channel's A rows, then the right's), cpu
    seed: int
    model: str
    timings: GenerationTimings
    stats: GenerationStats
    mp4: bytes | None = None  # H.264 + AAC, when the request asked for video
    thumbnail_png: bytes | None = None  # first decoded frame
    clip: ClipFacts | None = None  # what the MP4 holds, when decoded

    @property
    def latents(self) -> Latents:
        return Latents(self.video, self.audio)


@dataclass(frozen=True)
class SlabState:
    """What the engine's GPU plan slab holds, for routing: the schedules whose plans are all resident (a
    request for one would find every plan in the slab), in the slab's eviction order with the next victims
    last (`engine.served`), with each one's number of distinct plans, and the slab's size. An engine without a
    slab (resident AdaLN) reports `NO_SLAB`."""

    schedule_keys: tuple[str, ...] = ()
    schedule_plans: tuple[int, ...] = ()  # distinct plans of each schedule in `schedule_keys`
    capacity_plans: int = 0  # adaln.gpu_plans; 0: no slab (every schedule is as good as any other)
    free_plans: int = 0  # slots holding no plan

    def __post_init__(self) -> None:
        if len(self.schedule_keys) != len(self.schedule_plans):
            raise ValueError("SlabState: one plan count per schedule key")


NO_SLAB = SlabState()


class EngineProtocol(Protocol):
    """What the Serve worker needs from an engine. `engine.engine.Engine` is the real one; a fake for
    Serve-layer tests implements the same. Errors are `engine.errors` types."""

    def validate(self, request: GenerationRequest) -> None:
        """ClientError if the loaded model cannot take `request` (cheap; no generation work)."""

    def generate(
        self, request: GenerationRequest, progress: ProgressFn | None = None, cancelled: CancelledFn | None = None
    ) -> GenerationResult: ...

    def validate_weight_update(self, path: str) -> str:
        """The checkpoint's fingerprint, or WeightsRejected; writes nothing."""

    def update_weights(self, path: str) -> dict[str, Any]:
        """Load the checkpoint at `path` in place, between generations; returns `describe()`."""

    def debug_stats(self) -> dict[str, Any]:
        """Plan bookkeeping for tests and operators; must include `model` (the served model's id)."""

    def held_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters held or loading now, by name (for routing; never waits on a generation)."""

    def prefetch_adapters(self, request: GenerationRequest) -> None:
        """Start loading `request`'s adapters that are not held, off the generation thread (never waits; a bad
        name is left to `generate`'s checks)."""

    def slab_state(self) -> SlabState:
        """Which schedules the GPU plan slab holds whole (cheap, thread-safe: called beside a generation)."""

    def health(self) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]: ...

    #: How the engine's constructor spent its time (None for an engine that does not measure it, e.g. a fake).
    startup: EngineStartup | None


def with_adapter_defaults(request: GenerationRequest, limits: ModelLimits) -> GenerationRequest:
    """`request` with its adapters' defaults in the fields it did not set (`model_fields_set`): steps, flow_shift,
    audio_flow_shift, each from the first of its adapters naming one. ClientError on `adapters` naming an adapter
    this server does not hold (the message lists the ones it does). Idempotent."""
    defaults: dict[str, object] = {}
    for choice in request.adapters:
        served = limits.adapter(choice.name)
        if served is None:
            raise ClientError("adapters", limits.unknown_adapter(choice.name),
                              "served: " + ", ".join(a.name for a in limits.adapters))
        for name, value in (("steps", served.steps), ("flow_shift", served.flow_shift),
                            ("audio_flow_shift", served.audio_flow_shift)):
            if value is not None and name not in request.model_fields_set:
                defaults.setdefault(name, value)
    return request.model_copy(update=defaults) if defaults else request


#: model/ names of request fields, as the request spells them.
_REQUEST_FIELDS = {"num_steps": "steps", "video_shift": "flow_shift", "audio_shift": "audio_flow_shift",
                   "num_frames": "seconds"}


def field_error(exc: GeometryError | ScheduleError, request: GenerationRequest) -> ClientError:
    """A `model/` refusal (field, value, limit) as the engine's ClientError on the request's field."""
    field = _REQUEST_FIELDS.get(exc.field, exc.field)
    detail = f"{exc.value!r} is out of range: {exc.limit}"
    if field == "width*height" and request.width is not None and request.height is not None:
        # The area: the long edge is the one to shrink (the short edge is fixed).
        field = "width" if request.width >= request.height else "height"
        detail = f"{request.width}x{request.height} = {exc.value} px is out of range: {exc.limit}"
    return ClientError(field, detail, exc.limit)
