"""Keyframes and references -> MiniMax-H3 conditioning latents: the VAEs' encoder side.

The recipe is diffusers' `encode_vae_condition` / `MiniMaxH3Ref2VAReferenceEncoderStep`, the released model's:

    visual: x = (uint8 / 255 - ImageNet mean) / std          [1, 3, F, H, W] fp32
            z ~ AutoencoderKLMiniMaxH3.encode(x)            the posterior *sampled* under its own generator (seed 42),
                                                             so a keyframe always encodes to the same anchor;
                                                             one frame: the spatial encoder alone; 17n+5 frames:
                                                             the temporal chunking (5n+2 latent frames); tiled
                                                             inside the VAE as it needs
            latents = (fp16(z) - latents_mean) / latents_std  fp32 on the CPU
    audio:  z = AutoencoderKLMiniMaxH3Audio.encode(wave)    the two stereo channels as a batch of the mono VAE,
                                                             the posterior *mean* (a soundtrack is never sampled)
            rows = (z - latents_mean) / latents_std           channel-major [2A, Ca], as the audio rows are packed

A fused engine's encoders share the decoders' VAE modules (`model.decode.VideoDecoder.vae`, `AudioDecoder.vae`):
each VAE is loaded once per process, and the encoder half only runs for keyframe and reference requests. A process
that only encodes (a split app's prepare stage) loads the encoder halves alone (`VisualConditionEncoder.load`,
`AudioConditionEncoder.load`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from PIL import Image

from model.decode import PIXEL_MEAN, PIXEL_STD, VaeHalves, load_audio_vae, load_video_vae

#: The seed the conditioning posterior is sampled under, independent of the request (diffusers
#: `keyframe_encode_seed`).
KEYFRAME_ENCODE_SEED = 42


class VisualConditionEncoder:
    """The video VAE's encoder: keyframes, image and video references -> normalized latents [C, f, h, w]."""

    def __init__(self, vae: AutoencoderKLMiniMaxH3) -> None:
        self.vae = vae
        self.device = next(vae.encoder.parameters()).device
        self._latents_mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        self._latents_std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        self._pixel_mean = torch.tensor(PIXEL_MEAN, device=self.device).view(1, -1, 1, 1, 1)
        self._pixel_std = torch.tensor(PIXEL_STD, device=self.device).view(1, -1, 1, 1, 1)

    @classmethod
    def load(cls, vae_dir: str | Path, device: torch.device | str) -> VisualConditionEncoder:
        """The video VAE's encoder half alone, on `device` (fp32, as a whole VAE's encoder is)."""
        return cls(load_video_vae(vae_dir, device, VaeHalves.ENCODER))

    def encode_image(self, image: Image.Image) -> torch.Tensor:
        """fp32 [C, 1, H/16, W/16] on the CPU from one RGB image (a keyframe or an image reference)."""
        pixels = torch.from_numpy(np.array(image)).to(self.device).permute(2, 0, 1)[None, :, None]
        return self._encode(pixels)

    def encode_frames(self, frames: np.ndarray) -> torch.Tensor:
        """fp32 [C, 5n+2, H/16, W/16] from uint8 frames [F, H, W, 3], F snapped *down* to 17n+5 (no padding)."""
        chunk, kept = self.vae.config.clip_length, self.vae.tokens_chunk_size
        count = max(1, (frames.shape[0] - kept) // chunk) * chunk + kept
        pixels = torch.from_numpy(frames[:count].copy()).to(self.device).permute(3, 0, 1, 2)[None]
        return self._encode(pixels)

    @torch.no_grad()
    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = (pixels.to(torch.float32).div(255.0) - self._pixel_mean) / self._pixel_std
        posterior = self.vae.encode(pixels, return_dict=False)[0]
        latents = posterior.sample(generator=torch.Generator().manual_seed(KEYFRAME_ENCODE_SEED))
        latents = latents.to(torch.float16).float().cpu()  # the release keeps ~11 bits of every anchor latent
        return ((latents - self._latents_mean) / self._latents_std)[0]


class AudioConditionEncoder:
    """The audio VAE's encoder: a stereo soundtrack -> normalized channel-major rows [2A, Ca]."""

    def __init__(self, vae: AutoencoderKLMiniMaxH3Audio) -> None:
        self.vae = vae
        self.device = next(vae.parameters()).device
        self.sample_rate: int = vae.config.sampling_rate
        self.latent_channels: int = vae.config.latent_channels
        self._latents_mean = torch.tensor(vae.config.latents_mean).view(1, 1, -1)
        self._latents_std = torch.tensor(vae.config.latents_std).view(1, 1, -1)

    @classmethod
    def load(cls, audio_vae_dir: str | Path, device: torch.device | str) -> AudioConditionEncoder:
        """The audio VAE's encoder half alone, on `device`."""
        return cls(load_audio_vae(audio_vae_dir, device, VaeHalves.ENCODER))

    @torch.no_grad()
    def encode(self, waveform: np.ndarray) -> torch.Tensor:
        """fp32 [2A, Ca] on the CPU from float32 [2, samples] at `sample_rate`."""
        audio = torch.as_tensor(waveform, dtype=torch.float32)
        posterior = self.vae.encode(audio.to(self.device)[:, None], return_dict=False)[0]
        latents = posterior.mode().float().cpu().transpose(1, 2)  # [2, A, Ca]
        return ((latents - self._latents_mean) / self._latents_std).reshape(-1, self.latent_channels)
