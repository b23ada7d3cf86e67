"""The engine's outer stages as objects usable on their own (plain torch, no Ray).

A generation is `PromptStage` (prompt -> embeddings) -> the denoiser (`engine.engine.Engine.denoise`: AdaLN
plans, the denoising loop) -> `DecodeStage` (video + audio VAE decode, MP4 mux), composed once by
`engine.pipeline.Pipeline`: in one process (`Engine.generate`: tests, a fused replica, every rank of a
sequence-parallel replica, where only rank 0 decodes), or with each stage in its own deployment
(`deployments/stages.py`), so the denoiser never waits for a prompt encode or a VAE decode. What crosses
between the stages is small and typed (`engine.stage_data`): `PromptEmbedding` (on the CPU; for fl2va / ref2va
with the request's `Conditions`: the canvas and the VAE condition latents, made beside the prompt encoder) and
the latents.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.api import ClipFacts
from engine.config import TextEncoderConfig, TextEncoderQuantization
from engine.errors import ClientError
from engine.fp8 import stored_bytes
from engine.stage_data import DecodedVideo, PromptEmbedding
from engine.text_fp8 import TextEncoderFp8
from model.decode import AudioDecoder, DecoderLoadError, VaeHalves, VideoDecoder
from model.encode import AudioConditionEncoder, VisualConditionEncoder
from model.geometry import H3_LATENTS, LatentSpec
from model.layout import H3Checkpoint
from model.mp4 import thumbnail_png, write_mp4_clips
from model.prompts import PromptEmbeddingCache
from model.text_encoder import LanguageModelSplit, PromptEncoder, TextEncoderLoadError
from model.weights import CONFIG_FILE, H3TransformerConfig

if TYPE_CHECKING:
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

__all__ = ["DecodeStage", "PromptStage", "TextEncoderWeights", "VaeEncoders"]


@dataclass(frozen=True)
class TextEncoderWeights:
    """What the prompt stage holds (`describe()["text_encoder"]`, GET /v1/models)."""

    device: str
    quantization: TextEncoderQuantization  # text_encoder.quantization
    quantized_linears: int  # decoder-layer linears in float8 (0: none)
    decoder_layers: int  # layers loaded (those feeding hidden_states[index])
    vision: bool  # the vision tower is held
    bytes: int  # parameters and buffers as stored (float8 weights: their fp8 data and scales)

    def summary(self) -> str:
        return (f"{self.decoder_layers} layers on {self.device}, quantization {self.quantization} "
                f"({self.quantized_linears} linears), {self.bytes / 2**30:.2f} GiB"
                f"{', vision tower' if self.vision else ''}")


class PromptStage:
    """Qwen3-VL prompt encoder and its LRU prompt-embedding cache. Thread-safe for `check` and `encode` from
    one caller thread at a time per encode (the cache is locked; the encoder runs one prompt at a time)."""

    def __init__(self, config: TextEncoderConfig, checkpoint: H3Checkpoint, device: torch.device, *,
                 split: LanguageModelSplit | None = None, vision: bool = False) -> None:
        """`split`: the encoder's share of a tensor-parallel group (`parallel.text_encoder`); None: whole.
        `vision`: also hold Qwen3-VL's vision tower (keyframe and reference prompts, `engine.conditioning`)."""
        self.config = config
        # fp8: each decoder layer quantized as it is loaded (QuantizationError here on a device without float8).
        fp8 = TextEncoderFp8(torch.device(device)) if config.quantization == "fp8" else None
        self.encoder = PromptEncoder(checkpoint.text_encoder_dir, checkpoint.tokenizer_dir, device,
                                     hidden_state_index=config.hidden_state_index, split=split, vision=vision,
                                     processor_dir=checkpoint.processor_dir, layer_transform=fp8)
        self.weights = TextEncoderWeights(
            device=str(self.encoder.device), quantization=config.quantization,
            quantized_linears=len(fp8.quantized) if fp8 is not None else 0,
            decoder_layers=self.encoder.num_loaded_layers, vision=self.encoder.has_vision,
            bytes=stored_bytes(self.encoder.module))
        # Another model's encoder (e.g. a smaller Qwen3-VL) loads fine and fails every request in the transformer.
        config_path = checkpoint.transformer_dir / CONFIG_FILE
        text_dim = H3TransformerConfig.from_json(config_path.read_bytes(), checkpoint.layout, config_path).text_dim
        if self.encoder.text_dim != text_dim:
            raise TextEncoderLoadError(f"{checkpoint.text_encoder_dir} encodes prompts {self.encoder.text_dim} wide, "
                                       f"but the transformer ({config_path}) takes text_dim={text_dim}")
        self.cache = PromptEmbeddingCache(int(config.prompt_cache_mb * 2**20))

    @property
    def device(self) -> torch.device:
        return self.encoder.device

    def check(self, prompt: str) -> int:
        """The prompt's token count; ClientError on field `prompt` when it has none or more than
        `max_prompt_tokens`."""
        try:
            tokens = self.encoder.count_tokens(prompt)
        except ValueError as exc:
            raise ClientError("prompt", str(exc)) from None
        limit = self.config.max_prompt_tokens
        if tokens > limit:
            raise ClientError("prompt", f"{tokens} tokens exceeds this server's max_prompt_tokens={limit}; shorten "
                              "the prompt", f"max_prompt_tokens={limit}")
        return tokens

    @torch.no_grad()
    def encode(self, prompt: str) -> PromptEmbedding:
        """The prompt's embedding (from the cache when seen before), on the encoder's device."""
        self.check(prompt)
        start = time.perf_counter()
        embeds = self.cache.get_or_encode(self.encoder, prompt)
        if embeds.device.type == "cuda":
            torch.cuda.synchronize(embeds.device)
        return PromptEmbedding(embeds=embeds, encode_s=time.perf_counter() - start, cache=self.cache.stats())


@dataclass(frozen=True)
class VaeEncoders:
    """The VAEs' encoder halves: the keyframes' and references' condition latents (`engine.conditioning`)."""

    visual: VisualConditionEncoder
    audio: AudioConditionEncoder

    @classmethod
    def load(cls, checkpoint: H3Checkpoint, device: torch.device) -> VaeEncoders:
        """The encoder halves alone (a split app's prepare stage: its Decoder holds the decoder halves)."""
        encoders = cls(VisualConditionEncoder.load(checkpoint.video_vae_dir, device),
                       AudioConditionEncoder.load(checkpoint.audio_vae_dir, device))
        _check_latent_spec(encoders.visual.vae, checkpoint.video_vae_dir, encoders.audio.vae,
                           checkpoint.audio_vae_dir, H3_LATENTS)
        return encoders


class DecodeStage:
    """The video and audio VAEs on one device, and the MP4 mux."""

    def __init__(self, checkpoint: H3Checkpoint, device: torch.device, halves: VaeHalves = VaeHalves.BOTH) -> None:
        """`halves`: BOTH (a fused engine that also encodes keyframes and references: `encoders()`) or DECODER."""
        self.halves = halves
        self.video_decoder = VideoDecoder(checkpoint.video_vae_dir, device, halves=halves)
        self.audio_decoder = AudioDecoder(checkpoint.audio_vae_dir, device, halves=halves)
        _check_latent_spec(self.video_decoder.vae, checkpoint.video_vae_dir, self.audio_decoder.vae,
                           checkpoint.audio_vae_dir, H3_LATENTS)

    def encoders(self) -> VaeEncoders:
        """The encoder halves of this stage's VAEs, the same modules (loaded with halves BOTH)."""
        if self.halves is not VaeHalves.BOTH:
            raise ValueError(f"this decode stage holds the VAEs' {self.halves.value} halves only: no encoders")
        return VaeEncoders(VisualConditionEncoder(self.video_decoder.vae),
                           AudioConditionEncoder(self.audio_decoder.vae))

    @torch.no_grad()
    def decode(self, video: torch.Tensor, audio: torch.Tensor) -> DecodedVideo:
        """`video` [C, F, H, W] and `audio` [2A, Ca] latents (any device) -> the MP4 and its thumbnail. The
        soundtrack decodes first (its stream opens the file); then each clip of frames is H.264-encoded on a
        thread while the VAE decodes the next (`model.mp4.write_mp4_clips`), so `decode_s` is the VAEs' time with
        the mux of the earlier clips under it and `mux_s` only the encode it did not hide: the waits for a slower
        encoder, the encode of the clips still with it, the flush, the audio's and the thumbnail. The bytes are
        those of decoding everything, then muxing."""
        start = time.perf_counter()
        waveform = self.audio_decoder.decode(audio)  # float32 [2, samples]
        audio_s = time.perf_counter() - start
        buffer = io.BytesIO()
        sample_rate = self.audio_decoder.sample_rate
        written = write_mp4_clips(buffer, self.video_decoder.iter_clips(video), H3_LATENTS.fps, waveform,
                                  sample_rate)
        thumbnail_start = time.perf_counter()
        thumbnail = thumbnail_png(written.first_frame)
        thumbnail_s = time.perf_counter() - thumbnail_start
        clip = ClipFacts(num_frames=written.num_frames, fps=float(H3_LATENTS.fps), sample_rate=sample_rate)
        return DecodedVideo(mp4=buffer.getvalue(), thumbnail_png=thumbnail, clip=clip,
                            decode_s=audio_s + written.source_s,
                            mux_s=written.encode_wait_s + written.finish_s + thumbnail_s)


def _check_latent_spec(video: AutoencoderKLMiniMaxH3, video_dir: Path, audio: AutoencoderKLMiniMaxH3Audio,
                       audio_dir: Path, spec: LatentSpec) -> None:
    """The VAEs must encode and decode the latents the denoiser makes (`spec`, what the request geometry is derived
    from): a VAE config that differs (another sample rate, clip length) still loads, then gives a video whose
    frames or soundtrack do not last the requested time. DecoderLoadError naming the directory and the value.
    Config values only: either half holds them."""
    video_found = {"latent_channels": video.config.latent_channels,
                   "spatial compression": video.spatial_compression_ratio,
                   "clip_length": video.config.clip_length, "latent frames per clip": video.tokens_chunk_size}
    video_wanted = {"latent_channels": spec.latent_channels, "spatial compression": spec.spatial_ratio,
                    "clip_length": spec.frames_per_chunk, "latent frames per clip": spec.latents_per_chunk}
    audio_found = {"latent_channels": audio.config.latent_channels,
                   "latents per second": audio.config.sampling_rate / audio.hop_length}
    audio_wanted = {"latent_channels": spec.audio_latent_channels,
                    "latents per second": spec.audio_latents_per_second}
    for directory, found, wanted in ((video_dir, video_found, video_wanted), (audio_dir, audio_found, audio_wanted)):
        wrong = [f"{name} {found[name]:g} (expected {wanted[name]:g})"
                 for name in wanted if found[name] != wanted[name]]
        if wrong:
            raise DecoderLoadError(f"{directory} does not decode MiniMax-H3 latents: {', '.join(wrong)}")
