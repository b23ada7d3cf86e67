"""bench.checkpoints: random MiniMax-H3 checkpoints of the real architecture, written tensor by tensor.

Everything at the tiny width (the writer does not care about sizes); the h3 width is exercised on the GPU by
bench/h3.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from PIL import Image
from transformers import Qwen3VLConfig, Qwen3VLVisionConfig

from bench.checkpoints import (ADALN_INPUT_PREFIX, SMALL_COMPONENTS, RandomCheckpointError, checkpoint_nbytes,
                               make_random_checkpoint, random_transformer, write_canvas_rule, write_h3_components)
from model.canvas import CanvasRule
from model.decode import AudioDecoder, VideoDecoder
from model.layout import MODEL_INDEX, MODULAR_MODEL_INDEX, CheckpointError, H3Checkpoint, Layout, Partition
from model.loading import load_transformer
from model.packing import VIDEO_TAG
from model.presentation import keyframe_presentation
from model.text_encoder import PromptEncoder
from model.tiny import REF2VA_SEED_OFFSET, TINY_TRANSFORMER
from model.weights import INDEX_FILE, TransformerWeights, is_adaln_param, parameter_specs

NUM_BLOCKS = 3
CONFIG = TINY_TRANSFORMER.model_copy(update={"num_layers": NUM_BLOCKS})


def weights_of(root: Path) -> TransformerWeights:
    checkpoint = H3Checkpoint.open(root)
    return TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("random")
    return {
        "diffusers": make_random_checkpoint(base / "diffusers", TINY_TRANSFORMER, "diffusers", seed=5,
                                            num_blocks=NUM_BLOCKS, workers=3),
        "native": make_random_checkpoint(base / "native", TINY_TRANSFORMER, "native", seed=5, num_blocks=NUM_BLOCKS),
        "one-worker": make_random_checkpoint(base / "one-worker", TINY_TRANSFORMER, "diffusers", seed=5,
                                             num_blocks=NUM_BLOCKS, workers=1),
        "seed-6": make_random_checkpoint(base / "seed-6", TINY_TRANSFORMER, "diffusers", seed=6, num_blocks=NUM_BLOCKS),
        "adaln": make_random_checkpoint(base / "adaln", TINY_TRANSFORMER, "native", seed=5, num_blocks=NUM_BLOCKS,
                                        only="adaln"),
    }


@pytest.mark.parametrize("layout", ["diffusers", "native"])
def test_both_layouts_validate_and_load_to_the_in_memory_model(made, layout):
    weights = weights_of(made[layout])
    weights.validate(expect=CONFIG)
    loaded = load_transformer(weights, "cpu").state_dict()
    expected = random_transformer(CONFIG, seed=5).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(bits(loaded[name]), bits(tensor)), name


def test_one_shard_outside_the_blocks_then_one_per_block(made):
    weights = weights_of(made["diffusers"])
    index = json.loads((weights.transformer_dir / INDEX_FILE[Layout.DIFFUSERS]).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"diffusion_pytorch_model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]
    for i in range(NUM_BLOCKS):
        in_block = {f for n, f in index["weight_map"].items() if n.startswith(f"transformer_blocks.{i}.")}
        assert in_block == {shards[i + 1]}
    assert index["metadata"]["total_size"] == checkpoint_nbytes(CONFIG)


def test_bytes_depend_on_seed_only_not_on_parallel_writes(made):
    def shard_bytes(root: Path) -> list[bytes]:
        return [p.read_bytes() for p in sorted(weights_of(root).transformer_dir.glob("*.safetensors"))]

    assert shard_bytes(made["diffusers"]) == shard_bytes(made["one-worker"])
    assert weights_of(made["diffusers"]).fingerprint == weights_of(made["one-worker"]).fingerprint
    assert weights_of(made["diffusers"]).fingerprint != weights_of(made["seed-6"]).fingerprint


def test_adaln_only_holds_the_projections_and_their_input(made):
    weights = weights_of(made["adaln"])
    wanted = {n for n in parameter_specs(CONFIG) if is_adaln_param(n) or n.startswith(ADALN_INPUT_PREFIX)}
    stored = set(weights.weight_map)
    assert stored == {weights.source(n).name for n in wanted}
    assert len(wanted) == 2 * (NUM_BLOCKS + 1) + 4
    full = weights_of(made["native"])
    for name in sorted(wanted):
        assert torch.equal(bits(weights.tensor(name)), bits(full.tensor(name))), name
    with pytest.raises(CheckpointError, match="missing tensor"):
        weights.validate()


def test_published_dtypes(made):
    weights = weights_of(made["diffusers"])
    fp32 = {n for n in weights.names() if weights.location(n).dtype == torch.float32}
    assert len(fp32) == 12
    assert all(n.split(".")[0] in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out")
               for n in fp32)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_blocks": 0}, "num_blocks=0 must be >= 1"),
    ({"workers": 0}, "workers=0 must be >= 1"),
    ({"only": "blocks"}, "only='blocks'"),
])
def test_bad_arguments_name_the_value(tmp_path, kwargs, match):
    with pytest.raises(RandomCheckpointError, match=match):
        make_random_checkpoint(tmp_path / "x", TINY_TRANSFORMER, "diffusers", **kwargs)
    assert not (tmp_path / "x").exists()


def test_an_existing_checkpoint_is_never_overwritten(made):
    with pytest.raises(FileExistsError):
        make_random_checkpoint(made["diffusers"], TINY_TRANSFORMER, "diffusers")


#: The tiny checkpoint's audio VAE: what a native audio_vae/metadata.json can record.
NATIVE_SMALL = dataclasses.replace(SMALL_COMPONENTS, audio_vae={"encoder_dim": 4, "latent_dim": 64, "decoder_dim": 128})


@pytest.mark.parametrize("layout, sizes", [("diffusers", SMALL_COMPONENTS), ("native", NATIVE_SMALL)])
def test_components_load_with_the_engine_loaders(tmp_path, layout, sizes):
    root = make_random_checkpoint(tmp_path / layout, TINY_TRANSFORMER, layout, seed=0, num_blocks=1)
    param_bytes = write_h3_components(root, layout, 0, text_layers=3, sizes=sizes)
    assert set(param_bytes) == {"text_encoder", "video_vae", "audio_vae"}
    checkpoint = H3Checkpoint.open(root, require_components=True)
    # by default the one-block vision tower: text-only benches never run it
    assert Qwen3VLConfig.from_pretrained(checkpoint.text_encoder_dir).vision_config.depth == 1
    encoder = PromptEncoder(checkpoint.text_encoder_dir, checkpoint.tokenizer_dir, "cpu", hidden_state_index=2)
    assert encoder.num_loaded_layers == 2
    assert encoder.encode("a red fox").shape[1] == TINY_TRANSFORMER.text_dim
    frames = VideoDecoder(checkpoint.video_vae_dir, "cpu").decode(torch.zeros(24, 3, 2, 2))
    assert frames.shape == (9, 32, 32, 3)   # 3 latent frames, x4 in time: (3 - 1) * 4 + 1 frames of 2*16 px
    audio = AudioDecoder(checkpoint.audio_vae_dir, "cpu")
    assert audio.decode(torch.zeros(2 * 4, 32)).shape == (2, 4 * 800)


def test_native_components_refuse_audio_arguments_they_cannot_record(tmp_path):
    root = make_random_checkpoint(tmp_path / "native", TINY_TRANSFORMER, "native", seed=0, num_blocks=1)
    with pytest.raises(RandomCheckpointError, match="decoder_kernel_sizes"):
        write_h3_components(root, "native", 0, text_layers=3, sizes=SMALL_COMPONENTS)


# --- the Ref2VA partition ------------------------------------------------------------------------------------

def test_ref2va_adds_transformer_ref_another_model_of_the_same_architecture(made, tmp_path):
    root = make_random_checkpoint(tmp_path / "both", TINY_TRANSFORMER, "diffusers", seed=5, num_blocks=NUM_BLOCKS,
                                  ref2va=True)
    fl2va, ref2va = (H3Checkpoint.open(root, partition) for partition in Partition)
    assert (fl2va.transformer_dir.name, ref2va.transformer_dir.name) == ("transformer", "transformer_ref")
    # the FL2VA transformer is the one a checkpoint without the partition holds, byte for byte
    shards = sorted(p.name for p in fl2va.transformer_dir.iterdir())
    assert shards == sorted(p.name for p in weights_of(made["diffusers"]).transformer_dir.iterdir())
    assert all((fl2va.transformer_dir / name).read_bytes()
               == (weights_of(made["diffusers"]).transformer_dir / name).read_bytes() for name in shards)
    weights = TransformerWeights(ref2va.transformer_dir, ref2va.layout)
    weights.validate(expect=CONFIG)
    loaded = load_transformer(weights, "cpu").state_dict()
    expected = random_transformer(CONFIG, seed=5 + REF2VA_SEED_OFFSET).state_dict()
    assert all(torch.equal(bits(loaded[name]), bits(tensor)) for name, tensor in expected.items())
    assert weights.fingerprint != weights_of(made["diffusers"]).fingerprint
    # both model indexes list it as diffusers' pipeline loads it: same class, its own subfolder
    index = json.loads((root / MODEL_INDEX).read_text())
    modular = json.loads((root / MODULAR_MODEL_INDEX).read_text())
    assert index["transformer_ref"] == index["transformer"]
    assert modular["transformer_ref"][:2] == modular["transformer"][:2]
    assert modular["transformer_ref"][2]["subfolder"] == "transformer_ref"


def test_ref2va_in_the_native_layout_is_refused(tmp_path):
    with pytest.raises(RandomCheckpointError, match="ref2va=True writes the diffusers layout"):
        make_random_checkpoint(tmp_path / "x", TINY_TRANSFORMER, "native", ref2va=True)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("layout", ["diffusers", "native"])
def test_a_canvas_rule_written_is_the_one_the_checkpoint_states(tmp_path, layout):
    root = make_random_checkpoint(tmp_path / layout, TINY_TRANSFORMER, layout, seed=0, num_blocks=1)
    assert CanvasRule.of(H3Checkpoint.open(root)) == CanvasRule()  # none written: the release's
    rule = CanvasRule(short_edge=32, max_pixels=32 * 64, reference_image_short_edge=64)
    write_canvas_rule(root, layout, rule)
    assert CanvasRule.of(H3Checkpoint.open(root)) == rule


# --- the released vision tower -------------------------------------------------------------------------------

@pytest.mark.slow
def test_released_vision_is_qwen3_vl_32b_tower_and_processors(tmp_path):
    """Qwen3-VL-32B's tower (transformers' Qwen3VLVisionConfig defaults) projecting to the text width, and the
    release's processor pixel bounds: the engine's encoder loads it and a small keyframe is upscaled to 64k pixels."""
    root = make_random_checkpoint(tmp_path / "vision", TINY_TRANSFORMER, "diffusers", seed=0, num_blocks=1)
    write_h3_components(root, "diffusers", 0, text_layers=3, sizes=SMALL_COMPONENTS, vision="released")
    checkpoint = H3Checkpoint.open(root, require_components=True)
    tower = Qwen3VLConfig.from_pretrained(checkpoint.text_encoder_dir).vision_config.to_dict()
    released = Qwen3VLVisionConfig().to_dict()
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size",
                "temporal_patch_size", "num_position_embeddings", "deepstack_visual_indexes", "hidden_act"):
        assert tower[key] == released[key], key
    assert tower["out_hidden_size"] == SMALL_COMPONENTS.text["hidden_size"]
    encoder = PromptEncoder(checkpoint.text_encoder_dir, checkpoint.tokenizer_dir, "cpu", hidden_state_index=2,
                            vision=True, processor_dir=checkpoint.processor_dir)
    assert encoder.image_processor.patch_size == 16 and encoder.image_processor.merge_size == 2
    video = encoder.video_processor.config
    assert (video.patch_size, video.merge_size, video.min_pixels, video.max_pixels) == (16, 2, 4096, 25165824)
    presentation = keyframe_presentation(encoder.tokenizer, encoder.image_processor, "a red fox",
                                         (Image.new("RGB", (64, 64), (200, 80, 40)),))
    assert presentation.image_grid_thw.tolist() == [[1, 16, 16]]  # 64x64 -> 256x256: the 65536-pixel minimum
    assert int((presentation.token_tags == VIDEO_TAG).sum()) == 16 * 16 // 4 + 2  # merged patches + start, end
    embeds = encoder.encode_presentation(presentation)
    assert embeds.shape == (presentation.num_tokens, SMALL_COMPONENTS.text["hidden_size"])
