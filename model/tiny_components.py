"""Tiny random MiniMax-H3 components besides the transformer, written offline in either published layout.

`write_tiny_components(root, layout, seed)` writes, with the libraries' own classes and `save_pretrained`:

    component        diffusers layout            native layout
    ---------------  --------------------------  -----------------------------------------------------------
    text encoder     text_encoder/               text_encoder/            (Qwen3-VL, the same in both)
    tokenizer        tokenizer/                  tokenizer/
    processor        processor/                  processor/               (tokenizer, image + video processor)
    video VAE        vae/                        video_vae/config.json + video_vae/source/{config.json,
                                                 model.safetensors}       (original key names and layouts)
    audio VAE        audio_vae/                  audio_vae/{config.json, metadata.json, config.yaml,
                                                 model.safetensors}       (same key names as diffusers)

Sizes: the text encoder is a Qwen3-VL with text width 32 (= the tiny transformer's `text_dim`), 4 heads of 16 over
2 kv heads, and 51 decoder layers, because MiniMax-H3 reads `hidden_states[50]`; its vision tower is one block
wide 16. The tokenizer is a byte-level BPE trained here on a few sentences and wrapped as `Qwen2TokenizerFast`
with the Qwen-VL special tokens. The video VAE keeps the checkpoint-tied geometry (24 latent channels, x16 spatial as four x2 levels,
x4 temporal, 17-frame clips, 3 dropped tokens) at 32 channels (the released GroupNorm has 32 groups) and a
one-layer ViT decoder; the audio VAE keeps 32 latent channels, hop 800 at 32 kHz and 8 attention heads.

`processor/video_preprocessor_config.json` is written as json (TINY_VIDEO_PROCESSOR_CONFIG, the config the
Qwen3-VL video fixture checks `model.qwen_video` at): transformers' `Qwen3VLVideoProcessor` needs torchvision,
which is not installable here, so it cannot be built and saved.

The same seed gives the same bytes: every random draw comes from a generator seeded with `seed`, and the
global RNG is left as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from model.layout import Layout
from model.qwen_video import VIDEO_PROCESSOR_FILE

TINY_TEXT_DIM = 32
#: MiniMax-H3 reads hidden_states[50]; one more layer than that, so the output read is not the final (normed) one.
TINY_TEXT_LAYERS = 51
#: Query and kv heads of the tiny Qwen3-VL: grouped-query attention like the release (64 / 8), and divisible by
#: 2 so the encoder splits over 2 ranks (`parallel.text_encoder`).
TINY_TEXT_HEADS = 4
TINY_TEXT_KV_HEADS = 2
TINY_TEXT_MLP = 64
TINY_VIDEO_LATENT_CHANNELS = 24
TINY_AUDIO_LATENT_CHANNELS = 32
TINY_AUDIO_SAMPLE_RATE = 32000
#: The video half of the tiny Qwen3-VL processor (patch 4, merge 2, as the image half), as transformers saves it;
#: tests/data/qwen3vl_video/make_fixture.py's TINY config.
TINY_VIDEO_PROCESSOR_CONFIG = {
    "video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
    "size": {"shortest_edge": 256, "longest_edge": 16384}, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True,
    "do_normalize": True, "do_convert_rgb": True, "do_sample_frames": False,
}

QWEN_VL_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)
#: The byte-level BPE is trained on these; prompts outside them still tokenize (byte fallback via the alphabet).
TOKENIZER_CORPUS = (
    "A red fox runs across a snowy field at dawn, its breath steaming in the cold air.",
    "integrated_multimodal_description: waves crash against black rocks under a grey sky.",
    "overall_soundscape: wind, distant gulls and the hiss of surf on gravel.",
    "non_diegetic_music: a slow piano melody over soft strings.",
    "The camera pans left to follow a cyclist through a busy market street at noon.",
)
TOKENIZER_VOCAB_SIZE = 400
#: Qwen2's pre-tokenization split (digits one by one, letters in runs, punctuation runs, whitespace runs).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

#: `video_vae/source/config.json` of the release (the original `AutoencoderKLLegacy` fields), less what the tiny
#: VAE changes; see `_native_video_source_config`.
RELEASED_VIDEO_SOURCE_CONFIG = {
    "_class_name": "AutoencoderKLLegacy", "causal_decoder": False, "causal_encoder": True, "ch": 128,
    "ch_mult": [1, 2, 2, 4, 4, 8], "embed_dim": 24, "in_channels": 3, "num_res_blocks": 2,
    "num_res_blocks_decoder": None, "out_ch": 3, "padding_mode": "reflect", "padding_mode_t": None,
    "pixel_norm_type": "imagenet", "scaling_factor": 1.0, "shift_factor": 0.0, "space_down": [2, 2, 2, 2, 1, 1],
    "space_up": [1, 2, 2, 2, 2, 1], "time_down": [1, 2, 2, 1, 1, 1], "time_up": None, "use_3d_conv": True,
    "use_t_isolated_gn": True, "use_vit_decoder": True, "vae_ratio": 16, "vae_ratio_t": 4,
    "vit_decoder_kwargs": {"dim_head": 64, "ffn_activation_fn": "silu", "ffn_use_gated": True, "heads": 32,
                           "norm_affine": True, "norm_type": "rms_norm", "num_layers": 36, "qk_norm_affine": False,
                           "qk_norm_type": "rms_norm", "rope_dim_ratio": 0.75, "rope_theta": 100.0},
    "z_channels": 24, "zq_ch_decoder": None, "zq_ch_encoder": None,
}


def write_tiny_components(root: Path, layout: Layout | str, seed: int) -> None:
    """Write the tiny text encoder, tokenizer, processor, video VAE and audio VAE of `layout` under `root`."""
    root, layout = Path(root), Layout(layout)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    tokenizer.save_pretrained(root / "processor")
    tiny_image_processor().save_pretrained(root / "processor")
    _write_json(root / "processor" / VIDEO_PROCESSOR_FILE, TINY_VIDEO_PROCESSOR_CONFIG)
    tiny_text_encoder(tokenizer, seed).save_pretrained(root / "text_encoder")
    video_vae, audio_vae = tiny_video_vae(seed), tiny_audio_vae(seed)
    if layout is Layout.DIFFUSERS:
        video_vae.save_pretrained(root / "vae")
        audio_vae.save_pretrained(root / "audio_vae")
    else:
        write_native_video_vae(root / "video_vae", video_vae)
        write_native_audio_vae(root / "audio_vae", audio_vae)


# --- Tokenizer and text encoder ---------------------------------------------------------------------------


def tiny_tokenizer() -> Qwen2TokenizerFast:
    """A byte-level BPE trained on TOKENIZER_CORPUS, as a Qwen2 tokenizer with the Qwen-VL special tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(TOKENIZER_CORPUS, trainer)
    trained = json.loads(bpe.to_str())["model"]
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in trained["merges"]]
    # Qwen2TokenizerFast rebuilds its own pipeline (NFC, the split above, byte level) around the vocabulary.
    return Qwen2TokenizerFast(vocab=trained["vocab"], merges=merges, unk_token=None, eos_token="<|endoftext|>",
                              pad_token="<|endoftext|>", additional_special_tokens=list(QWEN_VL_SPECIAL_TOKENS))


def tiny_image_processor() -> Qwen2VLImageProcessorPil:
    """The image half of the Qwen3-VL processor, sized for the tiny vision tower (patch 4, merge 2)."""
    return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 64, "longest_edge": 64 * 64})


def tiny_text_encoder(tokenizer: Qwen2TokenizerFast, seed: int, *, num_heads: int = TINY_TEXT_HEADS,
                      num_kv_heads: int = TINY_TEXT_KV_HEADS, intermediate_size: int = TINY_TEXT_MLP,
                      dtype: torch.dtype = torch.bfloat16) -> Qwen3VLForConditionalGeneration:
    """A Qwen3-VL of text width TINY_TEXT_DIM and TINY_TEXT_LAYERS layers, in bfloat16 like the release (the
    head counts, MLP width and dtype may be changed for tests of other shapes)."""
    token_id = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": TINY_TEXT_DIM, "intermediate_size": intermediate_size,
            "num_hidden_layers": TINY_TEXT_LAYERS, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "head_dim": 16, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            # mrope sections split head_dim / 2 = 8 rotary frequencies over (t, h, w).
            "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 3, 3],
                                "mrope_interleaved": True},
        },
        vision_config={
            "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 4,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": TINY_TEXT_DIM,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
        },
        image_token_id=token_id("<|image_pad|>"), video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"), vision_end_token_id=token_id("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    # The library's own initialisation (normal(0, 0.02) weights), drawn from a seeded RNG without disturbing
    # the caller's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    return model.to(dtype).eval()


# --- VAEs ---------------------------------------------------------------------------------------------------


def tiny_video_vae(seed: int) -> AutoencoderKLMiniMaxH3:
    """The smallest AutoencoderKLMiniMaxH3 with the released latent geometry, every weight random (fp32)."""
    generator = torch.Generator().manual_seed(seed * 2 + 1)
    latents_mean, latents_std = _latent_statistics(TINY_VIDEO_LATENT_CHANNELS, generator)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLMiniMaxH3(
            latent_channels=TINY_VIDEO_LATENT_CHANNELS, block_out_channels=(32, 32, 32, 32), layers_per_block=1,
            spatial_downsample_factors=(2, 2, 2, 2), temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=32,
            decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
            latents_mean=latents_mean, latents_std=latents_std,
        )
    _perturb_(vae, generator)
    return vae.eval()


def tiny_audio_vae(seed: int) -> AutoencoderKLMiniMaxH3Audio:
    """The smallest AutoencoderKLMiniMaxH3Audio with the released latent rate and width (fp32)."""
    generator = torch.Generator().manual_seed(seed * 2 + 2)
    latents_mean, latents_std = _latent_statistics(TINY_AUDIO_LATENT_CHANNELS, generator)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLMiniMaxH3Audio(
            encoder_dim=4, encoder_rates=(2, 4, 4, 5, 5), latent_dim=64, latent_channels=TINY_AUDIO_LATENT_CHANNELS,
            num_attention_heads=8, decoder_dim=128, decoder_rates=(5, 5, 2, 2, 2, 2, 2),
            decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4), sampling_rate=TINY_AUDIO_SAMPLE_RATE,
            latents_mean=list(latents_mean), latents_std=list(latents_std),
        )
    _perturb_(vae, generator)
    return vae.eval()


def _latent_statistics(channels: int, generator: torch.Generator) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel latent mean / std away from (0, 1), so a missing or swapped de-normalization shows."""
    mean = 0.5 * torch.randn(channels, generator=generator)
    std = 0.5 + torch.rand(channels, generator=generator)
    return tuple(mean.tolist()), tuple(std.tolist())


@torch.no_grad()
def _perturb_(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Add N(0, 0.1) noise to every parameter, so zero-initialised ones (the ViT decoder's residual scales and
    register tokens) take part in the output and unit norm scales are not exactly 1."""
    for _, parameter in sorted(module.named_parameters()):
        parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))


# --- Native layout ------------------------------------------------------------------------------------------


def write_native_video_vae(directory: Path, vae: AutoencoderKLMiniMaxH3) -> None:
    """video_vae/ as released: a wrapper config.json and source/{config.json, model.safetensors} under the
    original `AutoencoderKLLegacy` names (the inverse of `model.decode`'s native reading)."""
    config = vae.config
    _write_json(directory / "config.json", {
        "_class_name": "MiniMaxH3VideoVAE", "_diffusers_version": "0.32.2",
        "auto_map": {"AutoModel": "minimax_h3_video_vae.MiniMaxH3VideoVAE"},
        "source_path": "source", "source_class_name": "AutoencoderKLLegacy",
        "source_safetensors_path": "model.safetensors", "latent_channels": config.latent_channels,
        "latents_mean": list(config.latents_mean), "latents_std": list(config.latents_std),
        "vae_clip_length": config.clip_length, "vae_token_drop": config.token_drop, "vae_encoder_tiling": 1,
        "vae_decoder_tiling": 1, "vae_parallel_tiling": 0, "vae_tile_size": vae.tile_sample_min_height,
        "vae_tile_overlap_min": vae.tile_sample_min_overlap_height, "vae_encoder_parallel": 0,
        "vae_decoder_parallel": 0, "vae_chunk_dim": -1,
    })
    _write_json(directory / "source" / "config.json", _native_video_source_config(vae))
    state = native_video_vae_state_dict(vae)
    save_file(state, str(directory / "source" / "model.safetensors"), metadata={"format": "pt"})


def _native_video_source_config(vae: AutoencoderKLMiniMaxH3) -> dict:
    config = vae.config
    width = config.block_out_channels[0]
    if any(channels % width for channels in config.block_out_channels):
        raise ValueError(f"block_out_channels {config.block_out_channels} are not multiples of the first, which "
                         f"the original `ch * ch_mult` config cannot express")
    decoder = {**RELEASED_VIDEO_SOURCE_CONFIG["vit_decoder_kwargs"], "num_layers": config.decoder_num_layers,
               "heads": config.decoder_num_attention_heads, "dim_head": config.decoder_attention_head_dim,
               "rope_theta": config.decoder_rope_theta, "rope_dim_ratio": config.decoder_rope_dim_ratio}
    return {**RELEASED_VIDEO_SOURCE_CONFIG, "ch": width,
            "ch_mult": [channels // width for channels in config.block_out_channels],
            "embed_dim": config.latent_channels, "z_channels": config.latent_channels,
            "in_channels": config.in_channels, "out_ch": config.out_channels,
            "num_res_blocks": config.layers_per_block, "padding_mode": config.spatial_padding_mode,
            "space_down": list(config.spatial_downsample_factors),
            "time_down": list(config.temporal_downsample_factors), "vit_decoder_kwargs": decoder}


def native_video_vae_state_dict(vae: AutoencoderKLMiniMaxH3) -> dict[str, torch.Tensor]:
    """The VAE's tensors under the original names: CompVis-style encoder levels, `x_embedder`, a fused
    per-head-interleaved `to_qkv`, an unwrapped `to_out`, the gated FFN as `w1` ([gate; up]) / `w2`, and the
    training-only `decoder.mask_token` the release also carries."""
    heads, head_dim = vae.config.decoder_num_attention_heads, vae.config.decoder_attention_head_dim
    state = vae.state_dict()
    native: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".attn.to_k." in name or ".attn.to_v." in name:
            continue  # fused into to_qkv with to_q below
        if ".attn.to_q." in name:
            parts = [state[name.replace(".to_q.", f".{projection}.")] for projection in ("to_q", "to_k", "to_v")]
            # [heads * head_dim, ...] each -> rows [head0: q k v, head1: q k v, ...]
            per_head = torch.stack([part.reshape(heads, head_dim, -1) for part in parts], dim=1)
            native[name.replace(".to_q.", ".to_qkv.")] = per_head.reshape(3 * heads * head_dim, *parts[0].shape[1:])
        elif ".ff.net.0.proj." in name:
            up, gate = tensor.chunk(2, dim=0)
            native[name.replace(".ff.net.0.proj.", ".ff.w1.")] = torch.cat([gate, up])
        else:
            native[_native_video_name(name)] = tensor
    native["decoder.mask_token"] = torch.zeros(1, 1, heads * head_dim)
    return {name: tensor.contiguous() for name, tensor in sorted(native.items())}


def _native_video_name(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["encoder", "down_blocks"]:  # encoder.down_blocks.{i}.resnets.{j} -> encoder.down.{i}.block.{j}
        rest = ".".join(parts[3:]).replace("resnets.", "block.", 1).replace("conv_shortcut.", "nin_shortcut.", 1)
        name = f"encoder.down.{parts[2]}.{rest.replace('downsamplers.0.', 'downsample.', 1)}"
    return (name.replace("decoder.proj_in.", "decoder.x_embedder.")
                .replace(".attn.to_out.0.", ".attn.to_out.")
                .replace(".ff.net.2.", ".ff.w2."))


def write_native_audio_vae(directory: Path, vae: AutoencoderKLMiniMaxH3Audio) -> None:
    """audio_vae/ as released: the wrapper config.json, the constructor kwargs in metadata.json, config.yaml,
    and the weights under the same names diffusers uses."""
    config = vae.config
    _write_json(directory / "config.json", {
        "_class_name": "MiniMaxH3AudioVAE", "_diffusers_version": "0.32.2",
        "auto_map": {"AutoModel": "minimax_h3_audio_vae.MiniMaxH3AudioVAE"}, "output_channel": 2,
        "sample_rate": config.sampling_rate, "source_config_path": "config.yaml",
        "source_safetensors_path": "model.safetensors", "source_metadata_path": "metadata.json",
        "latent_channels": config.latent_channels, "latents_mean": list(config.latents_mean),
        "latents_std": list(config.latents_std),
    })
    _write_json(directory / "metadata.json", {"metadata": {"kwargs": {
        "encoder_dim": config.encoder_dim, "encoder_rates": list(config.encoder_rates),
        "latent_dim": config.latent_dim, "decoder_dim": config.decoder_dim,
        "decoder_rates": list(config.decoder_rates), "decoder_type": "bigvgan", "attn_proj": True,
        "vae_latent_channels": config.latent_channels, "sample_rate": config.sampling_rate,
    }}})
    (directory / "config.yaml").write_text(
        f"model_config:\n  decoder_dim: {config.decoder_dim}\n  vae_latent_channels: {config.latent_channels}\n")
    state = {name: tensor.contiguous() for name, tensor in sorted(vae.state_dict().items())}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
