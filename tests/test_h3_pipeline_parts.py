"""The pipeline parts around the transformer: prompt encoding, VAE decoding, MP4 muxing, tiny components.

Oracles are diffusers' own MiniMax-H3 modular blocks (text encoder step, after-denoise unpacking, video and
audio decode steps) run on the same tiny components; equality is exact (bitwise) wherever it is claimed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from diffusers.modular_pipelines.minimax_h3.decoders import (MiniMaxH3AfterDenoiseStep, MiniMaxH3AudioDecodeStep,
                                                              MiniMaxH3VideoDecodeStep)
from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep
from PIL import Image
from transformers import Qwen2TokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from model.decode import (AUDIO_VAE_HALVES, VIDEO_VAE_HALVES, AudioDecoder, DecoderLoadError, LatentShapeError,
                          VaeHalves, VideoDecoder, load_audio_vae, load_video_vae, native_video_vae_to_diffusers)
from model.encode import AudioConditionEncoder, VisualConditionEncoder
from model.mp4 import MediaInputError, thumbnail_png, write_mp4
from model.prompts import (EmptyPromptError, PromptCacheStats, PromptEmbeddingCache, PromptError, PromptKey,
                           PromptTooLongError)
from model.text_encoder import PromptEncoder, TextEncoderLoadError
from model.tiny_components import (QWEN_VL_SPECIAL_TOKENS, TINY_TEXT_DIM, TINY_TEXT_LAYERS, native_video_vae_state_dict,
                                   tiny_video_vae, write_tiny_components)

LAYOUTS = ("diffusers", "native")
#: The halves-equal-the-whole tests keep one layout in the inner loop; the native one runs in the full suite.
INNER_LOOP_LAYOUTS = ("diffusers", pytest.param("native", marks=pytest.mark.slow))
VIDEO_VAE_DIR = {"diffusers": "vae", "native": "video_vae"}
PROMPTS = (
    "A red fox runs across a snowy field at dawn.",
    "x",
    "integrated_multimodal_description: 狐狸 jumps; overall_soundscape: wind <|image_pad|> 123",
)


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    """The seed-0 tiny components of each layout."""
    roots = {}
    for layout in LAYOUTS:
        roots[layout] = tmp_path_factory.mktemp(layout)
        write_tiny_components(roots[layout], layout, seed=0)
    return roots


# --- Tiny components ----------------------------------------------------------------------------------------


def _file_digests(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


EXPECTED_FILES = {
    "diffusers": {"audio_vae/config.json", "audio_vae/diffusion_pytorch_model.safetensors",
                  "vae/config.json", "vae/diffusion_pytorch_model.safetensors"},
    "native": {"audio_vae/config.json", "audio_vae/config.yaml", "audio_vae/metadata.json",
               "audio_vae/model.safetensors", "video_vae/config.json", "video_vae/source/config.json",
               "video_vae/source/model.safetensors"},
}
SHARED_FILES = {"text_encoder/config.json", "text_encoder/generation_config.json", "text_encoder/model.safetensors",
                "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "processor/tokenizer.json",
                "processor/tokenizer_config.json", "processor/preprocessor_config.json",
                "processor/video_preprocessor_config.json"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiny_components_files_per_layout(roots, layout):
    assert set(_file_digests(roots[layout])) == SHARED_FILES | EXPECTED_FILES[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_seed_same_bytes_other_seed_other_weights(roots, tmp_path, layout):
    write_tiny_components(tmp_path / "again", layout, seed=0)
    write_tiny_components(tmp_path / "other", layout, seed=1)
    seed0, again, seed1 = (_file_digests(p) for p in (roots[layout], tmp_path / "again", tmp_path / "other"))
    assert again == seed0
    weights = {name for name in seed0 if name.endswith(".safetensors")}
    assert {name for name in weights if seed1[name] != seed0[name]} == weights


def test_tiny_text_encoder_and_tokenizer_fit_together(roots):
    config = Qwen3VLConfig.from_pretrained(roots["native"] / "text_encoder")
    tokenizer = Qwen2TokenizerFast.from_pretrained(roots["native"] / "tokenizer")
    assert (config.text_config.hidden_size, config.text_config.num_hidden_layers) == (TINY_TEXT_DIM, TINY_TEXT_LAYERS)
    assert config.text_config.vocab_size == len(tokenizer)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    for token in QWEN_VL_SPECIAL_TOKENS:  # each special token is one id, parsed out of running text
        token_ids = tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"]
        assert token_ids[1] == tokenizer.convert_tokens_to_ids(token)


def test_tiny_vaes_keep_the_released_latent_geometry(roots):
    vae = AutoencoderKLMiniMaxH3.from_pretrained(roots["diffusers"] / "vae")
    audio = AutoencoderKLMiniMaxH3Audio.from_pretrained(roots["diffusers"] / "audio_vae")
    assert (vae.config.latent_channels, vae.spatial_compression_ratio, vae.temporal_compression_ratio) == (24, 16, 4)
    assert (vae.config.clip_length, vae.tokens_chunk_size, vae.frame_overlap) == (17, 5, 5)
    assert (audio.config.latent_channels, audio.hop_length, audio.config.sampling_rate) == (32, 800, 32000)


def test_native_video_vae_names_invert_exactly():
    vae = tiny_video_vae(seed=0)
    native = native_video_vae_state_dict(vae)
    assert {"encoder.down.0.block.0.conv1.weight", "encoder.down.3.downsample.conv.weight",
            "decoder.x_embedder.weight", "decoder.transformer_blocks.0.attn.to_qkv.weight",
            "decoder.transformer_blocks.0.attn.to_out.bias", "decoder.transformer_blocks.0.ff.w1.weight",
            "decoder.transformer_blocks.0.ff.w2.weight", "decoder.mask_token"} <= set(native)
    # to_qkv rows are interleaved per head: head h's query rows start at h * 3 * head_dim.
    heads, head_dim = vae.config.decoder_num_attention_heads, vae.config.decoder_attention_head_dim
    qkv = native["decoder.transformer_blocks.0.attn.to_qkv.weight"]
    to_k = vae.state_dict()["decoder.transformer_blocks.0.attn.to_k.weight"]
    assert torch.equal(qkv[3 * head_dim + head_dim: 3 * head_dim + 2 * head_dim], to_k[head_dim:2 * head_dim])
    back = native_video_vae_to_diffusers(native, heads, head_dim)
    expected = vae.state_dict()
    assert set(back) == set(expected)
    assert all(torch.equal(back[name], expected[name]) for name in expected)


# --- Prompt encoding ----------------------------------------------------------------------------------------


class TextOnlyProcessor:
    """Stands in for Qwen3VLProcessor, which cannot be built without torchvision. The text encoder step uses it
    only for `create_mm_token_type_ids`; with no pixel inputs Qwen3-VL ignores those types (plain positions)."""

    def create_mm_token_type_ids(self, input_ids: list[list[int]]) -> list[list[int]]:
        return [[0] * len(row) for row in input_ids]


@pytest.fixture(scope="module")
def full_text_encoder(roots) -> Qwen3VLForConditionalGeneration:
    return Qwen3VLForConditionalGeneration.from_pretrained(roots["diffusers"] / "text_encoder", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def reference_text_step(roots, full_text_encoder):
    pipeline = MiniMaxH3TextEncoderStep().init_pipeline()
    pipeline.update_components(text_encoder=full_text_encoder, processor=TextOnlyProcessor(),
                               tokenizer=Qwen2TokenizerFast.from_pretrained(roots["diffusers"] / "tokenizer"))
    return pipeline


@pytest.fixture(scope="module")
def encoders(roots) -> dict[str, PromptEncoder]:
    return {layout: PromptEncoder(roots[layout] / "text_encoder", roots[layout] / "tokenizer", "cpu")
            for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_embedding_equals_diffusers_text_encoder_step(reference_text_step, encoders, layout, prompt):
    expected = reference_text_step(prompt=prompt, output="prompt_embeds")  # [1, L, text_dim]
    embedding = encoders[layout].encode(prompt)
    assert embedding.dtype == expected.dtype == torch.bfloat16
    assert embedding.shape == expected.shape[1:] == (encoders[layout].count_tokens(prompt), TINY_TEXT_DIM)
    assert torch.equal(embedding, expected[0])


@pytest.mark.parametrize("index", [1, 49, 50])
def test_encoder_returns_the_full_models_hidden_state_at_its_index(roots, full_text_encoder, index):
    encoder = PromptEncoder(roots["diffusers"] / "text_encoder", roots["diffusers"] / "tokenizer", "cpu",
                            hidden_state_index=index)
    input_ids = torch.tensor([encoder.tokenize(PROMPTS[0])])
    with torch.inference_mode():
        hidden_states = full_text_encoder.model(input_ids=input_ids, output_hidden_states=True).hidden_states
    assert encoder.num_loaded_layers == index
    assert torch.equal(encoder.encode(PROMPTS[0]), hidden_states[index][0])
    assert not torch.equal(encoder.encode(PROMPTS[0]), hidden_states[index - 1][0])


@pytest.mark.parametrize("index", [0, TINY_TEXT_LAYERS])
def test_hidden_state_index_outside_the_layer_outputs_is_refused(roots, index):
    with pytest.raises(TextEncoderLoadError, match=f"hidden_state_index {index} is out of range"):
        PromptEncoder(roots["diffusers"] / "text_encoder", roots["diffusers"] / "tokenizer", "cpu",
                      hidden_state_index=index)


def test_prompt_is_tokenized_verbatim(encoders, roots):
    tokenizer = Qwen2TokenizerFast.from_pretrained(roots["diffusers"] / "tokenizer")
    special_ids = set(tokenizer.convert_tokens_to_ids(list(QWEN_VL_SPECIAL_TOKENS)))
    token_ids = encoders["diffusers"].tokenize(PROMPTS[0])
    assert token_ids == tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    assert not special_ids & set(token_ids)  # no template, no BOS/EOS, no padding
    assert tokenizer.decode(token_ids) == PROMPTS[0]


def test_missing_tokenizer_directory_is_named(roots, tmp_path):
    with pytest.raises(TextEncoderLoadError, match=f"tokenizer directory {tmp_path / 'absent'} does not exist"):
        PromptEncoder(roots["diffusers"] / "text_encoder", tmp_path / "absent", "cpu")


def test_a_tokenizer_directory_without_its_vocabulary_is_refused(roots, tmp_path):
    """tokenizer_config.json without tokenizer.json (a partial download) loads as a tokenizer that gives every
    prompt 0 tokens: each request would be refused as the client's empty prompt."""
    partial = Path(shutil.copytree(roots["diffusers"] / "tokenizer", tmp_path / "tokenizer"))
    (partial / "tokenizer.json").unlink()
    with pytest.raises(TextEncoderLoadError, match=f"{partial} holds no tokenizer vocabulary"):
        PromptEncoder(roots["diffusers"] / "text_encoder", partial, "cpu")


def test_a_tokenizer_with_ids_past_the_embedding_is_refused(roots, tmp_path):
    """Another model's tokenizer: a prompt with its extra token would index past the embedding table."""
    tokenizer = Qwen2TokenizerFast.from_pretrained(roots["diffusers"] / "tokenizer")
    rows = len(tokenizer)
    tokenizer.add_tokens(["<|another_models_token|>"])
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    with pytest.raises(TextEncoderLoadError, match=f"has {rows + 1} tokens, more than the {rows} rows"):
        PromptEncoder(roots["diffusers"] / "text_encoder", tmp_path / "tokenizer", "cpu")


def _without_weight_map(text_encoder: Path) -> None:
    (text_encoder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def _cut_short(path: Path) -> None:
    os.truncate(path, 1000)


@pytest.mark.parametrize("breakage, cause", [
    pytest.param(_without_weight_map, "KeyError: 'weight_map'", id="index-without-weight-map"),
    pytest.param(lambda d: _cut_short(d / "model.safetensors"), "SafetensorError", id="weights-cut-short"),
])
def test_unloadable_text_encoder_weights_are_a_load_error_naming_the_directory(roots, tmp_path, breakage, cause):
    broken = Path(shutil.copytree(roots["diffusers"] / "text_encoder", tmp_path / "text_encoder"))
    breakage(broken)
    with pytest.raises(TextEncoderLoadError, match=f"weights in {re.escape(str(broken))}: {cause}"):
        PromptEncoder(broken, roots["diffusers"] / "tokenizer", "cpu")


@pytest.mark.parametrize("prompt", ["", 7])
def test_empty_or_non_string_prompt_is_refused(encoders, prompt):
    with pytest.raises(PromptError, match="no tokens" if prompt == "" else "must be a string") as raised:
        encoders["diffusers"].encode(prompt)
    assert isinstance(raised.value, EmptyPromptError) == (prompt == "")


def test_max_tokens_is_enforced_with_the_count_in_the_message(encoders):
    encoder = encoders["diffusers"]
    count = encoder.count_tokens(PROMPTS[0])
    assert encoder.encode(PROMPTS[0], max_tokens=count).shape[0] == count
    with pytest.raises(PromptTooLongError, match=f"{count} tokens, more than the limit of {count - 1}"):
        encoder.encode(PROMPTS[0], max_tokens=count - 1)


def test_encoder_identity_follows_weight_files_tokenizer_and_index(roots, encoders, tmp_path):
    write_tiny_components(tmp_path / "seed1", "diffusers", seed=1)
    text_encoder, tokenizer = roots["diffusers"] / "text_encoder", roots["diffusers"] / "tokenizer"
    identities = {
        "same files": PromptEncoder(text_encoder, tokenizer, "cpu").identity,
        "other weights": PromptEncoder(tmp_path / "seed1" / "text_encoder", tokenizer, "cpu").identity,
        "other index": PromptEncoder(text_encoder, tokenizer, "cpu", hidden_state_index=49).identity,
        "other tokenizer": PromptEncoder(text_encoder, roots["native"] / "processor", "cpu").identity,
    }
    assert identities["same files"] == encoders["diffusers"].identity
    assert len(set(identities.values())) == 4 and all(len(i) == 16 for i in identities.values())
    (text_encoder / "model.safetensors").touch()  # a replaced weight file is another encoder
    assert PromptEncoder(text_encoder, tokenizer, "cpu").identity != identities["same files"]


# --- Prompt embedding cache ---------------------------------------------------------------------------------


class CountingEncoder:
    """An encoder whose embeddings are [len(prompt), 4] float32 (16 bytes per character)."""

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self.calls: list[str] = []

    def encode(self, prompt: str, *, max_tokens: int | None = None) -> torch.Tensor:
        self.calls.append(prompt)
        if max_tokens is not None and len(prompt) > max_tokens:
            raise PromptTooLongError(f"{len(prompt)} > {max_tokens}")
        return torch.full((len(prompt), 4), float(len(self.calls)))


def test_cache_hit_returns_the_stored_embedding_without_encoding():
    cache, encoder = PromptEmbeddingCache(capacity_bytes=1000), CountingEncoder("e")
    first = cache.get_or_encode(encoder, "abc")
    second = cache.get_or_encode(encoder, "abc")
    assert second is first and encoder.calls == ["abc"]
    assert cache.stats() == PromptCacheStats(hits=1, misses=1, evictions=0, entries=1, used_bytes=48,
                                             capacity_bytes=1000)


def test_cache_evicts_least_recently_used_to_stay_within_bytes():
    cache, encoder = PromptEmbeddingCache(capacity_bytes=2 * 48), CountingEncoder("e")
    for prompt in ("aaa", "bbb", "aaa", "ccc"):  # touching "aaa" leaves "bbb" least recently used
        cache.get_or_encode(encoder, prompt)
    assert cache.lookup(PromptKey("e", "bbb")) is None
    assert cache.lookup(PromptKey("e", "aaa")) is not None and cache.lookup(PromptKey("e", "ccc")) is not None
    assert cache.stats() == PromptCacheStats(hits=3, misses=4, evictions=1, entries=2, used_bytes=96,
                                             capacity_bytes=96)


def test_cache_keys_on_encoder_identity():
    cache = PromptEmbeddingCache(capacity_bytes=1000)
    first, second = CountingEncoder("one"), CountingEncoder("two")
    for encoder in (first, second, first, second):
        cache.get_or_encode(encoder, "abc")
    assert (first.calls, second.calls) == (["abc"], ["abc"])
    assert (cache.stats().misses, cache.stats().hits, cache.stats().entries) == (2, 2, 2)


def test_embedding_larger_than_the_capacity_is_returned_but_not_kept():
    cache = PromptEmbeddingCache(capacity_bytes=48)
    cache.get_or_encode(CountingEncoder("e"), "abc")
    assert cache.get_or_encode(CountingEncoder("e"), "abcd").shape == (4, 4)
    assert cache.stats() == PromptCacheStats(hits=0, misses=2, evictions=0, entries=1, used_bytes=48,
                                             capacity_bytes=48)


def test_cache_enforces_max_tokens_on_a_hit():
    cache, encoder = PromptEmbeddingCache(capacity_bytes=1000), CountingEncoder("e")
    cache.get_or_encode(encoder, "abcd")
    with pytest.raises(PromptTooLongError, match="4 tokens, more than the limit of 3"):
        cache.get_or_encode(encoder, "abcd", max_tokens=3)


def test_cache_holds_real_prompt_encoder_output(encoders):
    cache = PromptEmbeddingCache(capacity_bytes=1 << 20)
    embedding = cache.get_or_encode(encoders["native"], PROMPTS[0])
    assert cache.get_or_encode(encoders["native"], PROMPTS[0]) is embedding
    assert cache.get_or_encode(encoders["diffusers"], PROMPTS[0]) is not embedding  # other files, other encoder
    assert cache.stats().used_bytes == 2 * embedding.numel() * 2  # bfloat16


# --- Video decoding -----------------------------------------------------------------------------------------


def _reference_video_u8(vae: AutoencoderKLMiniMaxH3, latents: torch.Tensor) -> np.ndarray:
    """diffusers' video decode step, then the uint8 conversion of its PIL output (round(255 x))."""
    pipeline = MiniMaxH3VideoDecodeStep().init_pipeline()
    pipeline.update_components(vae=vae)
    frames = pipeline(latents=latents[None], output_type="np", output="videos")[0]
    return (frames * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def reference_vaes(roots) -> dict[torch.dtype, AutoencoderKLMiniMaxH3]:
    return {dtype: AutoencoderKLMiniMaxH3.from_pretrained(roots["diffusers"] / "vae", torch_dtype=dtype)
            for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def video_decoders(roots) -> dict[tuple[str, torch.dtype], VideoDecoder]:
    return {(layout, dtype): VideoDecoder(roots[layout] / VIDEO_VAE_DIR[layout], "cpu", dtype=dtype)
            for layout in LAYOUTS for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def reference_video(reference_vaes):
    """(latents, diffusers' frames) per (dtype, shape), decoded once: both layouts compare with the same oracle."""
    cases = {}

    def reference(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        if (dtype, shape) not in cases:
            latents = torch.randn(24, *shape, generator=torch.Generator().manual_seed(sum(shape)))
            cases[dtype, shape] = latents, _reference_video_u8(reference_vaes[dtype], latents)
        return cases[dtype, shape]
    return reference


# (latent frames, height, width): one clip; two clips over two spatial tiles (288 px > the 256 px tile);
# a count that is not 5n + 2 (the last clip padded and trimmed); the shortest the VAE decodes.
VIDEO_SHAPES = [(7, 2, 3), (12, 2, 18), (9, 3, 2), (3, 2, 2)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,shape", [(torch.float32, shape) for shape in VIDEO_SHAPES]
                         + [(torch.bfloat16, (12, 2, 18))])
def test_video_decode_equals_diffusers_decode_step(reference_video, video_decoders, layout, dtype, shape):
    latents, expected = reference_video(dtype, shape)
    frames = video_decoders[layout, dtype].decode(latents)
    assert frames.dtype == np.uint8 and frames.shape == expected.shape
    assert np.array_equal(frames, expected)
    assert np.unique(frames).size > 200  # not saturated: the comparison sees real pixel values


@pytest.mark.parametrize("num_latent_frames,clip_sizes", [(7, [22]), (12, [17, 22]), (17, [17, 17, 22]),
                                                          (9, [17, 13])])
def test_iter_clips_yields_17_frames_per_clip_and_the_tail_last(video_decoders, num_latent_frames, clip_sizes):
    decoder = video_decoders["diffusers", torch.float32]
    latents = torch.randn(24, num_latent_frames, 2, 2, generator=torch.Generator().manual_seed(0))
    clips = list(decoder.iter_clips(latents))
    assert [clip.shape[0] for clip in clips] == clip_sizes
    assert np.array_equal(np.concatenate(clips), decoder.decode(latents))


@pytest.mark.parametrize("shape", [(23, 7, 2, 2), (24, 7, 2), (24, 2, 2, 2)])
def test_video_latents_of_the_wrong_shape_are_refused(video_decoders, shape):
    with pytest.raises(LatentShapeError, match=r"video latents"):
        video_decoders["diffusers", torch.float32].iter_clips(torch.zeros(shape))


def test_directories_that_hold_no_video_or_audio_vae_are_refused(roots):
    with pytest.raises(DecoderLoadError, match="neither a diffusers AutoencoderKLMiniMaxH3 config nor a native"):
        VideoDecoder(roots["diffusers"] / "text_encoder", "cpu")
    with pytest.raises(DecoderLoadError, match="neither a diffusers AutoencoderKLMiniMaxH3Audio config nor a native"):
        AudioDecoder(roots["diffusers"] / "vae", "cpu")


def _drop_key(path: Path, key: str) -> None:
    config = json.loads(path.read_text())
    del config[key]
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("directory, breakage, cause", [
    pytest.param("video_vae", lambda d: _drop_key(d / "config.json", "latents_mean"), "KeyError: 'latents_mean'",
                 id="video-wrapper-without-latents-mean"),
    pytest.param("video_vae", lambda d: _cut_short(d / "source" / "model.safetensors"), "SafetensorError",
                 id="video-weights-cut-short"),
    pytest.param("audio_vae", lambda d: (d / "metadata.json").write_text("{"), "JSONDecodeError",
                 id="audio-metadata-not-json"),
    pytest.param("audio_vae", lambda d: _cut_short(d / "model.safetensors"), "SafetensorError",
                 id="audio-weights-cut-short"),
])
def test_an_unloadable_native_vae_is_a_load_error_naming_its_directory(roots, tmp_path, directory, breakage, cause):
    broken = Path(shutil.copytree(roots["native"] / directory, tmp_path / directory))
    breakage(broken)
    decoder = VideoDecoder if directory == "video_vae" else AudioDecoder
    with pytest.raises(DecoderLoadError, match=f"cannot load the VAE in {re.escape(str(broken))}: {cause}"):
        decoder(broken, "cpu")


def test_native_video_vae_asking_for_an_unported_feature_is_refused(roots, tmp_path):
    directory = Path(shutil.copytree(roots["native"] / "video_vae", tmp_path / "video_vae"))
    source_config = directory / "source" / "config.json"
    source_config.write_text(json.dumps(json.loads(source_config.read_text()) | {"use_vit_decoder": False}))
    with pytest.raises(DecoderLoadError, match="use_vit_decoder=False, but AutoencoderKLMiniMaxH3 implements only"):
        VideoDecoder(directory, "cpu")


# --- Audio decoding -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_audio_vae(roots) -> AutoencoderKLMiniMaxH3Audio:
    return AutoencoderKLMiniMaxH3Audio.from_pretrained(roots["diffusers"] / "audio_vae")


def _reference_audio(audio_vae: AutoencoderKLMiniMaxH3Audio, rows: torch.Tensor) -> torch.Tensor:
    """diffusers' after-denoise unpacking (channel-major rows -> two mono batch items), then its decode step."""
    video_rows = torch.zeros(2, 24 * 4)  # one 1x2x2 latent frame of video rows, only there to satisfy the step
    unpack = MiniMaxH3AfterDenoiseStep().init_pipeline()
    audio_latents = unpack(latents=video_rows, audio_latents=rows, num_latent_frames=1, latent_height=2,
                           latent_width=4, num_audio_latents=rows.shape[0] // 2, output="audio_latents")
    decode = MiniMaxH3AudioDecodeStep().init_pipeline()
    decode.update_components(audio_vae=audio_vae)
    return decode(audio_latents=audio_latents, output="audio")[0]  # [2, samples]


@pytest.fixture(scope="module")
def audio_decoders(roots) -> dict[str, AudioDecoder]:
    return {layout: AudioDecoder(roots[layout] / "audio_vae", "cpu") for layout in LAYOUTS}


@pytest.fixture(scope="module")
def reference_audio(reference_audio_vae):
    """(rows, diffusers' waveform) per latent count, decoded once: both layouts compare with the same oracle."""
    cases = {}

    def reference(num_latents: int) -> tuple[torch.Tensor, np.ndarray]:
        if num_latents not in cases:
            rows = torch.randn(2 * num_latents, 32, generator=torch.Generator().manual_seed(num_latents))
            cases[num_latents] = rows, _reference_audio(reference_audio_vae, rows).numpy()
        return cases[num_latents]
    return reference


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_latents", [1, 40])
def test_audio_decode_equals_diffusers_decode_step(audio_decoders, reference_audio, layout, num_latents):
    decoder = audio_decoders[layout]
    rows, expected = reference_audio(num_latents)
    waveform = decoder.decode(rows)
    assert decoder.sample_rate == 32000
    assert waveform.dtype == np.float32 and waveform.shape == (2, num_latents * 800) == expected.shape
    assert np.array_equal(waveform, expected)
    assert not np.array_equal(waveform[0], waveform[1])


@pytest.mark.parametrize("shape", [(7, 32), (8, 31), (0, 32), (2, 4, 32)])
def test_audio_latents_of_the_wrong_shape_are_refused(audio_decoders, shape):
    with pytest.raises(LatentShapeError, match=r"audio latents must be \[2 \* num_latents, 32\]"):
        audio_decoders["diffusers"].decode(torch.zeros(shape))


# --- The VAEs' halves ----------------------------------------------------------------------------------------


def _held_bytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


def _top_modules(module: torch.nn.Module) -> set[str]:
    return {name.split(".")[0] for name, _ in module.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("vae", ["video", "audio"])
def test_each_half_of_a_vae_holds_its_own_parameters_and_no_others(roots, layout, vae):
    """A split app's prepare stage holds the encoder halves, its Decoder the decoder halves: neither holds a
    parameter of the other half, each holds the whole VAE's tensors of its own half, and the two add up to the
    whole VAE (no parameter lies outside both)."""
    load, directory, submodules = ((load_video_vae, VIDEO_VAE_DIR[layout], VIDEO_VAE_HALVES) if vae == "video"
                                   else (load_audio_vae, "audio_vae", AUDIO_VAE_HALVES))
    whole, encoder, decoder = (load(roots[layout] / directory, "cpu", halves)
                               for halves in (VaeHalves.BOTH, VaeHalves.ENCODER, VaeHalves.DECODER))
    assert _top_modules(encoder) == set(submodules[VaeHalves.ENCODER])
    assert _top_modules(decoder) == set(submodules[VaeHalves.DECODER])
    assert _top_modules(whole) == _top_modules(encoder) | _top_modules(decoder)
    assert 0 < _held_bytes(encoder) < _held_bytes(whole) and _held_bytes(encoder) + _held_bytes(decoder) == \
        _held_bytes(whole)
    state = whole.state_dict()
    for half in (encoder, decoder):
        held = half.state_dict()
        assert all(torch.equal(tensor, state[name]) and tensor.dtype == state[name].dtype
                   for name, tensor in held.items())


@pytest.mark.parametrize("layout", INNER_LOOP_LAYOUTS)
def test_the_encoder_halves_encode_as_the_whole_vaes_do(roots, layout):
    """Keyframes, a video reference and a soundtrack encode to the same bits through the encoder halves alone (a
    split app's prepare stage) as through the whole VAEs (a fused engine's, shared with its decoders)."""
    from tests.conditioning_support import random_image, random_video

    root = roots[layout]
    whole_visual = VisualConditionEncoder(VideoDecoder(root / VIDEO_VAE_DIR[layout], "cpu").vae)
    whole_audio = AudioConditionEncoder(AudioDecoder(root / "audio_vae", "cpu").vae)
    visual = VisualConditionEncoder.load(root / VIDEO_VAE_DIR[layout], "cpu")
    audio = AudioConditionEncoder.load(root / "audio_vae", "cpu")
    image, frames = random_image(48, 32, seed=1), random_video(22, 48, 32, seed=2)
    waveform = np.random.default_rng(3).uniform(-0.5, 0.5, size=(2, 1600)).astype(np.float32)  # 2 latents: the encoder is slow on a CPU
    assert torch.equal(visual.encode_image(image), whole_visual.encode_image(image))
    assert torch.equal(visual.encode_frames(frames), whole_visual.encode_frames(frames))
    assert torch.equal(audio.encode(waveform), whole_audio.encode(waveform))
    with pytest.raises(AttributeError, match="post_quant_conv"):  # the decoder half is not there to run
        visual.vae.decode(torch.zeros(1, 24, 3, 2, 2))
    with pytest.raises(AttributeError, match="decoder"):
        audio.vae.decode(torch.zeros(2, 32, 4))


@pytest.mark.parametrize("layout", INNER_LOOP_LAYOUTS)
def test_the_decoder_halves_decode_as_the_whole_vaes_do(roots, layout, video_decoders, audio_decoders):
    """A split app's Decoder (decoder halves alone) gives the whole VAEs' frames and waveform bit for bit."""
    video = VideoDecoder(roots[layout] / VIDEO_VAE_DIR[layout], "cpu", halves=VaeHalves.DECODER)
    audio = AudioDecoder(roots[layout] / "audio_vae", "cpu", halves=VaeHalves.DECODER)
    latents = torch.randn(24, 7, 2, 2, generator=torch.Generator().manual_seed(5))  # one clip
    rows = torch.randn(2 * 2, 32, generator=torch.Generator().manual_seed(6))  # BigVGAN is slow on a CPU
    assert np.array_equal(video.decode(latents), video_decoders[layout, torch.bfloat16].decode(latents))
    assert np.array_equal(audio.decode(rows), audio_decoders[layout].decode(rows))
    with pytest.raises(AttributeError, match="encoder"):  # the encoder half is not there to run
        video.vae.encode(torch.zeros(1, 3, 1, 32, 32))
    with pytest.raises(ValueError, match="runs the decoder half"):
        VideoDecoder(roots[layout] / VIDEO_VAE_DIR[layout], "cpu", halves=VaeHalves.ENCODER)


# --- MP4 and thumbnail --------------------------------------------------------------------------------------


def _gradient_frames(num_frames: int, height: int, width: int) -> np.ndarray:
    """Smooth frames (H.264 keeps them close): red ramps down the rows, green across, blue with time."""
    rows = np.linspace(0, 255, height)[None, :, None]
    columns = np.linspace(0, 255, width)[None, None, :]
    time = np.linspace(0, 255, num_frames)[:, None, None]
    channels = [rows + 0 * columns + 0 * time, columns + 0 * rows + 0 * time, time + 0 * rows + 0 * columns]
    return np.stack(channels, axis=-1).round().astype(np.uint8)


def _tone(num_channels: int, num_samples: int, sample_rate: int) -> np.ndarray:
    seconds = np.arange(num_samples) / sample_rate
    return np.stack([0.3 * np.sin(2 * np.pi * (220 + 110 * c) * seconds) for c in range(num_channels)]).astype(
        np.float32)


@pytest.mark.parametrize("destination", ["path", "stream"])
@pytest.mark.parametrize("height,width", [(32, 48), (33, 47)])
@pytest.mark.parametrize("audio_channels", [2, 1, None])
def test_mp4_round_trip(tmp_path, destination, height, width, audio_channels):
    fps, sample_rate, num_frames = 24, 32000, 30
    frames = _gradient_frames(num_frames, height, width)
    audio = None if audio_channels is None else _tone(audio_channels, num_frames * sample_rate // fps, sample_rate)
    if destination == "path":
        target = tmp_path / "out.mp4"
        write_mp4(target, frames, fps, audio, sample_rate)
        source = target
    else:
        buffer = io.BytesIO()
        write_mp4(buffer, frames, fps, audio, sample_rate)
        source = io.BytesIO(buffer.getvalue())
    with av.open(source) as container:
        assert [s.codec_context.name for s in container.streams.video] == ["h264"]
        video = container.streams.video[0]
        assert (video.width, video.height) == (width + width % 2, height + height % 2)
        assert video.codec_context.pix_fmt == "yuv420p"
        assert abs(float(video.duration * video.time_base) - num_frames / fps) <= 1 / fps
        if audio_channels is None:
            assert len(container.streams.audio) == 0
        else:
            sound = container.streams.audio[0]
            assert (sound.codec_context.name, sound.channels, sound.sample_rate) == ("aac", 2, sample_rate)
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(decoded) == num_frames
    difference = np.abs(decoded[-1][:height, :width].astype(int) - frames[-1].astype(int))
    assert difference.mean() < 3  # the right picture, in RGB order, right way up


def test_mp4_audio_channels_survive_the_round_trip(tmp_path):
    sample_rate = 32000
    audio = _tone(2, sample_rate, sample_rate)
    audio[1] = 0.0  # silent right channel
    write_mp4(tmp_path / "out.mp4", _gradient_frames(24, 32, 32), 24, audio, sample_rate)
    with av.open(tmp_path / "out.mp4") as container:
        decoded = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)  # fltp [2, samples]
    assert np.abs(decoded[0]).max() > 0.2 and np.abs(decoded[1]).max() < 0.01


def _textured_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Moving waves under seeded noise: texture and motion make x264's rate control work on every frame."""
    time = np.arange(num_frames)[:, None, None]
    rows, columns = np.arange(height)[None, :, None], np.arange(width)[None, None, :]
    waves = 128 + 60 * np.sin(columns / 7 + time / 5) + 40 * np.cos(rows / 5 - time / 3)
    noise = np.random.default_rng(seed).normal(0, 8, (num_frames, height, width, 3))
    return np.clip(waves[..., None] + noise, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("audio_channels", [2, None])
def test_same_frames_and_waveform_give_the_same_mp4_bytes(audio_channels):
    # 30 writes: libx264's macroblock-tree rate control gave 5-19 distinct files in 30 on this clip (even with
    # one encoder thread), so a nondeterministic mux fails here with near certainty.
    fps, sample_rate, num_frames = 24, 32000, 49
    frames = _textured_frames(num_frames, 64, 64)
    audio = None if audio_channels is None else _tone(audio_channels, num_frames * sample_rate // fps, sample_rate)
    written = set()
    for _ in range(30):
        buffer = io.BytesIO()
        write_mp4(buffer, frames, fps, audio, sample_rate)
        written.add(buffer.getvalue())
    assert len(written) == 1


def test_an_mp4_written_to_a_path_is_the_same_on_every_write(tmp_path):
    frames = _textured_frames(49, 64, 64)
    for i in range(10):
        write_mp4(tmp_path / f"{i}.mp4", frames, 24, _tone(2, 49 * 32000 // 24, 32000), 32000)
    assert len({(tmp_path / f"{i}.mp4").read_bytes() for i in range(10)}) == 1


@pytest.mark.parametrize("frames,fps,audio,message", [
    (np.zeros((2, 8, 8, 3), np.float32), 24, None, "frames must be uint8"),
    (np.zeros((2, 8, 8), np.uint8), 24, None, "frames must be uint8"),
    (np.zeros((0, 8, 8, 3), np.uint8), 24, None, "every size >= 1"),
    (np.zeros((2, 8, 8, 3), np.uint8), 0, None, "fps must be a positive integer"),
    (np.zeros((2, 8, 8, 3), np.uint8), 24, np.zeros((3, 100), np.float32), "audio must be float32"),
    (np.zeros((2, 8, 8, 3), np.uint8), 24, np.zeros((2, 100), np.float64), "audio must be float32"),
    (np.zeros((2, 8, 8, 3), np.uint8), 24, np.full((2, 100), np.nan, np.float32), "audio holds NaN or inf"),
    (np.zeros((2, 8, 8, 3), np.uint8), 24, np.full((1, 100), np.inf, np.float32), "audio holds NaN or inf"),
])
def test_mp4_refuses_bad_input(frames, fps, audio, message):
    with pytest.raises(MediaInputError, match=message):
        write_mp4(io.BytesIO(), frames, fps, audio, 32000)


def test_thumbnail_png_is_the_frame_losslessly():
    frame = _gradient_frames(1, 33, 47)[0]
    png = thumbnail_png(frame)
    assert png.startswith(b"\x89PNG")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), frame)
    with pytest.raises(MediaInputError, match=r"uint8 \[height, width, 3\]"):
        thumbnail_png(frame[..., :2])
