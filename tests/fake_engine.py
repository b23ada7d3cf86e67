"""A fake engine with the real engine's API and limits (tiny preset), for Serve-layer tests.

Latents are seeded noise: same seed, same bits, no model. A prompt starting with "slow" sleeps 0.1 s per
step (to test timeouts and cancellation). Importable by Ray workers (module-level class).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.api import GenerationRequest, GenerationResult, check_limits
from engine.config import EngineConfig
from engine.errors import GenerationCancelled, WeightsRejected
from model.config import preset


class FakeEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.dit_config = preset(config.preset)
        self.num_requests = 0
        self.num_cancelled = 0

    def validate(self, request: GenerationRequest) -> None:
        check_limits(request, self.dit_config, self.config.max_steps)

    def generate(self, request: GenerationRequest, progress=None, cancelled=None) -> GenerationResult:
        self.validate(request)
        start = time.perf_counter()
        seed = 12345 if request.seed is None else request.seed
        generator = torch.Generator().manual_seed(seed)
        cfg = self.dit_config
        video = torch.randn(cfg.video_channels, request.frames, request.height, request.width, generator=generator)
        audio = torch.randn(request.audio_len, cfg.audio_channels, generator=generator)
        for i in range(request.steps):
            if cancelled is not None and cancelled():
                self.num_cancelled += 1
                raise GenerationCancelled("cancelled")
            if request.prompt.startswith("slow"):
                time.sleep(0.1)
            if progress is not None:
                progress(i + 1, request.steps)
        self.num_requests += 1
        total = time.perf_counter() - start
        return GenerationResult(
            video=video, audio=audio, seed=seed, model=f"fake-{cfg.name}",
            timings={"encode_s": 0.0, "plan_s": 0.0, "denoise_s": total, "total_s": total},
            stats={"steps": request.steps, "tokens": request.frames * request.height * request.width // 4},
        )

    def validate_weight_update(self, path: str) -> str:
        raise WeightsRejected("this engine does not support weight updates")

    def update_weights(self, path: str) -> dict[str, Any]:
        raise WeightsRejected("this engine does not support weight updates")

    def debug_stats(self) -> dict[str, Any]:
        return {"model": f"fake-{self.dit_config.name}"}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "requests": self.num_requests, "cancelled": self.num_cancelled}

    def describe(self) -> dict[str, Any]:
        return {"id": f"fake-{self.dit_config.name}", "object": "model", "device": "cpu",
                "limits": {"max_frames": self.dit_config.max_frames}}
