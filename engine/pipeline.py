"""The one composition of a generation's stages: prompt -> denoise -> decode + mux (plain Python, no Ray).

    PromptStep.encode(request)                 -> PromptEmbedding   (Qwen3-VL; keyframes' vision blocks)
    DenoiseStep.denoise(request, embedding)    -> GenerationResult  (AdaLN plans, the loop; the latents)
    DecodeStep.decode(latents)                 -> DecodedVideo      (the VAEs, the MP4 and what it holds)

`Pipeline.run` is the only place that orders them, checks cancellation between them, says when the denoiser
is done with a request (`on_denoised`: a job service starts the next job while this one decodes) and adds up
the per-stage timings. Where the steps run is the caller's choice:

- in one process (`engine.engine.Engine.generate`: tests, a fused Serve worker, every rank of a multi-GPU
  replica): `local_steps` of an engine, run to completion by `run_local` on the caller's thread;
- across Serve deployments (`stages: split`): the ingress runs the same `Pipeline` over handle-backed steps
  (`deployments/generation.py`), so the Worker replica is a pure denoiser whose request slot and load
  report count denoising only.

The steps are async so that the split app awaits its handles; the local steps run their blocking work
inline (one thread, one generation: nothing else shares that event loop).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from engine.api import CancelledFn, GenerationRequest, GenerationResult, Latents, ProgressFn
from engine.errors import GenerationCancelled
from engine.stage_data import DecodedVideo, PromptEmbedding

if TYPE_CHECKING:
    from engine.stages import DecodeStage  # the local decode stage (model code): typed, not imported

__all__ = [
    "DecodeStep", "DenoiseStep", "LocalEngine", "Pipeline", "PipelineResult", "PromptStep", "StageCallTimes",
    "check_cancelled", "local_steps", "run_local",
]


class PromptStep(Protocol):
    """The prompt's conditioning. Raises ClientError for a prompt (or keyframe/reference) it cannot take, and
    GenerationCancelled when `cancelled()` is true before it starts."""

    async def encode(self, request: GenerationRequest, cancelled: CancelledFn) -> PromptEmbedding: ...


class DenoiseStep(Protocol):
    """AdaLN plans and the denoising loop: the result's latents, no MP4. Calls `on_progress(step, steps)` after
    every forward (None: nobody follows, so a remote step sends no progress events) and stops at the next step
    boundary once `cancelled()` is true (GenerationCancelled)."""

    async def denoise(self, request: GenerationRequest, embedding: PromptEmbedding, on_progress: ProgressFn | None,
                      cancelled: CancelledFn) -> GenerationResult: ...


class DecodeStep(Protocol):
    """The latents as a clip: the MP4 (H.264 + AAC), its thumbnail and the clip's facts."""

    async def decode(self, latents: Latents) -> DecodedVideo: ...


@dataclass(frozen=True)
class StageCallTimes:
    """Seconds the caller waited on each step (its work, plus queues and transfers when a step is another
    process); None: not called, or run inside the denoiser's call (a fused worker: `denoise_call_s` is then the
    whole generation)."""

    encode_call_s: float | None
    denoise_call_s: float
    decode_call_s: float | None


@dataclass(frozen=True)
class PipelineResult:
    """A finished generation: the denoiser's result with the MP4, thumbnail and clip facts when decoded, its
    timings the stages' own; `calls`: what each step call took as the pipeline saw it."""

    result: GenerationResult
    calls: StageCallTimes


def check_cancelled(cancelled: CancelledFn) -> None:
    if cancelled():
        raise GenerationCancelled("generation cancelled by the caller")


def _never() -> bool:
    return False


class Pipeline:
    """prompt -> denoise -> decode over three steps; `decode` None: the result carries latents only (a
    multi-GPU replica's ranks other than 0, which hold no VAEs)."""

    def __init__(self, prompt: PromptStep, denoise: DenoiseStep, decode: DecodeStep | None) -> None:
        self.prompt, self.denoise, self.decode = prompt, denoise, decode

    async def run(
        self, request: GenerationRequest, on_progress: ProgressFn | None = None, cancelled: CancelledFn | None = None,
        on_denoised: Callable[[], None] | None = None,
    ) -> PipelineResult:
        """Run `request` through the steps. The prompt and denoise steps check `cancelled` themselves (a
        multi-GPU engine agrees on it across ranks); the pipeline checks it again before decoding. `return_video`
        false: no decode. Errors are the steps' own (ClientError, ServerFault, GenerationCancelled, ...)."""
        cancelled = cancelled or _never
        start = time.perf_counter()
        embedding = await self.prompt.encode(request, cancelled)
        encoded = time.perf_counter()
        result = await self.denoise.denoise(request, embedding, on_progress, cancelled)
        denoised = time.perf_counter()
        if on_denoised is not None:
            on_denoised()
        decoded: DecodedVideo | None = None
        decode_call_s: float | None = None
        if request.return_video and self.decode is not None:
            check_cancelled(cancelled)
            decoded = await self.decode.decode(result.latents)
            decode_call_s = time.perf_counter() - denoised
            result = dataclasses.replace(result, mp4=decoded.mp4, thumbnail_png=decoded.thumbnail_png,
                                         clip=decoded.clip)
        timings = result.timings.with_stages(encode_s=embedding.encode_s,
                                             decode_s=decoded.decode_s if decoded else 0.0,
                                             mux_s=decoded.mux_s if decoded else 0.0)
        return PipelineResult(
            result=dataclasses.replace(result, timings=timings),
            calls=StageCallTimes(encode_call_s=encoded - start, denoise_call_s=denoised - encoded,
                                 decode_call_s=decode_call_s))


class LocalEngine(Protocol):
    """What a process holding every stage offers (`engine.engine.Engine`): blocking stage calls."""

    decode_stage: DecodeStage | None  # None on the ranks of a multi-GPU replica other than 0

    def encode(self, request: GenerationRequest, cancelled: CancelledFn | None = None) -> PromptEmbedding: ...

    def denoise(self, request: GenerationRequest, embedding: PromptEmbedding, progress: ProgressFn | None = None,
                cancelled: CancelledFn | None = None) -> GenerationResult: ...


@dataclass(frozen=True)
class LocalPrompt:
    engine: LocalEngine

    async def encode(self, request: GenerationRequest, cancelled: CancelledFn) -> PromptEmbedding:
        return self.engine.encode(request, cancelled)


@dataclass(frozen=True)
class LocalDenoise:
    engine: LocalEngine

    async def denoise(self, request: GenerationRequest, embedding: PromptEmbedding, on_progress: ProgressFn | None,
                      cancelled: CancelledFn) -> GenerationResult:
        return self.engine.denoise(request, embedding, on_progress, cancelled)


@dataclass(frozen=True)
class LocalDecode:
    stage: DecodeStage

    async def decode(self, latents: Latents) -> DecodedVideo:
        return self.stage.decode(latents.video, latents.audio)


def local_steps(engine: LocalEngine) -> tuple[PromptStep, DenoiseStep, DecodeStep | None]:
    """An engine's own stages as pipeline steps (its decode stage is read when built: rank 0's VAEs)."""
    decode = LocalDecode(engine.decode_stage) if engine.decode_stage is not None else None
    return LocalPrompt(engine), LocalDenoise(engine), decode


def run_local(pipeline: Pipeline, request: GenerationRequest, on_progress: ProgressFn | None = None,
              cancelled: CancelledFn | None = None) -> PipelineResult:
    """`pipeline.run` to completion on this thread (which must not be running an event loop): how a process
    that holds every stage generates."""
    return asyncio.run(pipeline.run(request, on_progress, cancelled))
