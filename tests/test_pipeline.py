"""The one composition of a generation's stages (`engine.pipeline.Pipeline`) and the one stream follower the
Serve side runs it with (`deployments.generation.follow`), over fakes: order, cancellation between stages,
`on_denoised` before the decode, timings, and errors passing through unchanged."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import torch

from engine.api import ClipFacts, GenerationRequest, GenerationResult, GenerationStats, GenerationTimings, Latents
from engine.errors import ClientError, GenerationCancelled
from engine.pipeline import Pipeline, run_local
from engine.stage_data import DecodedVideo, PromptEmbedding
from model.prompts import PromptCacheStats

CLIP = ClipFacts(num_frames=29, fps=24.0, sample_rate=32000)
CACHE = PromptCacheStats(hits=0, misses=1, evictions=0, entries=1, used_bytes=48, capacity_bytes=2**20)


@dataclass
class Steps:
    """Three fake steps recording what the pipeline asked of them, in order."""

    calls: list[str] = field(default_factory=list)
    refuse_prompt: bool = False
    cancel_after: str | None = None  # the step after which `cancelled()` turns true
    flag: bool = False

    def cancelled(self) -> bool:
        return self.flag

    def _done(self, name: str) -> None:
        self.calls.append(name)
        if self.cancel_after == name:
            self.flag = True

    async def encode(self, request: GenerationRequest, cancelled) -> PromptEmbedding:
        if cancelled():
            raise GenerationCancelled("before encode")
        if self.refuse_prompt:
            raise ClientError("prompt", "too long")
        self._done("encode")
        return PromptEmbedding(embeds=torch.zeros(3, 4), encode_s=0.25, cache=CACHE)

    async def denoise(self, request, embedding, on_progress, cancelled) -> GenerationResult:
        for step in range(1, request.steps):
            if on_progress is not None:
                on_progress(step, request.steps - 1)
        self._done("denoise")
        stats = GenerationStats(steps=request.steps, forwards=request.steps - 1, frames=29, tokens=10,
                                text_tokens=embedding.num_tokens, adaln_mode="online", schedule_key="k")
        return GenerationResult(video=torch.ones(2, 2, 2, 2), audio=torch.ones(4, 2), seed=1, model="m",
                                timings=GenerationTimings(plan_s=0.5, denoise_s=2.0, total_s=2.5), stats=stats)

    async def decode(self, latents: Latents) -> DecodedVideo:
        assert latents.video.shape == (2, 2, 2, 2)
        self._done("decode")
        return DecodedVideo(mp4=b"mp4", thumbnail_png=b"png", clip=CLIP, decode_s=1.0, mux_s=0.125)

    def denoised(self) -> None:
        self.calls.append("on_denoised")


def pipeline(steps: Steps, decode: bool = True) -> Pipeline:
    return Pipeline(steps, steps, steps if decode else None)


def request(**fields) -> GenerationRequest:
    return GenerationRequest(prompt="a fox", steps=4, seed=1, **fields)


@pytest.mark.parametrize("return_video, decode", [(True, True), (False, True), (True, False)])
def test_the_stages_run_in_order_and_the_timings_are_theirs(return_video, decode):
    steps = Steps()
    progress: list[tuple[int, int]] = []
    finished = asyncio.run(pipeline(steps, decode).run(request(return_video=return_video),
                                                        lambda s, n: progress.append((s, n)), None, steps.denoised))
    decoded = return_video and decode
    assert steps.calls == ["encode", "denoise", "on_denoised"] + (["decode"] if decoded else [])
    assert progress == [(1, 3), (2, 3), (3, 3)]
    result, timings = finished.result, finished.result.timings
    assert (result.mp4, result.thumbnail_png, result.clip) == ((b"mp4", b"png", CLIP) if decoded else (None,) * 3)
    assert (timings.encode_s, timings.plan_s, timings.denoise_s) == (0.25, 0.5, 2.0)
    assert (timings.decode_s, timings.mux_s) == ((1.0, 0.125) if decoded else (0.0, 0.0))
    assert timings.total_s == pytest.approx(0.25 + 0.5 + 2.0 + ((1.0 + 0.125) if decoded else 0.0))
    calls = finished.calls
    assert calls.encode_call_s >= 0 and calls.denoise_call_s >= 0
    assert (calls.decode_call_s is not None) == decoded


@pytest.mark.parametrize("cancel_after", ["encode", "denoise"])
def test_a_cancel_after_any_stage_never_reaches_the_decode(cancel_after):
    """The denoise step checks the flag between its own steps (this fake finishes anyway); the pipeline checks
    it again before decoding, so a cancelled request never pays the VAE decode and mux."""
    steps = Steps(cancel_after=cancel_after)
    with pytest.raises(GenerationCancelled):
        asyncio.run(pipeline(steps).run(request(), None, steps.cancelled, steps.denoised))
    assert steps.calls == ["encode", "denoise", "on_denoised"]


def test_a_step_error_passes_through_unchanged_and_nothing_after_it_runs():
    steps = Steps(refuse_prompt=True)
    with pytest.raises(ClientError) as refused:
        run_local(pipeline(steps), request())
    assert refused.value.field == "prompt" and steps.calls == []


# --- deployments.generation.follow ---------------------------------------------------------------------------


class FakeStream:
    """A worker's stream: `ProgressEvent`s then the result; records its cancel."""

    def __init__(self, items, block: bool = False) -> None:
        self.items, self.block, self.cancelled = list(items), block, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.block and not self.items:
            await asyncio.sleep(3600)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def result() -> GenerationResult:
    return asyncio.run(Steps().denoise(request(), PromptEmbedding(torch.zeros(1, 1), 0.0, CACHE),
                                       lambda s, n: None, lambda: False))


def test_follow_forwards_progress_returns_the_result_and_cancels_the_stream_on_exit():
    from deployments.generation import follow
    from deployments.schemas import ProgressEvent

    finished = result()
    stream = FakeStream([ProgressEvent(step=0, steps=3, elapsed_s=0.0), ProgressEvent(step=1, steps=3, elapsed_s=0.1),
                         finished])
    progress: list[tuple[int, int]] = []
    got = asyncio.run(follow(stream, lambda s, n: progress.append((s, n)), lambda: False))
    assert got is finished and progress == [(0, 3), (1, 3)] and stream.cancelled


def test_follow_stops_a_blocked_stream_once_cancelled_and_says_so():
    from deployments.generation import follow

    stream = FakeStream([], block=True)
    flag = {"cancel": False}

    async def scenario():
        task = asyncio.ensure_future(follow(stream, lambda s, n: None, lambda: flag["cancel"]))
        await asyncio.sleep(0.05)
        flag["cancel"] = True
        return await task

    with pytest.raises(GenerationCancelled):
        asyncio.run(scenario())
    assert stream.cancelled


@pytest.mark.parametrize("items, error", [
    ([], RuntimeError),  # ended without a result
    ([ClientError("steps", "too many")], ClientError),  # the worker's own error, unchanged
    ([asyncio.CancelledError()], GenerationCancelled),  # the call (not this task) was cancelled
])
def test_follow_raises_what_the_stream_ended_with(items, error):
    from deployments.generation import follow

    stream = FakeStream(items)
    with pytest.raises(error):
        asyncio.run(follow(stream, lambda s, n: None, lambda: False))
    assert stream.cancelled
