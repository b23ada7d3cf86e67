"""A fake engine with the real engine's API and request checks, for Serve-layer tests.

Latents are seeded noise of the request's real latent shapes (`model.geometry`, any 32-px multiple, 5-15 s):
same seed, same bits, no model. With `return_video` the "MP4" is `FAKE_MP4 + seed` (no decode) and the
thumbnail a PNG of the request's size, filled with `seed % 256`. A prompt starting with "slow" sleeps 0.1 s per
forward (to test timeouts and cancellation). Stats are typed as the real engine's. Its "slab" is an LRU of
schedules, each taking `steps - 1` of `adaln.gpu_plans` plans: a schedule's request builds its plans unless the
slab holds them (then all GPU hits), and `slab_state()` reports it like the real engine's (so the router places
schedules by it). Importable by Ray workers (module-level class), and light: a fake replica's process imports
no model library (`model.tiny`'s width is restated as `TINY_HIDDEN_SIZE`, checked in tests/test_limits.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from engine.api import (AdalnStats, AdapterStats, ClipFacts, GenerationRequest, GenerationResult, GenerationStats,
                        GenerationTimings, SlabState, field_error, request_size)
from engine.config import EngineConfig
from engine.media import AUDIO_SAMPLE_RATE
from engine.errors import ClientError, GenerationCancelled, WeightsRejected
from engine.model_limits import geometry_limits, model_limits
from engine.startup import EngineStartup
from model.geometry import H3_LATENTS, GeometryError, VideoGeometry
from model.mp4 import thumbnail_png

FAKE_MP4 = b"fake-mp4:"
FAKE_MODEL = "fake-h3"
FAKE_TEXT_TOKENS = 8
#: `model.tiny.TINY_TRANSFORMER.hidden_size`: not the released width, so any 32-px multiple is served.
TINY_HIDDEN_SIZE = 64


class FakeEngine:
    #: A fake measures no start-up.
    startup: EngineStartup | None = None

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.limits = model_limits(config, TINY_HIDDEN_SIZE)  # any 32-px multiple, 5-15 s
        self.num_requests = 0
        self.num_cancelled = 0
        self._slab: OrderedDict[str, int] = OrderedDict()  # schedule key -> plans, least recently used first
        self._slab_lock = threading.Lock()
        self._adapters: tuple[str, ...] = ()  # the adapters of the last request naming some: an LRU of one request

    def validate(self, request: GenerationRequest) -> VideoGeometry:
        if request.guidance_scale != 1.0:
            raise ClientError("guidance_scale", f"{request.guidance_scale} is not served: MiniMax-H3 is CFG-distilled")
        if request.steps > self.limits.max_steps:
            raise ClientError("steps", f"{request.steps} exceeds this server's max_steps={self.limits.max_steps}")
        try:
            width, height = request_size(request, self.limits)
            return VideoGeometry.from_seconds(width, height, request.seconds,
                                              geometry_limits(self.limits), H3_LATENTS)
        except GeometryError as exc:
            raise field_error(exc, request) from None

    def generate(self, request: GenerationRequest, progress=None, cancelled=None) -> GenerationResult:
        geometry = self.validate(request)
        start = time.perf_counter()
        seed = 12345 if request.seed is None else request.seed
        generator = torch.Generator().manual_seed(seed)
        video = torch.randn(geometry.video_latent_shape, generator=generator)
        audio = torch.randn(geometry.num_audio_rows, H3_LATENTS.audio_latent_channels, generator=generator)
        num_forwards = request.steps - 1
        adaln = self._serve_schedule(request.schedule_key, num_forwards)
        adapters = self._serve_adapters(request)
        for i in range(num_forwards):
            if cancelled is not None and cancelled():
                self.num_cancelled += 1
                raise GenerationCancelled("cancelled")
            if request.prompt.startswith("slow"):
                time.sleep(0.1)
            if progress is not None:
                progress(i + 1, num_forwards)
        self.num_requests += 1
        total = time.perf_counter() - start
        mp4 = thumbnail = clip = None
        if request.return_video:
            mp4 = FAKE_MP4 + str(seed).encode()
            thumbnail = thumbnail_png(np.full((geometry.height, geometry.width, 3), seed % 256, dtype=np.uint8))
            clip = ClipFacts(num_frames=geometry.num_frames, fps=float(H3_LATENTS.fps), sample_rate=AUDIO_SAMPLE_RATE)
        return GenerationResult(
            video=video, audio=audio, seed=seed, model=FAKE_MODEL, mp4=mp4, thumbnail_png=thumbnail, clip=clip,
            timings=GenerationTimings(denoise_s=total, total_s=total),
            stats=GenerationStats(
                steps=request.steps, forwards=num_forwards, frames=geometry.num_frames,
                tokens=geometry.num_tokens(FAKE_TEXT_TOKENS), text_tokens=FAKE_TEXT_TOKENS,
                adaln_mode=self.config.adaln.mode, schedule_key=request.schedule_key, adaln=adaln, adapters=adapters,
            ),
        )

    def _serve_schedule(self, key: str, num_plans: int) -> AdalnStats | None:
        """The fake plan cache: hits when the slab holds the schedule, else builds it (evicting LRU schedules)."""
        with self._slab_lock:
            hit = key in self._slab
            self._slab[key] = num_plans
            self._slab.move_to_end(key)
            while sum(self._slab.values()) > self.config.adaln.gpu_plans and len(self._slab) > 1:
                self._slab.popitem(last=False)
        if self.config.adaln.mode != "online":
            return None
        if hit:
            return AdalnStats(requests=1, gpu_hit_plans=num_plans)
        return AdalnStats(requests=1, built_plans=num_plans)

    def _serve_adapters(self, request: GenerationRequest) -> AdapterStats | None:
        """The fake adapter set: holds the last request's adapters only; `loaded` those it did not hold."""
        if not request.adapters:
            return None
        names = request.adapter_names
        loaded = [name for name in names if name not in self._adapters]
        self._adapters = names
        return AdapterStats(scales={name: 1.0 for name in names}, loaded=loaded)

    def held_adapters(self) -> tuple[str, ...]:
        return self._adapters

    def prefetch_adapters(self, request: GenerationRequest) -> None:
        pass

    def slab_state(self) -> SlabState:
        with self._slab_lock:
            resident = list(reversed(self._slab.items()))
        used = sum(n for _, n in resident)
        return SlabState(tuple(k for k, _ in resident), tuple(n for _, n in resident),
                         self.config.adaln.gpu_plans, max(0, self.config.adaln.gpu_plans - used))

    def validate_weight_update(self, path: str) -> str:
        raise WeightsRejected("this engine does not support weight updates")

    def update_weights(self, path: str) -> dict[str, Any]:
        raise WeightsRejected("this engine does not support weight updates")

    def debug_stats(self) -> dict[str, Any]:
        return {"model": FAKE_MODEL}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "requests": self.num_requests, "cancelled": self.num_cancelled}

    def describe(self) -> dict[str, Any]:
        return {"id": FAKE_MODEL, "object": "model", "device": "cpu",
                "limits": self.limits.model_copy(update={"name": FAKE_MODEL}).model_dump(mode="json"),
                "engine_config": self.config.model_dump(mode="json")}
