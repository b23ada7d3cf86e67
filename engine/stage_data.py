"""What crosses between a generation's stages (`engine.stages`, `engine.pipeline`): small, typed, picklable. Apart
from the stages themselves so that a process which only routes them (the ingress, a split pipeline's caller)
imports no model code: no diffusers, no transformers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.api import ClipFacts
from engine.wire import TensorsAsArrays, WireTensor
from model.denoise import ConditionLatents
from model.packing import ConditionBlock
from model.prompts import PromptCacheStats


@dataclass(frozen=True, eq=False)
class Conditions(TensorsAsArrays):
    """A fl2va / ref2va request as the prepare side made it for the denoiser: the canvas it resolved (the first
    keyframe's aspect ratio on the model's canvas rule when the request names no size), whether a reference
    soundtrack adds the t = 1 rows to every AdaLN plan, and the VAE condition latents. With them a denoiser that
    holds neither the VAEs nor the vision tower (`stages: split`) runs the request as a fused engine does."""

    width: int
    height: int
    reference_audio: bool
    text_token_tags: torch.Tensor  # ConditionLatents' fields, flat: each tensor crosses as an array
    blocks: tuple[ConditionBlock, ...]  # the packed layout's condition blocks (no tensors)
    visual: tuple[torch.Tensor, ...]
    audio: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, width: int, height: int, reference_audio: bool, latents: ConditionLatents) -> Conditions:
        return cls(width, height, reference_audio, latents.text_token_tags, latents.blocks, latents.visual,
                   latents.audio)

    @property
    def latents(self) -> ConditionLatents:
        return ConditionLatents(self.text_token_tags, self.blocks, self.visual, self.audio)

    def cpu(self) -> Conditions:
        return dataclasses.replace(self, text_token_tags=self.text_token_tags.cpu(),
                                   visual=tuple(t.cpu() for t in self.visual), audio=tuple(t.cpu() for t in self.audio))

    def __getstate__(self) -> dict:
        state = super().__getstate__()  # the top-level tensor; the tuples' tensors below
        for name in ("visual", "audio"):
            state[name] = tuple(WireTensor.of(t) for t in state[name])
        return state

    def __setstate__(self, state: dict) -> None:
        state = {**state, **{name: tuple(t.tensor() for t in state[name]) for name in ("visual", "audio")}}
        super().__setstate__(state)


@dataclass(frozen=True)
class PromptEmbedding(TensorsAsArrays):
    """One prompt's conditioning, as the denoiser takes it. `embeds` crosses processes as an array
    (`engine.wire`)."""

    embeds: torch.Tensor  # [num_tokens, text_dim] in the text encoder's dtype
    encode_s: float  # seconds the stage spent (a cache hit: ~0)
    cache: PromptCacheStats  # the prompt-embedding cache's counters after this call
    conditions: Conditions | None = None  # fl2va / ref2va: what the prepare side made of the keyframes / references

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    def cpu(self) -> PromptEmbedding:
        """The same embedding on the CPU (what travels between processes)."""
        return dataclasses.replace(self, embeds=self.embeds.cpu(),
                                   conditions=self.conditions.cpu() if self.conditions is not None else None)


@dataclass(frozen=True)
class DecodedVideo:
    """A decoded, muxed clip."""

    mp4: bytes  # H.264 + AAC stereo
    thumbnail_png: bytes  # the first frame
    clip: ClipFacts  # frames, fps, sample rate
    decode_s: float  # video + audio VAE (the earlier clips' H.264 encode runs under it)
    mux_s: float  # the H.264 + AAC encode and mux the decode did not hide (waits, the last clips, the flush)
