"""The denoising loop of MiniMax-H3 (t2va, fl2va, ref2va), in pieces an engine can drive one forward at a time.

    denoiser = Denoiser(geometry, schedule, num_text_tokens=L, device=device, conditions=None)
    latents = denoiser.initial_latents(seed)
    for i in range(schedule.num_forwards):
        inputs = denoiser.transformer_inputs(i, latents, text_embeds)   # engine hooks: AdaLN plan i, cache, ...
        velocity_video, velocity_audio = inputs.run(transformer)
        latents = denoiser.step(i, latents, velocity_video, velocity_audio)
    video, audio = denoiser.finish(latents)

This reproduces diffusers' `MiniMaxH3CoreDenoiseStep` (layout, noise, timesteps, loop, unpack) bit for bit for the
same prompt embedding and seed: the noise is drawn from a CPU `torch.Generator` seeded with `seed` (video latents
first, then the audio rows), the transformer gets the same tensors, and the update is the scheduler's fp32 Euler step.

With `conditions` (fl2va keyframes, ref2va references: `ConditionLatents`, encoded by `model.encode`) it reproduces
diffusers' `MiniMaxH3FL2VACoreDenoiseStep` / `MiniMaxH3Ref2VACoreDenoiseStep`: one noise draw per visual condition
comes first from the same generator (each noised to t = 0.999: `0.999 * z + 0.001 * noise`), then the generated
rows' noise as for t2va; the condition rows lead the video (and audio) rows of every forward and are never written,
so only the generated rows step and leave the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.geometry import VideoGeometry
from model.packing import ConditionBlock, PackedLayout, PackingError, patchify_video, unpatchify_video
from model.schedule import KEYFRAME_NOISE_AUG, H3Schedule, Task, euler_update

if TYPE_CHECKING:
    from diffusers import MiniMaxH3Transformer3DModel

MAX_SEED = 2**63 - 1


@dataclass(frozen=True, eq=False)
class PackedLatents:
    """The generated rows of the packed sequence, as the transformer reads and the scheduler writes them (fp32)."""

    video: Tensor  # [num_video_tokens, patch_dim]
    audio: Tensor  # [2 * num_audio_latents, audio_latent_channels], channel-major
    #: The request's condition rows (fixed for the whole loop; None without): noised keyframes / visual references
    #: [Ncv, patch_dim], clean reference soundtracks [Nca, Ca]. They lead the transformer's video / audio rows.
    condition_video: Tensor | None = None
    condition_audio: Tensor | None = None


@dataclass(frozen=True, eq=False)
class ConditionLatents:
    """A fl2va / ref2va request's conditioning as the loop takes it, packed order."""

    text_token_tags: Tensor  # int64 [L]: TEXT_TAG, VIDEO_TAG on a vision block's rows (the prompt encoder's)
    blocks: tuple[ConditionBlock, ...]  # the layout's condition blocks
    visual: tuple[Tensor, ...]  # clean normalized latents [C, f, h, w], one per keyframe / image / video reference
    audio: tuple[Tensor, ...] = ()  # clean normalized channel-major rows [2A', Ca], one per reference soundtrack


@dataclass(frozen=True, eq=False)
class TransformerInputs:
    """Exactly the tensors one forward of `MiniMaxH3Transformer3DModel` takes, by its parameter names."""

    hidden_states: Tensor  # fp32 [1, Nv, patch_dim]
    audio_hidden_states: Tensor  # fp32 [1, 2A, Ca]
    encoder_hidden_states: Tensor  # [1, L, text_dim], the text encoder's dtype
    timestep: Tensor  # fp32 [M]: distinct, ascending; the AdaLN plan
    timestep_indices: Tensor  # int64 [S]
    token_tags: Tensor  # int64 [S]
    position_ids: Tensor  # fp64 [S, 3]
    video_indices: Tensor  # int64 [Nv]
    audio_indices: Tensor  # int64 [2A]
    text_indices: Tensor  # int64 [L]
    num_condition_video_rows: int = 0  # leading rows of `hidden_states` that are conditions, not generated
    num_condition_audio_rows: int = 0

    def run(self, transformer: MiniMaxH3Transformer3DModel) -> tuple[Tensor, Tensor]:
        """Call the module (so its hooks fire); returns the generated rows' velocities ([Nv, patch_dim],
        [2A, Ca]), batch and condition rows dropped."""
        video, audio = transformer(
            hidden_states=self.hidden_states,
            audio_hidden_states=self.audio_hidden_states,
            encoder_hidden_states=self.encoder_hidden_states,
            timestep=self.timestep,
            timestep_indices=self.timestep_indices,
            token_tags=self.token_tags,
            position_ids=self.position_ids,
            video_indices=self.video_indices,
            audio_indices=self.audio_indices,
            text_indices=self.text_indices,
            return_dict=False,
        )
        return video[0, self.num_condition_video_rows:], audio[0, self.num_condition_audio_rows:]


class Denoiser:
    """One request's layout and schedule tensors on `device`; it holds no latents (they pass through its methods)."""

    def __init__(
        self,
        geometry: VideoGeometry,
        schedule: H3Schedule,
        num_text_tokens: int,
        device: torch.device | str = "cpu",
        conditions: ConditionLatents | None = None,
    ):
        self.geometry = geometry
        self.schedule = schedule
        self.device = torch.device(device)
        self.conditions = conditions
        if (conditions is not None) != (schedule.task is not Task.T2VA):
            raise PackingError(f"a {schedule.task.value} schedule with conditions={conditions is not None}: fl2va and "
                               f"ref2va requests need their condition latents, t2va has none")
        if conditions is None:
            self.layout = PackedLayout.build(geometry, num_text_tokens, self.device)
        else:
            self.layout = PackedLayout.build(geometry, num_text_tokens, self.device,
                                             text_token_tags=conditions.text_token_tags, blocks=conditions.blocks)
            if (self.layout.num_condition_audio_rows > 0) != schedule.reference_audio:
                raise PackingError(f"schedule {schedule.key} for a request with "
                                   f"{self.layout.num_condition_audio_rows} reference audio rows")
        self._plans = [step.timesteps.to(self.device) for step in schedule.steps]
        self._video_sigmas = schedule.video_sigmas.to(self.device)
        self._audio_sigmas = schedule.audio_sigmas.to(self.device)
        self._video_timesteps = schedule.video_timesteps.to(self.device)
        self._audio_timesteps = schedule.audio_timesteps.to(self.device)
        # Only a few index tuples occur (forward 0 has one plan row, the rest two, plus the condition rows').
        self._timestep_indices: dict[tuple[int, int, int | None, int | None], Tensor] = {}
        #: (text_embeds, its [1, L, text_dim] view): every forward of this request gets the same view object,
        #: so `model.text_memo.RefinedTextMemo` refines the text once per request.
        self._text: tuple[Tensor, Tensor] | None = None

    def initial_latents(self, seed: int) -> PackedLatents:
        """Pure noise, drawn as the pipeline draws it: a CPU generator, one draw per visual condition first (which
        noises it), then video [C, F, H, W], then audio rows."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed={seed!r} must be an integer in [0, {MAX_SEED}]")
        generator = torch.Generator("cpu").manual_seed(seed)
        condition_video = condition_audio = None
        if self.conditions is not None:
            condition_video = self._noised_condition_rows(generator).to(self.device)
            if self.conditions.audio:
                condition_audio = torch.cat([rows.to(torch.float32) for rows in self.conditions.audio]).to(self.device)
        spec = self.geometry.spec
        video = torch.randn(self.geometry.video_latent_shape, generator=generator, dtype=torch.float32)
        audio = torch.randn(
            (self.geometry.num_audio_rows, spec.audio_latent_channels), generator=generator, dtype=torch.float32
        )
        return PackedLatents(patchify_video(video, self.geometry).to(self.device), audio.to(self.device),
                             condition_video, condition_audio)

    def _noised_condition_rows(self, generator: torch.Generator) -> Tensor:
        """[Ncv, patch_dim]: every visual condition noised to t = 0.999 with its own draw, patchified, packed order
        (`MiniMaxH3Scheduler.scale_noise` arithmetic: t * z + (1 - t) * noise in fp32)."""
        t = torch.tensor(KEYFRAME_NOISE_AUG, dtype=torch.float32)
        rows = []
        for latents in self.conditions.visual:
            latents = latents.to(torch.float32)
            noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
            rows.append(_patchify(t * latents + (1.0 - t) * noise, self.geometry.spec.patch_size))
        packed = torch.cat(rows)
        if packed.shape[0] != self.layout.num_condition_video_rows:
            raise PackingError(f"the condition latents pack into {packed.shape[0]} rows; the layout's blocks reserve "
                               f"{self.layout.num_condition_video_rows}")
        return packed

    def transformer_inputs(self, i: int, latents: PackedLatents, text_embeds: Tensor) -> TransformerInputs:
        """Forward i's inputs. `text_embeds` is [L, text_dim] on this device, as the prompt encoder returns it."""
        plan = self.schedule.steps[self._check_step(i)]
        if text_embeds.ndim != 2 or text_embeds.shape[0] != self.layout.num_text_tokens:
            raise PackingError(
                f"text_embeds of shape {tuple(text_embeds.shape)}; this request's layout has "
                f"{self.layout.num_text_tokens} text rows ([L, text_dim])"
            )
        pair = (plan.video_index, plan.audio_index, plan.condition_video_index, plan.condition_audio_index)
        if pair not in self._timestep_indices:
            self._timestep_indices[pair] = self.layout.timestep_indices(*pair)
        video, audio = latents.video, latents.audio
        if latents.condition_video is not None:
            video = torch.cat([latents.condition_video, video])
        if latents.condition_audio is not None:
            audio = torch.cat([latents.condition_audio, audio])
        return TransformerInputs(
            hidden_states=video[None],
            audio_hidden_states=audio[None],
            encoder_hidden_states=self._text_view(text_embeds),
            timestep=self._plans[i],
            timestep_indices=self._timestep_indices[pair],
            token_tags=self.layout.token_tags,
            position_ids=self.layout.position_ids,
            video_indices=self.layout.video_indices,
            audio_indices=self.layout.audio_indices,
            text_indices=self.layout.text_indices,
            num_condition_video_rows=self.layout.num_condition_video_rows,
            num_condition_audio_rows=self.layout.num_condition_audio_rows,
        )

    def _text_view(self, text_embeds: Tensor) -> Tensor:
        if self._text is None or self._text[0] is not text_embeds:
            self._text = (text_embeds, text_embeds[None])
        return self._text[1]

    def step(self, i: int, latents: PackedLatents, velocity_video: Tensor, velocity_audio: Tensor) -> PackedLatents:
        """Move both modalities from grid point i to i + 1 on their own sigma grids (fp32)."""
        i = self._check_step(i)
        pairs = (("velocity_video", velocity_video, latents.video), ("velocity_audio", velocity_audio, latents.audio))
        for name, velocity, rows in pairs:
            if velocity.shape != rows.shape:
                raise PackingError(f"{name} of shape {tuple(velocity.shape)}; expected {tuple(rows.shape)}")
        video = euler_update(
            latents.video, velocity_video, self._video_timesteps[i], self._video_sigmas[i], self._video_sigmas[i + 1]
        )
        audio = euler_update(
            latents.audio, velocity_audio, self._audio_timesteps[i], self._audio_sigmas[i], self._audio_sigmas[i + 1]
        )
        return PackedLatents(video, audio, latents.condition_video, latents.condition_audio)

    def finish(self, latents: PackedLatents) -> tuple[Tensor, Tensor]:
        """(video latents [C, F, H, W] fp32, audio rows [2A, Ca] fp32 channel-major) for the decoders."""
        return unpatchify_video(latents.video, self.geometry), latents.audio

    def _check_step(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.schedule.num_forwards:
            raise ValueError(f"step i={i!r} must be an integer in [0, {self.schedule.num_forwards})")
        return i


def _patchify(latents: Tensor, patch_size: tuple[int, int, int]) -> Tensor:
    """[C, F, H, W] of any size -> [patches, C*pt*ph*pw], frame-major then row-major (as `patchify_video`)."""
    channels, frames, height, width = latents.shape
    patch_t, patch_h, patch_w = patch_size
    patches = latents.reshape(channels, frames // patch_t, patch_t, height // patch_h, patch_h, width // patch_w,
                              patch_w)
    patches = patches.permute(1, 3, 5, 0, 2, 4, 6)
    return patches.reshape(-1, channels * patch_t * patch_h * patch_w).contiguous()


@torch.no_grad()
def denoise(
    transformer: MiniMaxH3Transformer3DModel,
    text_embeds: Tensor,
    geometry: VideoGeometry,
    schedule: H3Schedule,
    seed: int,
    conditions: ConditionLatents | None = None,
) -> tuple[Tensor, Tensor]:
    """The whole loop on `text_embeds.device`: (video latents [C, F, H, W], audio rows [2A, Ca]), both fp32."""
    denoiser = Denoiser(geometry, schedule, text_embeds.shape[0], text_embeds.device, conditions)
    latents = denoiser.initial_latents(seed)
    for i in range(schedule.num_forwards):
        velocity_video, velocity_audio = denoiser.transformer_inputs(i, latents, text_embeds).run(transformer)
        latents = denoiser.step(i, latents, velocity_video, velocity_audio)
    return denoiser.finish(latents)
