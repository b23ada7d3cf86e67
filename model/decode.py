"""Denoised MiniMax-H3 latents -> uint8 video frames and a float32 stereo waveform.

The arithmetic is the reference pipeline's (diffusers `MiniMaxH3VideoDecodeStep` / `MiniMaxH3AudioDecodeStep`):

    video: z = latents * latents_std + latents_mean            (per channel, fp32)
           x = AutoencoderKLMiniMaxH3.decode(z)                 (ImageNet-normalised RGB, spatially tiled)
           frames = round(255 * clamp(x * pixel_std + pixel_mean, 0, 1))   as uint8 [F, H, W, 3]
    audio: z = rows * latents_std + latents_mean               (rows channel-major: [left; right])
           waveform = AutoencoderKLMiniMaxH3Audio.decode(z)     (the mono VAE, the two channels as a batch of 2)

The video VAE decodes in temporal clips: latent frames 5i..5i+6 give 17 new pixel frames plus a 5-frame tail
that the next clip's first 5 frames are cross-faded with (17n + 5 frames from 5n + 2 latent frames). The VAE does
that loop itself but keeps every decoded clip until the end; `VideoDecoder.iter_clips` runs the same clips one at
a time through the public `decode`, cross-fades them with the same weights in the same dtype, and converts each
finished stretch to uint8 at once, so only one clip of float pixels is ever alive. The result is
bit-identical to decoding the whole video in one call. Measured on one H200 with the released VAE geometry
(random weights, bf16 blocks): 15 s at 1344x768 (107 latent -> 362 pixel frames) decodes in 23 s using 1.05 GiB
of GPU memory beyond the 5.2 GiB of weights.

A process holds only the halves of the VAEs it runs (`VaeHalves`): a split app's prepare stage the encoders (the
keyframes' and references' latents, `model.encode`), its Decoder the decoders, a fused engine both. The other half's
submodules are dropped on the host right after the load, before the move to the device, which so never holds them.

Both published layouts load: diffusers (`vae/`, `audio_vae/` with `_class_name` configs) through
`from_pretrained`; native (`video_vae/` wrapper config + `source/` weights under the original `AutoencoderKLLegacy`
names; `audio_vae/` with `metadata.json`) by building the same diffusers classes from the native configs and
renaming the tensors (the facts are those of diffusers' `scripts/convert_minimax_h3_to_diffusers.py`).
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from safetensors import SafetensorError
from safetensors.torch import load_file

#: The video VAE's pixel convention: ImageNet-normalised RGB over [0, 1] (diffusers `pixel_mean` / `pixel_std`).
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
AUDIO_CHANNELS = 2
#: `AutoencoderKLLegacy` features the diffusers port bakes in; a native config asking for others is refused.
NATIVE_VIDEO_FIXED_FEATURES = {"use_3d_conv": True, "use_vit_decoder": True, "use_t_isolated_gn": True,
                               "causal_encoder": True, "causal_decoder": False}
#: Audio VAE settings the release hard-codes rather than stating in metadata.json.
NATIVE_AUDIO_FIXED_CONFIG = {"num_attention_heads": 8, "resblock_kernel_sizes": [3, 7, 11],
                             "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]]}


class VaeHalves(enum.Enum):
    """Which halves of the two VAEs a process holds."""

    BOTH = "both"  # a fused engine: keyframe / reference encodes and the decode
    ENCODER = "encoder"  # a split app's prepare stage (the TextEncoder deployment)
    DECODER = "decoder"  # a split app's Decoder deployment, or an engine that prepares no keyframes


#: The submodules each half's `encode` / `decode` runs (diffusers 0.42.1 `AutoencoderKLMiniMaxH3`): `encode` is
#: `quant_conv(encoder(x))` per clip and tile, `decode` `decoder(post_quant_conv(z))`.
VIDEO_VAE_HALVES = {VaeHalves.ENCODER: ("encoder", "quant_conv"), VaeHalves.DECODER: ("post_quant_conv", "decoder")}
#: `AutoencoderKLMiniMaxH3Audio.encode` runs `encoder`, `pre_block`, `mean_proj` and `logs_proj` (the posterior's
#: log-scale is computed though MiniMax-H3 reads only the mean); `decode` is `decoder(dec_in_proj(z))`.
AUDIO_VAE_HALVES = {VaeHalves.ENCODER: ("encoder", "pre_block", "mean_proj", "logs_proj"),
                    VaeHalves.DECODER: ("dec_in_proj", "decoder")}


class DecoderLoadError(ValueError):
    """A VAE directory that cannot be loaded; the message names the path and what is wrong."""


class LatentShapeError(ValueError):
    """Latents whose shape the decoder cannot take; the message names the shape and the expectation."""


class VideoDecoder:
    """AutoencoderKLMiniMaxH3 on one device, decoding normalised latents [C, F, H, W] into uint8 frames.

    `dtype` is the compute dtype of the decoder's transformer blocks; the modules diffusers pins to fp32
    (norms, residual scales, the encoder) stay fp32 as `from_pretrained(torch_dtype=...)` keeps them.
    """

    def __init__(self, vae_dir: str | Path, device: torch.device | str, *,
                 dtype: torch.dtype = torch.bfloat16, halves: VaeHalves = VaeHalves.BOTH) -> None:
        """`halves`: BOTH keeps the encoder for `model.encode` on the same modules (a fused engine); DECODER
        drops it."""
        if halves is VaeHalves.ENCODER:
            raise ValueError("a VideoDecoder runs the decoder half: halves BOTH or DECODER")
        self.vae_dir, self.device = Path(vae_dir), torch.device(device)
        self.vae = load_video_vae(self.vae_dir, self.device, halves, dtype=dtype)
        if self.vae.config.token_drop <= 0:
            raise DecoderLoadError(f"{self.vae_dir}: token_drop {self.vae.config.token_drop}; the clip streaming "
                                   f"here needs the released overlapping clips (token_drop > 0)")
        config = self.vae.config
        self.latent_channels: int = config.latent_channels
        self.spatial_ratio: int = self.vae.spatial_compression_ratio
        self._latents_mean = torch.tensor(config.latents_mean, device=self.device).view(-1, 1, 1, 1)
        self._latents_std = torch.tensor(config.latents_std, device=self.device).view(-1, 1, 1, 1)
        self._pixel_mean = torch.tensor(PIXEL_MEAN, device=self.device).view(1, -1, 1, 1, 1)
        self._pixel_std = torch.tensor(PIXEL_STD, device=self.device).view(1, -1, 1, 1, 1)

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """uint8 [frames, height * 16, width * 16, 3] from normalised latents [C, F, H, W] (F >= 3)."""
        return np.concatenate(list(self.iter_clips(latents)))

    def iter_clips(self, latents: torch.Tensor) -> Iterator[np.ndarray]:
        """The frames of `decode(latents)` in order, one finished clip (17 frames, the last one more) at a time."""
        self._check(latents)  # here rather than in the generator, so bad latents fail at the call
        return self._clips(latents)

    @torch.inference_mode()
    def _clips(self, latents: torch.Tensor) -> Iterator[np.ndarray]:
        vae = self.vae
        stride = vae.tokens_chunk_size                  # latent frames per clip (5)
        window = stride + vae.token_overlap             # latent frames a clip decodes (7)
        num_latent_frames = latents.shape[1]
        num_clips = -(-(num_latent_frames + vae.config.token_drop) // stride) - 1
        # De-normalise the whole video first, exactly as the reference does, then decode clip windows of it.
        z = (latents.to(self.device, torch.float32).contiguous() * self._latents_std + self._latents_mean)[None]
        tail = None  # the previous clip's last frame_overlap frames, raw decoder output
        for clip in range(num_clips):
            last = clip == num_clips - 1
            # The last window may be short; `decode` pads it and trims the extra frames like the whole-video call.
            decoded = vae.decode(z[:, :, clip * stride: clip * stride + window], return_dict=False)[0]
            if tail is not None:
                decoded = torch.cat([_cross_fade(tail, decoded[:, :, :vae.frame_overlap]),
                                     decoded[:, :, vae.frame_overlap:]], dim=2)
            if last:
                yield self._to_uint8(decoded)
            else:
                yield self._to_uint8(decoded[:, :, :-vae.frame_overlap])
                tail = decoded[:, :, -vae.frame_overlap:]

    def _to_uint8(self, decoded: torch.Tensor) -> np.ndarray:
        # [1, 3, F, H, W] -> [F, H, W, 3]; float32 * 255 then round-half-even, as diffusers' numpy_to_pil does.
        pixels = (decoded.float() * self._pixel_std + self._pixel_mean).clamp(0, 1)
        return (pixels[0].permute(1, 2, 3, 0) * 255).round().to(torch.uint8).cpu().numpy()

    def _check(self, latents: torch.Tensor) -> None:
        if latents.ndim != 4 or latents.shape[0] != self.latent_channels:
            raise LatentShapeError(f"video latents must be [{self.latent_channels}, frames, height, width], "
                                   f"got {tuple(latents.shape)}")
        if latents.shape[1] < 3:
            raise LatentShapeError(f"video latents have {latents.shape[1]} frames; the VAE decodes at least 3")


def _cross_fade(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Linear cross-fade over the frame axis, weight of `current` rising from 0 by 1/n per frame; in
    `current`'s dtype with the VAE's own operation order, so the result is the VAE's bit for bit."""
    num_frames = current.shape[2]
    ramp = (torch.arange(num_frames, device=current.device, dtype=current.dtype) / num_frames).view(1, 1, -1, 1, 1)
    return previous * (1 - ramp) + current * ramp


class AudioDecoder:
    """AutoencoderKLMiniMaxH3Audio (fp32, as released) decoding channel-major latent rows into stereo."""

    def __init__(self, audio_vae_dir: str | Path, device: torch.device | str, *,
                 halves: VaeHalves = VaeHalves.BOTH) -> None:
        """`halves`: as `VideoDecoder`'s."""
        if halves is VaeHalves.ENCODER:
            raise ValueError("an AudioDecoder runs the decoder half: halves BOTH or DECODER")
        self.audio_vae_dir, self.device = Path(audio_vae_dir), torch.device(device)
        self.vae = load_audio_vae(self.audio_vae_dir, self.device, halves)
        config = self.vae.config
        self.sample_rate: int = config.sampling_rate
        self.latent_channels: int = config.latent_channels
        self.samples_per_latent: int = self.vae.hop_length
        self._latents_mean = torch.tensor(config.latents_mean, device=self.device).view(1, -1, 1)
        self._latents_std = torch.tensor(config.latents_std, device=self.device).view(1, -1, 1)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """float32 [2, num_latents * 800] from normalised rows [2 * num_latents, C]: the left channel's rows,
        then the right's, as the denoiser packs them."""
        if latents.ndim != 2 or latents.shape[1] != self.latent_channels or latents.shape[0] % AUDIO_CHANNELS \
                or latents.shape[0] == 0:
            raise LatentShapeError(f"audio latents must be [2 * num_latents, {self.latent_channels}] with "
                                   f"num_latents >= 1, got {tuple(latents.shape)}")
        rows = latents.to(self.device, torch.float32).reshape(AUDIO_CHANNELS, -1, self.latent_channels)
        z = rows.permute(0, 2, 1).contiguous() * self._latents_std + self._latents_mean  # [2, C, num_latents]
        waveform = self.vae.decode(z, return_dict=False)[0]                 # [2, 1, samples]
        return waveform[:, 0].float().cpu().numpy()


# --- Loading ------------------------------------------------------------------------------------------------


def load_video_vae(vae_dir: str | Path, device: torch.device | str, halves: VaeHalves = VaeHalves.BOTH, *,
                   dtype: torch.dtype = torch.bfloat16) -> AutoencoderKLMiniMaxH3:
    """The video VAE of either layout on `device`, holding `halves` (`dtype`: the decoder blocks'; the encoder is
    fp32 whatever it is). DecoderLoadError naming the directory."""
    vae_dir = Path(vae_dir)
    with _named_load_errors(vae_dir):
        return _keep_halves(_load_video_vae(vae_dir, dtype), VIDEO_VAE_HALVES, halves).to(device)


def load_audio_vae(audio_vae_dir: str | Path, device: torch.device | str,
                   halves: VaeHalves = VaeHalves.BOTH) -> AutoencoderKLMiniMaxH3Audio:
    """The audio VAE (fp32) of either layout on `device`, holding `halves`. DecoderLoadError naming the directory."""
    audio_vae_dir = Path(audio_vae_dir)
    with _named_load_errors(audio_vae_dir):
        return _keep_halves(_load_audio_vae(audio_vae_dir), AUDIO_VAE_HALVES, halves).to(device)


def _keep_halves(vae: torch.nn.Module, submodules: dict[VaeHalves, tuple[str, ...]],
                 halves: VaeHalves) -> torch.nn.Module:
    """`vae` (still on the host) without the submodules of the half it does not hold: calling that half then
    raises AttributeError naming the first missing one."""
    for half, names in submodules.items():
        if halves not in (VaeHalves.BOTH, half):
            for name in names:
                delattr(vae, name)
    return vae



@contextlib.contextmanager
def _named_load_errors(directory: Path) -> Iterator[None]:
    """A native config lacking a key, a weights file cut short or absent: DecoderLoadError naming `directory`
    (a bare KeyError or safetensors' "invalid header length" names no file)."""
    try:
        yield
    except DecoderLoadError:
        raise
    except (KeyError, TypeError, ValueError, OSError, SafetensorError) as e:
        raise DecoderLoadError(f"cannot load the VAE in {directory}: {type(e).__name__}: {e}") from e


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DecoderLoadError(f"cannot read {path}: {e}") from None


def _load_video_vae(vae_dir: Path, dtype: torch.dtype) -> AutoencoderKLMiniMaxH3:
    config = _read_config(vae_dir)
    if config.get("_class_name") == AutoencoderKLMiniMaxH3.__name__:
        return AutoencoderKLMiniMaxH3.from_pretrained(vae_dir, torch_dtype=dtype).eval()
    if "source_path" in config:
        return _load_native_video_vae(vae_dir, config, dtype)
    raise DecoderLoadError(f"{vae_dir / 'config.json'} is neither a diffusers AutoencoderKLMiniMaxH3 config nor a "
                           f"native video_vae wrapper (with source_path)")


def _load_audio_vae(audio_vae_dir: Path) -> AutoencoderKLMiniMaxH3Audio:
    config = _read_config(audio_vae_dir)
    if config.get("_class_name") == AutoencoderKLMiniMaxH3Audio.__name__:
        return AutoencoderKLMiniMaxH3Audio.from_pretrained(audio_vae_dir).eval()
    if (audio_vae_dir / "metadata.json").is_file():
        return _load_native_audio_vae(audio_vae_dir, config)
    raise DecoderLoadError(f"{audio_vae_dir} holds neither a diffusers AutoencoderKLMiniMaxH3Audio config nor a "
                           f"native audio VAE (metadata.json)")


def _load_native_video_vae(vae_dir: Path, wrapper: dict, dtype: torch.dtype) -> AutoencoderKLMiniMaxH3:
    source_dir = vae_dir / wrapper["source_path"]
    source = _read_config(source_dir)
    for feature, value in NATIVE_VIDEO_FIXED_FEATURES.items():
        if source.get(feature, value) != value:
            raise DecoderLoadError(f"{source_dir / 'config.json'}: {feature}={source[feature]!r}, but "
                                   f"AutoencoderKLMiniMaxH3 implements only {feature}={value!r}")
    decoder = source["vit_decoder_kwargs"]
    config = {
        "in_channels": source["in_channels"], "out_channels": source["out_ch"],
        "latent_channels": source["z_channels"],
        "block_out_channels": [source["ch"] * multiple for multiple in source["ch_mult"]],
        "layers_per_block": source["num_res_blocks"], "spatial_downsample_factors": source["space_down"],
        "temporal_downsample_factors": source["time_down"], "spatial_padding_mode": source["padding_mode"],
        "decoder_num_layers": decoder["num_layers"], "decoder_num_attention_heads": decoder["heads"],
        "decoder_attention_head_dim": decoder["dim_head"], "decoder_rope_theta": decoder["rope_theta"],
        "decoder_rope_dim_ratio": decoder["rope_dim_ratio"], "clip_length": wrapper["vae_clip_length"],
        "token_drop": wrapper["vae_token_drop"], "latents_mean": wrapper["latents_mean"],
        "latents_std": wrapper["latents_std"],
    }
    with init_empty_weights():
        vae = AutoencoderKLMiniMaxH3.from_config(config)
    weights_path = source_dir / wrapper.get("source_safetensors_path", "model.safetensors")
    state = native_video_vae_to_diffusers(load_file(weights_path), decoder["heads"], decoder["dim_head"])
    _load_state_(vae, state, weights_path, dtype)
    tile, overlap = wrapper.get("vae_tile_size"), wrapper.get("vae_tile_overlap_min")
    vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                      tile_sample_min_overlap_height=overlap, tile_sample_min_overlap_width=overlap)
    return vae.eval()


def native_video_vae_to_diffusers(native: dict[str, torch.Tensor], heads: int,
                                  head_dim: int) -> dict[str, torch.Tensor]:
    """Original `AutoencoderKLLegacy` tensors -> AutoencoderKLMiniMaxH3 names and layouts.

    Renames: `encoder.down.{i}.block.{j}` -> `encoder.down_blocks.{i}.resnets.{j}`, `nin_shortcut` ->
    `conv_shortcut`, `encoder.down.{i}.downsample` -> `encoder.down_blocks.{i}.downsamplers.0`,
    `decoder.x_embedder` -> `decoder.proj_in`, `attn.to_out` -> `attn.to_out.0`, `ff.w2` -> `ff.net.2`.
    Reshapes: `attn.to_qkv` rows [head0: q k v, head1: ...] -> `to_q` / `to_k` / `to_v`; `ff.w1` [gate; up] ->
    `ff.net.0.proj` [up; gate]. Dropped: `decoder.mask_token` (a training-only buffer).
    """
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in native.items():
        if name == "decoder.mask_token":
            continue
        if ".attn.to_qkv." in name:
            per_head = tensor.reshape(heads, 3, head_dim, *tensor.shape[1:])
            for index, projection in enumerate(("to_q", "to_k", "to_v")):
                rows = per_head[:, index].reshape(heads * head_dim, *tensor.shape[1:])
                converted[name.replace(".to_qkv.", f".{projection}.")] = rows.contiguous()
        elif ".ff.w1." in name:
            gate, up = tensor.chunk(2, dim=0)
            converted[name.replace(".ff.w1.", ".ff.net.0.proj.")] = torch.cat([up, gate])
        else:
            converted[_diffusers_video_name(name)] = tensor
    return converted


def _diffusers_video_name(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["encoder", "down"]:  # encoder.down.{i}.block.{j}... -> encoder.down_blocks.{i}.resnets.{j}...
        rest = ".".join(parts[3:]).replace("block.", "resnets.", 1).replace("nin_shortcut.", "conv_shortcut.", 1)
        name = f"encoder.down_blocks.{parts[2]}.{rest.replace('downsample.', 'downsamplers.0.', 1)}"
    return (name.replace("decoder.x_embedder.", "decoder.proj_in.")
                .replace(".attn.to_out.", ".attn.to_out.0.")
                .replace(".ff.w2.", ".ff.net.2."))


def _load_native_audio_vae(audio_vae_dir: Path, wrapper: dict) -> AutoencoderKLMiniMaxH3Audio:
    metadata_path = audio_vae_dir / wrapper.get("source_metadata_path", "metadata.json")
    kwargs = json.loads(metadata_path.read_text())["metadata"]["kwargs"]
    if kwargs.get("decoder_type") != "bigvgan" or not kwargs.get("attn_proj"):
        raise DecoderLoadError(f"{metadata_path}: decoder_type {kwargs.get('decoder_type')!r}, attn_proj "
                               f"{kwargs.get('attn_proj')!r}; AutoencoderKLMiniMaxH3Audio implements bigvgan with "
                               f"the attention projection")
    config = {
        "encoder_dim": kwargs["encoder_dim"], "encoder_rates": kwargs["encoder_rates"],
        "latent_dim": kwargs["latent_dim"], "latent_channels": kwargs["vae_latent_channels"],
        "decoder_dim": kwargs["decoder_dim"], "decoder_rates": kwargs["decoder_rates"],
        # The release pairs upsampling rate u with kernel 2u (even u) or 2u - 1 (odd u).
        "decoder_kernel_sizes": [2 * rate - rate % 2 for rate in kwargs["decoder_rates"]],
        **NATIVE_AUDIO_FIXED_CONFIG, "sampling_rate": kwargs["sample_rate"],
        "latents_mean": wrapper["latents_mean"], "latents_std": wrapper["latents_std"],
    }
    with init_empty_weights():
        vae = AutoencoderKLMiniMaxH3Audio.from_config(config)
    weights_path = audio_vae_dir / wrapper.get("source_safetensors_path", "model.safetensors")
    _load_state_(vae, load_file(weights_path), weights_path, torch.float32)
    return vae.eval()


def _load_state_(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path, dtype: torch.dtype) -> None:
    """Assign `state` to a meta-initialised diffusers model, casting floating tensors to `dtype` except under
    the class's `_keep_in_fp32_modules` (the rule of diffusers' own loader)."""
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise DecoderLoadError(f"{source}: {len(missing)} tensors missing (e.g. {missing[:3]}), {len(unexpected)} "
                               f"unexpected (e.g. {unexpected[:3]}) for {type(model).__name__}")
    keep_fp32 = set(type(model)._keep_in_fp32_modules or [])
    for name, tensor in state.items():
        if tensor.is_floating_point():
            state[name] = tensor.to(torch.float32 if keep_fp32 & set(name.split(".")) else dtype)
    model.load_state_dict(state, strict=True, assign=True)
