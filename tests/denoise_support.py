"""Helpers shared by the offload and Cache-DiT tests (no tests here): a tiny t2va request for the tiny MiniMax-H3
transformer and a denoising loop that makes the engine's per-request and per-step calls around the transformer
(Cache-DiT refresh and skip prediction, the offloader's cache edges and step starts, AdaLN rows), recording which
blocks ran in every forward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from diffusers import MiniMaxH3Transformer3DModel
from torch import Tensor

from cache.cache_dit import CacheDit, CacheDitOverrides
from device.streams import FakeDevice
from model.geometry import GeometryLimits, VideoGeometry
from model.packing import PackedLayout
from model.schedule import H3Schedule, euler_update
from offload import LayerwiseOffloader, OffloadConfig

NUM_TEXT_TOKENS = 5
TEXT_DIM = 32  # the tiny transformer's text_dim


@dataclass(frozen=True)
class Request:
    layout: PackedLayout
    schedule: H3Schedule
    video: Tensor  # fp32 [Nv, 96] packed video rows (noise)
    audio: Tensor  # fp32 [2A, 32] channel-major audio rows (noise)
    text: Tensor  # [L, 32] text states

    def to(self, device: torch.device | str) -> Request:
        return Request(self.layout.to(device), self.schedule, self.video.to(device), self.audio.to(device),
                       self.text.to(device))


def t2va_request(num_steps: int, seed: int = 1) -> Request:
    """64x64 px, 5 frames -> 2 latent frames of 2x2 patches (8 video rows), 8 audio latents x 2 channels
    (16 rows), 5 text rows: a 29-row packed sequence, two distinct timesteps per forward after the first;
    `num_steps` grid points, so `num_steps - 1` forwards."""
    geometry = VideoGeometry.from_frames(64, 64, 5, limits=GeometryLimits(short_edge=None, min_seconds=0.0))
    g = torch.Generator().manual_seed(seed)
    return Request(
        layout=PackedLayout.build(geometry, NUM_TEXT_TOKENS),
        schedule=H3Schedule.build(num_steps),
        video=torch.randn(geometry.num_video_tokens, geometry.spec.patch_dim, generator=g),
        audio=torch.randn(geometry.num_audio_rows, geometry.spec.audio_latent_channels, generator=g),
        text=torch.randn(NUM_TEXT_TOKENS, TEXT_DIM, generator=g),
    )


@dataclass
class Run:
    """What one request did: per forward the velocities, the blocks that ran, the skip prediction."""

    video_velocity: list[Tensor] = field(default_factory=list)
    audio_velocity: list[Tensor] = field(default_factory=list)
    ran: list[list[int]] = field(default_factory=list)
    predicted: list[bool | None] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    video: Tensor | None = None  # final samples
    audio: Tensor | None = None


def record_blocks(model: MiniMaxH3Transformer3DModel, run: Run) -> list[torch.utils.hooks.RemovableHandle]:
    return [block.register_forward_pre_hook(lambda module, args, i=i: run.ran[-1].append(i))
            for i, block in enumerate(model.transformer_blocks)]


def denoise(model: MiniMaxH3Transformer3DModel, req: Request, *, cache: CacheDit | None = None,
            off: LayerwiseOffloader | None = None, overrides: CacheDitOverrides | None = None,
            before_step: Callable[[Tensor], None] | None = None) -> Run:
    """The engine's per-request and per-step calls around the transformer, Euler in fp32."""
    run = Run()
    hooks = record_blocks(model, run)
    sched, layout = req.schedule, req.layout
    if cache is not None:
        cfg = cache.refresh(sched.num_forwards, overrides)
        if off is not None:
            if cfg.enabled:
                off.set_cache_blocks(cfg.Fn_compute_blocks, cfg.Bn_compute_blocks)
            else:
                off.clear_cache_blocks()
    video, audio = req.video.clone(), req.audio.clone()
    try:
        with torch.no_grad():
            for i, step in enumerate(sched.steps):
                timesteps = step.timesteps.to(video.device)
                if before_step is not None:
                    before_step(timesteps)
                will = cache.predict_middle() if cache is not None else None
                run.predicted.append(will)
                if off is not None:
                    off.begin_step(will)
                run.ran.append([])
                v_video, v_audio = model(
                    video[None], audio[None], req.text[None], timesteps,
                    layout.timestep_indices(step.video_index, step.audio_index), layout.token_tags,
                    layout.position_ids, layout.video_indices, layout.audio_indices, layout.text_indices,
                    return_dict=False,
                )
                run.video_velocity.append(v_video[0])
                run.audio_velocity.append(v_audio[0])
                video = euler_update(video, v_video[0], sched.video_timesteps[i],
                                     sched.video_sigmas[i], sched.video_sigmas[i + 1])
                audio = euler_update(audio, v_audio[0], sched.audio_timesteps[i],
                                     sched.audio_sigmas[i], sched.audio_sigmas[i + 1])
    finally:
        for hook in hooks:
            hook.remove()
    run.video, run.audio = video, audio
    if cache is not None:
        run.cached = cache.cached_steps()
    return run


def offload(model: MiniMaxH3Transformer3DModel, config: OffloadConfig | None = None, **settings) -> LayerwiseOffloader:
    """Apply the offloader to the model's `transformer_blocks` on the deferring fake device (a block that runs
    before its copy landed computes with NaN weights)."""
    config = config if config is not None else OffloadConfig(enabled=True, **settings)
    return LayerwiseOffloader(model.transformer_blocks, config, FakeDevice(), root=model).apply()


def assert_same_velocities(run: Run, expect: Run) -> None:
    assert len(run.video_velocity) == len(expect.video_velocity)
    for step, (v, a, ev, ea) in enumerate(zip(run.video_velocity, run.audio_velocity, expect.video_velocity,
                                              expect.audio_velocity)):
        assert torch.equal(v, ev) and torch.equal(a, ea), f"step {step}"
