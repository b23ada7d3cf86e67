"""The MiniMax-H3 checkpoint layouts: detection, name/layout mapping, loading, byte locations, validation,
fingerprints, and the tiny checkpoint writer. Everything runs on the tiny seeded transformer (model.tiny)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel, ModularPipeline
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import model.tiny as tiny
from model.layout import CheckpointError, H3Checkpoint, Layout, Partition
from model.loading import load_transformer
from model.tiny import TINY_TRANSFORMER, make_tiny_checkpoint
from model.weights import (H3TransformerConfig, TransformerWeights, adaln_unit_names, is_adaln_param,
                           parameter_specs)

LAYOUTS = [Layout.DIFFUSERS, Layout.NATIVE]
NUM_BLOCKS = TINY_TRANSFORMER.num_blocks
ADALN_NAMES = {f"transformer_blocks.{i}.adaln_proj.linear.{part}" for i in range(NUM_BLOCKS)
               for part in ("weight", "bias")} | {"norm_out.linear.weight", "norm_out.linear.bias"}
FP32_NAMES = {f"{module}.{part}" for module in ("proj_in", "audio_proj_in", "time_embedder.linear_1",
                                                 "time_embedder.linear_2", "proj_out", "audio_proj_out")
              for part in ("weight", "bias")}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[tuple[Layout, int], Path]:
    """Transformer-only tiny checkpoints: both layouts of seed 0, the diffusers layout of seed 1."""
    base = tmp_path_factory.mktemp("tiny")
    return {(layout, seed): make_tiny_checkpoint(base / f"{layout.value}-{seed}", layout, seed, components=False)
            for layout, seed in [(Layout.DIFFUSERS, 0), (Layout.NATIVE, 0), (Layout.DIFFUSERS, 1)]}


def weights_of(root: Path) -> TransformerWeights:
    checkpoint = H3Checkpoint.open(root)
    return TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)


@pytest.fixture(scope="module")
def loaded(made) -> dict[Layout, dict[str, torch.Tensor]]:
    return {layout: load_transformer(weights_of(made[layout, 0]), "cpu").state_dict() for layout in LAYOUTS}


def copy_of(made, layout: Layout, tmp_path: Path, seed: int = 0) -> Path:
    return Path(shutil.copytree(made[layout, seed], tmp_path / f"copy-{layout.value}"))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so that comparisons are exact for every dtype (NaN payloads included)."""
    return tensor.contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------------------------------------
# Layout detection
# ---------------------------------------------------------------------------------------------------------


def test_open_diffusers_root(made):
    root = made[Layout.DIFFUSERS, 0]
    checkpoint = H3Checkpoint.open(root)
    assert (checkpoint.layout, checkpoint.partition, checkpoint.tasks) == (Layout.DIFFUSERS, Partition.FL2VA,
                                                                           ("t2va", "fl2va"))
    assert checkpoint.root == root
    assert checkpoint.transformer_dir == root / "transformer"
    assert checkpoint.video_vae_dir == root / "vae"
    assert (checkpoint.text_encoder_dir, checkpoint.tokenizer_dir, checkpoint.processor_dir,
            checkpoint.audio_vae_dir) == (root / "text_encoder", root / "tokenizer", root / "processor",
                                          root / "audio_vae")
    # read from scheduler/ and audio_scheduler/ scheduler_config.json
    assert (checkpoint.video_shift, checkpoint.audio_shift) == (12.0, 3.0)


def test_open_native_partition_dir_and_native_root_agree(made):
    root = made[Layout.NATIVE, 0]
    from_root = H3Checkpoint.open(root)
    from_partition = H3Checkpoint.open(root / "FL2VA")
    assert from_root == from_partition
    assert (from_root.layout, from_root.partition, from_root.tasks) == (Layout.NATIVE, Partition.FL2VA,
                                                                        ("t2va", "fl2va"))
    assert from_root.root == root / "FL2VA"
    assert from_root.transformer_dir == root / "FL2VA" / "transformer"
    assert from_root.video_vae_dir == root / "FL2VA" / "video_vae"
    assert (from_root.video_shift, from_root.audio_shift) == (12.0, 3.0)  # from _minimax_h3.sigma_shift_scales


def test_open_native_ref2va_partition_by_name(made, tmp_path):
    ref = tmp_path / "root" / "Ref2VA"
    shutil.copytree(made[Layout.NATIVE, 0] / "FL2VA" / "transformer", ref / "transformer")
    (ref / "model_index.json").write_text(json.dumps({"_minimax_h3": {
        "partition": "ref2va", "tasks": ["ref2va"], "sigma_shift_scales": {"video": 6.0, "audio": 2.0}}}))
    checkpoint = H3Checkpoint.open(tmp_path / "root", "Ref2VA")
    assert (checkpoint.partition, checkpoint.tasks, checkpoint.video_shift, checkpoint.audio_shift) == \
        (Partition.REF2VA, ("ref2va",), 6.0, 2.0)
    with pytest.raises(CheckpointError, match=r"holds the partition\(s\) \['Ref2VA'\] but not FL2VA"):
        H3Checkpoint.open(tmp_path / "root")  # FL2VA is the default and is absent
    with pytest.raises(CheckpointError, match="is the Ref2VA partition, not the FL2VA one"):
        H3Checkpoint.open(ref, Partition.FL2VA)


def test_open_diffusers_ref_partition_uses_transformer_ref(made):
    with pytest.raises(CheckpointError, match=r"lacks component directories: transformer \(.*transformer_ref\)"):
        H3Checkpoint.open(made[Layout.DIFFUSERS, 0], "ref2va")


@pytest.mark.parametrize("contents", ["empty", "stray file", "model_index without markers"])
def test_open_garbage_dir_is_a_clear_error(tmp_path, contents):
    if contents == "stray file":
        (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    if contents == "model_index without markers":
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "SomethingElse"}))
    with pytest.raises(CheckpointError) as info:
        H3Checkpoint.open(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message and "is not a MiniMax-H3 checkpoint" in message
    assert "modular_model_index.json" in message and "FL2VA/" in message


def test_open_missing_path_and_missing_components(made, tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        H3Checkpoint.open(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"lacks component directories: text_encoder .*tokenizer .*video_vae"):
        H3Checkpoint.open(made[Layout.NATIVE, 0], require_components=True)  # transformer-only checkpoint
    root = copy_of(made, Layout.DIFFUSERS, tmp_path)
    (root / "transformer" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"transformer/config.json is missing"):
        H3Checkpoint.open(root)


# ---------------------------------------------------------------------------------------------------------
# Config and names
# ---------------------------------------------------------------------------------------------------------


def test_a_checkpoint_with_an_empty_component_directory_does_not_open_complete(tmp_path):
    root = make_tiny_checkpoint(tmp_path / "ck", "diffusers")
    for path in (root / "text_encoder").iterdir():
        path.unlink()
    H3Checkpoint.open(root)  # the transformer alone is still there
    with pytest.raises(CheckpointError, match=r"empty component directories: text_encoder"):
        H3Checkpoint.open(root, require_components=True)


def test_a_writer_that_skips_a_component_publishes_no_checkpoint(tmp_path, monkeypatch):
    """What a rank > 0 of a torch.distributed group does (transformers' save_pretrained writes nothing there): the
    tiny checkpoint it made is refused before it is renamed into place, so no replica can load an empty
    text_encoder/ that another process published."""
    import transformers

    monkeypatch.setattr(transformers.PreTrainedModel, "should_save_on_this_rank", lambda self, main: False)
    with pytest.raises(CheckpointError, match=r"empty component directories: text_encoder"):
        make_tiny_checkpoint(tmp_path / "ck", "diffusers")
    assert not (tmp_path / "ck").exists() and not list(tmp_path.iterdir())  # the temporary sibling removed too


@pytest.mark.parametrize("layout", LAYOUTS)
def test_config_reads_as_the_tiny_config_in_both_layouts(made, layout):
    config = weights_of(made[layout, 0]).config
    assert config == TINY_TRANSFORMER
    assert (config.num_blocks, config.adaln_width, config.final_adaln_width, config.patch_dim,
            config.torch_dtype) == (4, 1152, 128, 96, torch.bfloat16)


def test_released_config_widths():
    released = H3TransformerConfig()
    # the native config restates these two as adaln_out_features and final_adaln_out_features
    assert (released.adaln_width, released.final_adaln_width, released.patch_dim) == (96768, 10752, 96)
    specs = parameter_specs(released)
    assert len(specs) == 638
    assert sum(spec.dtype == torch.float32 for spec in specs.values()) == 12


def test_native_config_with_inconsistent_adaln_width_is_rejected(made, tmp_path):
    root = copy_of(made, Layout.NATIVE, tmp_path)
    config_path = root / "FL2VA" / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["adaln_out_features"] = 1000
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="adaln_out_features is 1000, but hidden_size 64 implies 1152"):
        weights_of(root)


def test_adaln_names():
    assert adaln_unit_names(2) == [("transformer_blocks.0.adaln_proj.linear", 0),
                                   ("transformer_blocks.1.adaln_proj.linear", 1), ("norm_out.linear", None)]
    assert {name for name in parameter_specs(TINY_TRANSFORMER) if is_adaln_param(name)} == ADALN_NAMES
    assert not is_adaln_param("norm_out.norm.weight")
    assert not is_adaln_param("transformer_blocks.0.adaln_proj.linear")


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------


def test_both_layouts_load_to_the_same_bits(loaded):
    diffusers_state, native_state = loaded[Layout.DIFFUSERS], loaded[Layout.NATIVE]
    assert list(diffusers_state) == list(native_state) == list(parameter_specs(TINY_TRANSFORMER))
    for name, tensor in diffusers_state.items():
        assert native_state[name].dtype == tensor.dtype, name
        assert torch.equal(bits(native_state[name]), bits(tensor)), name


def test_loaded_model_equals_diffusers_from_pretrained(made, loaded):
    reference = MiniMaxH3Transformer3DModel.from_pretrained(made[Layout.DIFFUSERS, 0], subfolder="transformer",
                                                            torch_dtype=torch.bfloat16)
    expected = reference.state_dict()
    assert list(expected) == list(loaded[Layout.DIFFUSERS])
    for layout in LAYOUTS:
        for name, tensor in loaded[layout].items():
            assert tensor.dtype == expected[name].dtype, name
            assert torch.equal(bits(tensor), bits(expected[name])), name
    model = load_transformer(weights_of(made[Layout.NATIVE, 0]), "cpu")
    assert torch.equal(model.rope.inv_freq, reference.rope.inv_freq)
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_native_mapping_agrees_with_diffusers_own_converter(made, loaded):
    """diffusers' single-file converter, told the shards are interleaved, maps the native tensors the same way."""
    transformer_dir = made[Layout.NATIVE, 0] / "FL2VA" / "transformer"
    native: dict[str, torch.Tensor] = {}
    for shard in sorted(transformer_dir.glob("model-*.safetensors")):
        native |= load_file(shard)
    assert "blocks.0.attn.qkv_proj.weight" in native and "rope.inv_freq" in native
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        native, config={"num_attention_heads": 2, "attention_head_dim": 32}, qkv_layout="interleaved")
    assert sorted(converted) == sorted(loaded[Layout.NATIVE])
    for name, tensor in converted.items():
        assert torch.equal(bits(tensor), bits(loaded[Layout.NATIVE][name])), name


def test_dtypes_are_as_published(loaded):
    for layout in LAYOUTS:
        fp32 = {name for name, tensor in loaded[layout].items() if tensor.dtype == torch.float32}
        bf16 = {name for name, tensor in loaded[layout].items() if tensor.dtype == torch.bfloat16}
        assert fp32 == FP32_NAMES
        assert len(bf16) == len(loaded[layout]) - len(FP32_NAMES)


def test_native_rope_inv_freq_must_match_the_config(made, tmp_path):
    root = copy_of(made, Layout.NATIVE, tmp_path)
    config_path = root / "FL2VA" / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = 500.0
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"rope.inv_freq in .* is \[1.0, 0.100000001\d*, .*\], but the "
                                              r"config's rope_theta=500.0 and rope_freq_dim=4 give"):
        load_transformer(weights_of(root), "cpu")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_skip_adaln_leaves_exactly_the_adaln_params_on_meta(made, layout):
    model = load_transformer(weights_of(made[layout, 0]), "cpu", skip=is_adaln_param)
    on_meta = {name for name, p in model.named_parameters() if p.is_meta}
    assert on_meta == ADALN_NAMES
    assert all(p.device.type == "cpu" for name, p in model.named_parameters() if name not in ADALN_NAMES)
    assert model.rope.inv_freq.device.type == "cpu"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_skipped_adaln_need_not_be_in_the_checkpoint(made, tmp_path, layout):
    root = copy_of(made, layout, tmp_path)
    remove_tensor(root, layout, "norm_out.linear.weight" if layout is Layout.DIFFUSERS
                  else "final_layer.adaln_proj.linear.weight")
    weights = weights_of(root)
    weights.validate(with_adaln=False)
    load_transformer(weights, "cpu", skip=is_adaln_param)
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_transformer(weights, "cpu")


# ---------------------------------------------------------------------------------------------------------
# Byte locations
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_location_bytes_read_by_hand_equal_tensor(made, layout):
    weights = weights_of(made[layout, 0])
    for name in sorted(ADALN_NAMES):
        loc = weights.location(name)
        with open(loc.path, "rb") as f:
            f.seek(loc.offset)
            raw = bytearray(f.read(loc.nbytes))
        by_hand = torch.frombuffer(raw, dtype=loc.dtype).reshape(loc.shape)
        assert (loc.dtype, loc.shape) == (torch.bfloat16, tuple(parameter_specs(TINY_TRANSFORMER)[name].shape))
        assert torch.equal(bits(by_hand), bits(weights.tensor(name))), name


def test_location_refuses_tensors_cut_from_another_layout(made):
    native = weights_of(made[Layout.NATIVE, 0])
    with pytest.raises(CheckpointError, match=r"'transformer_blocks.0.attn.to_q.weight' has no single byte range: "
                                              r"it is the per-head query rows of 'blocks.0.attn.qkv_proj.weight'"):
        native.location("transformer_blocks.0.attn.to_q.weight")
    with pytest.raises(CheckpointError, match="the halves swapped of 'blocks.1.mlp.fc1.weight'"):
        native.location("transformer_blocks.1.ff.net.0.proj.weight")
    # the diffusers layout stores every parameter verbatim
    diffusers = weights_of(made[Layout.DIFFUSERS, 0])
    assert diffusers.location("transformer_blocks.0.attn.to_q.weight").shape == (64, 64)
    with pytest.raises(CheckpointError, match="'rope.inv_freq' is not a parameter"):
        diffusers.location("rope.inv_freq")


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------


def shard_of(root: Path, layout: Layout, stored: str) -> Path:
    transformer_dir = H3Checkpoint.open(root).transformer_dir
    index = json.loads(next(transformer_dir.glob("*.index.json")).read_text())
    return transformer_dir / index["weight_map"][stored]


def rewrite_shard(shard: Path, stored: str, replacement: torch.Tensor | None) -> None:
    tensors = load_file(shard)
    if replacement is None:
        del tensors[stored]
    else:
        tensors[stored] = replacement
    with safe_open(shard, "pt") as f:
        metadata = f.metadata()
    save_file(tensors, shard, metadata=metadata)


def remove_tensor(root: Path, layout: Layout, stored: str) -> Path:
    """Delete `stored` from its shard and from the index; returns the shard."""
    shard = shard_of(root, layout, stored)
    rewrite_shard(shard, stored, None)
    index_path = next(shard.parent.glob("*.index.json"))
    index = json.loads(index_path.read_text())
    del index["weight_map"][stored]
    index_path.write_text(json.dumps(index))
    return shard


@pytest.mark.parametrize("layout,stored,wanted", [
    (Layout.DIFFUSERS, "transformer_blocks.1.ff.net.2.weight", ""),
    (Layout.NATIVE, "blocks.1.mlp.fc2.weight", " (for 'transformer_blocks.1.ff.net.2.weight')"),
])
def test_validate_names_a_wrong_shape_with_its_file(made, tmp_path, layout, stored, wanted):
    root = copy_of(made, layout, tmp_path)
    shard = shard_of(root, layout, stored)
    rewrite_shard(shard, stored, torch.zeros(64, 127, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError) as info:
        weights_of(root).validate()
    assert f"shape mismatch for tensor {stored!r}{wanted} in {shard}: [64, 127], expected [64, 128]" \
        in str(info.value)
    assert "(1 problem(s))" in str(info.value)


def test_validate_names_a_wrong_dtype(made, tmp_path):
    root = copy_of(made, Layout.DIFFUSERS, tmp_path)
    shard = shard_of(root, Layout.DIFFUSERS, "proj_in.weight")
    rewrite_shard(shard, "proj_in.weight", torch.zeros(64, 96, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=f"dtype mismatch for tensor 'proj_in.weight' in {shard}: "
                                              "torch.bfloat16, expected torch.float32"):
        weights_of(root).validate()


@pytest.mark.parametrize("layout,stored,wanted", [
    (Layout.DIFFUSERS, "transformer_blocks.2.attn.to_k.weight", ""),
    (Layout.NATIVE, "blocks.2.attn.qkv_proj.weight", " (for 'transformer_blocks.2.attn.to_q.weight', "
                                                      "'transformer_blocks.2.attn.to_k.weight', "
                                                      "'transformer_blocks.2.attn.to_v.weight')"),
])
def test_validate_names_a_missing_tensor(made, tmp_path, layout, stored, wanted):
    root = copy_of(made, layout, tmp_path)
    shard = remove_tensor(root, layout, stored)
    with pytest.raises(CheckpointError) as info:
        weights_of(root).validate()
    index_path = next(shard.parent.glob("*.index.json"))
    assert f"missing tensor {stored!r}{wanted}: not in {index_path}" in str(info.value)


def test_validate_names_a_tensor_the_header_lacks(made, tmp_path):
    root = copy_of(made, Layout.DIFFUSERS, tmp_path)
    shard = shard_of(root, Layout.DIFFUSERS, "context_embedder.bias")
    rewrite_shard(shard, "context_embedder.bias", None)  # the index still maps it to this shard
    with pytest.raises(CheckpointError, match=f"missing tensor 'context_embedder.bias': the index maps it to "
                                              f"{shard}, whose header lacks it"):
        weights_of(root).validate()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_validate_names_a_truncated_shard_and_the_tensor_cut_off(made, tmp_path, layout):
    root = copy_of(made, layout, tmp_path)
    shard = weights_of(root).location("transformer_blocks.3.adaln_proj.linear.weight").path
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    header_bytes = int.from_bytes(shard.read_bytes()[:8], "little")
    header = json.loads(shard.read_bytes()[8:8 + header_bytes])
    last = max((name for name in header if name != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    with pytest.raises(CheckpointError) as info:
        weights_of(root).validate()
    assert f"truncated shard {shard}: {size - 100} bytes, its header needs {size}; " \
           f"tensors cut off: {last!r}" in str(info.value)


def test_tensor_read_from_a_truncated_shard_raises(made, tmp_path):
    root = copy_of(made, Layout.DIFFUSERS, tmp_path)
    loc = weights_of(root).location("norm_out.linear.weight")
    with open(loc.path, "r+b") as f:
        f.truncate(loc.offset + 10)
    with pytest.raises(CheckpointError, match=f"truncated shard {loc.path}: tensor 'norm_out.linear.weight'"):
        weights_of(root).tensor("norm_out.linear.weight")


def test_validate_checks_the_expected_config(made):
    weights = weights_of(made[Layout.NATIVE, 0])
    weights.validate(expect=TINY_TRANSFORMER)
    expect = TINY_TRANSFORMER.model_copy(update={"num_layers": 5})
    with pytest.raises(CheckpointError, match=r"config mismatch in .*config.json: num_layers=4 \(expected 5\)"):
        weights.validate(expect=expect)


def test_validate_names_an_unexpected_tensor(made, tmp_path):
    root = copy_of(made, Layout.DIFFUSERS, tmp_path)
    shard = shard_of(root, Layout.DIFFUSERS, "proj_in.bias")
    rewrite_shard(shard, "extra.weight", torch.zeros(3))
    with pytest.raises(CheckpointError, match=f"unexpected tensor 'extra.weight' in {shard}: its header has it"):
        weights_of(root).validate()


def test_missing_shard_is_named_at_open(made, tmp_path):
    root = copy_of(made, Layout.NATIVE, tmp_path)
    shard = shard_of(root, Layout.NATIVE, "blocks.3.norm1.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} \\(holds .*'blocks.3.*\\) is missing"):
        weights_of(root)


# ---------------------------------------------------------------------------------------------------------
# Fingerprints and the tiny writer
# ---------------------------------------------------------------------------------------------------------


def test_fingerprints_differ_between_seeds_and_match_between_copies(made, tmp_path):
    seed0 = weights_of(made[Layout.DIFFUSERS, 0]).fingerprint
    seed1 = weights_of(made[Layout.DIFFUSERS, 1]).fingerprint
    copy = weights_of(copy_of(made, Layout.DIFFUSERS, tmp_path)).fingerprint
    native = weights_of(made[Layout.NATIVE, 0]).fingerprint
    assert len(seed0) == 16 and int(seed0, 16) >= 0
    assert seed0 != seed1
    assert seed0 == copy
    assert native not in (seed0, seed1)


def test_same_seed_writes_the_same_bytes(made, tmp_path):
    for layout in LAYOUTS:
        again = make_tiny_checkpoint(tmp_path / layout.value, layout, 0, components=False)
        files = sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(made[layout, 0]) for p in made[layout, 0].rglob("*") if p.is_file())
        for relative in files:
            assert (again / relative).read_bytes() == (made[layout, 0] / relative).read_bytes(), relative


def test_diffusers_transformer_is_sharded_with_an_index(made):
    transformer_dir = made[Layout.DIFFUSERS, 0] / "transformer"
    index = json.loads((transformer_dir / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert shards == sorted(p.name for p in transformer_dir.glob("diffusion_pytorch_model-*-of-*.safetensors"))


def test_diffusers_root_loads_in_the_modular_pipeline(made, loaded):
    pipe = ModularPipeline.from_pretrained(made[Layout.DIFFUSERS, 0], workflow="t2va")
    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline"
    pipe.load_components(names=["transformer", "scheduler", "audio_scheduler"], dtype=torch.bfloat16)
    assert (pipe.scheduler.shift, pipe.audio_scheduler.shift) == (12.0, 3.0)
    for name, tensor in pipe.transformer.state_dict().items():
        assert torch.equal(bits(tensor), bits(loaded[Layout.DIFFUSERS][name])), name


def test_make_refuses_a_nonempty_target_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="taken already exists"):
        make_tiny_checkpoint(tmp_path / "taken", Layout.NATIVE, components=False)

    def fail(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "_write_native", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        make_tiny_checkpoint(tmp_path / "new", Layout.NATIVE, components=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_cli_writes_a_checkpoint(tmp_path, capsys):
    assert tiny.main(["--layout", "native", "--out", str(tmp_path / "cli"), "--seed", "3",
                      "--transformer-only"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert H3Checkpoint.open(tmp_path / "cli").layout is Layout.NATIVE
    weights_of(tmp_path / "cli").validate(expect=TINY_TRANSFORMER)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_complete_checkpoint_has_every_component(tmp_path, layout):
    root = make_tiny_checkpoint(tmp_path / "full", layout, seed=0)
    checkpoint = H3Checkpoint.open(root, require_components=True)
    for name, directory in checkpoint.component_dirs.items():
        assert any(directory.iterdir()), name
    assert weights_of(root).fingerprint == weights_of(make_tiny_checkpoint(
        tmp_path / "transformer-only", layout, seed=0, components=False)).fingerprint


def test_load_to_cuda_matches_cpu(made, loaded):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = load_transformer(weights_of(made[Layout.NATIVE, 0]), "cuda")
    assert model.rope.inv_freq.is_cuda
    for name, tensor in model.state_dict().items():
        assert tensor.is_cuda and torch.equal(bits(tensor.cpu()), bits(loaded[Layout.DIFFUSERS][name])), name
