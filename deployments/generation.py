"""How the ingress runs a generation: `engine.pipeline.Pipeline` over Serve handles, or one fused worker call.

Both APIs (`/v1/generations` and the video job runner) hold one `GenerationRunner`, chosen when the app is
built (`runner_for`):

- `stages: split`: the ingress runs the one `Pipeline` itself over handle-backed steps: `TextEncoder.encode`
  (for fl2va / ref2va the embedding carries the keyframes' and references' condition latents),
  `Worker.denoise_stream` (`Worker.denoise` when no progress is followed), `Decoder.decode`. The Worker replica is a pure denoiser: its request slot, and the
  ongoing count it reports to the router, cover denoising only (never a wait on the Decoder).
- `stages: fused`: the worker's engine holds every stage and runs the same `Pipeline` in its process
  (`Engine.generate`); the runner follows its `generate_stream` (calls `Worker.generate` when no progress is
  followed).

A caller that follows no progress (`/v1/generations` without `stream`, a handle's `generate`) makes a unary
call: the worker hop took 13.8 ms that way against 15.1 ms as a stream of one item (bench.app on one H200).

Either way the caller gets a `PipelineResult` (MP4, thumbnail and clip facts when decoded; per-stage timings
and how long each call took), progress as `on_progress(step, steps)` (step 0 once the worker accepted the
request) and stops a running generation with `cancelled()` (polled every `CANCEL_POLL_S`) or by cancelling
the call. Errors are what the handles raised, unsorted (Ray's wrappers included): the callers sort them
(`deployments.errors`) into their API's answer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ray.serve.handle import DeploymentHandle

from deployments.schemas import ProgressEvent
from engine.errors import GenerationCancelled
from engine.api import CancelledFn, GenerationRequest, GenerationResult, Latents, ProgressFn
from engine.pipeline import Pipeline, PipelineResult, StageCallTimes, check_cancelled
from engine.stage_data import DecodedVideo, PromptEmbedding

__all__ = ["CANCEL_POLL_S", "FusedRunner", "GenerationRunner", "SplitRunner", "follow", "runner_for", "wait_result"]

#: How often a followed stream checks `cancelled()`.
CANCEL_POLL_S = 0.1


def _never() -> bool:
    return False


async def _answer(pending: asyncio.Future[Any], cancelled: CancelledFn) -> Any:
    """`pending`'s result, `cancelled()` polled every `CANCEL_POLL_S` meanwhile (GenerationCancelled once true);
    a `pending` cancelled by the worker's side (e.g. its replica stopping) is GenerationCancelled too."""
    while True:
        check_cancelled(cancelled)
        done, _ = await asyncio.wait({pending}, timeout=CANCEL_POLL_S)
        if done:
            try:
                return pending.result()
            except asyncio.CancelledError:
                raise GenerationCancelled("the worker cancelled the call") from None


async def _retrieved(pending: asyncio.Future[Any]) -> None:
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)  # retrieved: no "never retrieved" warning


async def follow(stream: Any, on_progress: ProgressFn, cancelled: CancelledFn) -> GenerationResult:
    """A worker's stream (`ProgressEvent`s, then the `GenerationResult`): progress to `on_progress`, the
    result returned. GenerationCancelled (`engine.pipeline.check_cancelled`) once `cancelled()` is true; leaving in
    any way (cancelled, failed, the caller's task cancelled) cancels the stream, which stops the engine at its next
    step."""
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(stream.__anext__())
            try:
                event = await _answer(pending, cancelled)
            except StopAsyncIteration:
                raise RuntimeError("the worker's stream ended without a result") from None
            pending = None
            if isinstance(event, ProgressEvent):
                on_progress(event.step, event.steps)
            else:
                return event
    finally:
        stream.cancel()  # a no-op once the worker finished
        if pending is not None and not pending.done():
            await _retrieved(pending)


async def wait_result(response: Any, cancelled: CancelledFn) -> GenerationResult:
    """A worker's unary call (`Worker.denoise` / `Worker.generate`): its `GenerationResult`, `cancelled()` polled as
    `follow` does; leaving in any way before the worker answered cancels the call, which stops the engine at its
    next step."""

    async def answer() -> GenerationResult:
        return await response

    pending = asyncio.ensure_future(answer())
    try:
        return await _answer(pending, cancelled)
    finally:
        if not pending.done():
            response.cancel()
            await _retrieved(pending)


class GenerationRunner(Protocol):
    """A generation as the ingress runs it (split or fused)."""

    async def check(self, request: GenerationRequest) -> None:
        """ClientError if what holds the tokenizer refuses the request's prompt (cheap; one call)."""

    async def run(self, request: GenerationRequest, on_progress: ProgressFn | None = None,
                  cancelled: CancelledFn | None = None,
                  on_denoised: Callable[[], None] | None = None) -> PipelineResult: ...


# --------------------------------------------------------------------------------------------------
# stages: split
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextEncoderStep:
    text_encoder: DeploymentHandle

    async def encode(self, request: GenerationRequest, cancelled: CancelledFn) -> PromptEmbedding:
        check_cancelled(cancelled)
        return await self.text_encoder.encode.remote(request)


@dataclass(frozen=True)
class WorkerDenoiseStep:
    worker: DeploymentHandle

    async def denoise(self, request: GenerationRequest, embedding: PromptEmbedding, on_progress: ProgressFn | None,
                      cancelled: CancelledFn) -> GenerationResult:
        # The schedule key lets the router keep requests of one schedule on the replica with warm AdaLN plans.
        if on_progress is None:
            return await wait_result(self.worker.denoise.remote(
                request, embedding, schedule_key=request.schedule_key, adapters=request.adapter_names), cancelled)
        stream = self.worker.options(stream=True).denoise_stream.remote(
            request, embedding, schedule_key=request.schedule_key, adapters=request.adapter_names)
        return await follow(stream, on_progress, cancelled)


@dataclass(frozen=True)
class DecoderStep:
    decoder: DeploymentHandle

    async def decode(self, latents: Latents) -> DecodedVideo:
        return await self.decoder.decode.remote(latents)


class SplitRunner:
    """The pipeline over the three deployments of a split app, run in the caller's process."""

    def __init__(self, worker: DeploymentHandle, text_encoder: DeploymentHandle, decoder: DeploymentHandle) -> None:
        self._text_encoder = text_encoder
        self._pipeline = Pipeline(TextEncoderStep(text_encoder), WorkerDenoiseStep(worker), DecoderStep(decoder))

    async def check(self, request: GenerationRequest) -> None:
        await self._text_encoder.validate.remote(request)  # the TextEncoder holds the tokenizer

    async def run(self, request: GenerationRequest, on_progress: ProgressFn | None = None,
                  cancelled: CancelledFn | None = None,
                  on_denoised: Callable[[], None] | None = None) -> PipelineResult:
        return await self._pipeline.run(request, on_progress, cancelled, on_denoised)


# --------------------------------------------------------------------------------------------------
# stages: fused
# --------------------------------------------------------------------------------------------------


class FusedRunner:
    """One worker call: its engine runs the pipeline (`Engine.generate`)."""

    def __init__(self, worker: DeploymentHandle) -> None:
        self._worker = worker

    async def check(self, request: GenerationRequest) -> None:
        await self._worker.validate.remote(request)  # the fused engine holds the tokenizer

    async def run(self, request: GenerationRequest, on_progress: ProgressFn | None = None,
                  cancelled: CancelledFn | None = None,
                  on_denoised: Callable[[], None] | None = None) -> PipelineResult:
        start = time.perf_counter()
        if on_progress is None:
            result = await wait_result(self._worker.generate.remote(
                request, schedule_key=request.schedule_key, adapters=request.adapter_names), cancelled or _never)
        else:
            stream = self._worker.options(stream=True).generate_stream.remote(
                request, schedule_key=request.schedule_key, adapters=request.adapter_names)
            result = await follow(stream, on_progress, cancelled or _never)
        if on_denoised is not None:  # the worker decoded too: it is free now, not earlier
            on_denoised()
        return PipelineResult(result=result, calls=StageCallTimes(
            encode_call_s=None, denoise_call_s=time.perf_counter() - start, decode_call_s=None))


def runner_for(worker: DeploymentHandle, text_encoder: DeploymentHandle | None,
               decoder: DeploymentHandle | None) -> GenerationRunner:
    """The app's runner: split when the builder passed the TextEncoder and Decoder handles (both or neither)."""
    if (text_encoder is None) != (decoder is None):
        raise ValueError("a split app needs both the TextEncoder and the Decoder handle")
    if text_encoder is None or decoder is None:
        return FusedRunner(worker)
    return SplitRunner(worker, text_encoder, decoder)

