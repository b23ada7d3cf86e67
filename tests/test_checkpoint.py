"""Sharded safetensors checkpoints: seeded writer, lazy reader, validation of every corruption we can detect."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model.checkpoint import (
    INDEX_FILE, CheckpointError, CheckpointReader, load_model, main, make_checkpoint, shard_name,
)
from model.config import preset
from model.dit import DiT, is_adaln_proj, is_adaln_rebuild_input

BLOCK0 = "model-00002-of-00003.safetensors"  # tiny_config has 2 blocks: rest, blocks.0, blocks.1


def index(ckpt: Path) -> dict:
    return json.loads((ckpt / INDEX_FILE).read_text())


def rewrite_shard(ckpt: Path, fname: str, edit) -> None:
    """Rewrite a shard with safetensors after `edit(tensors)` and point the index at its new key set."""
    tensors = load_file(ckpt / fname)
    edit(tensors)
    save_file(tensors, ckpt / fname, metadata={"format": "pt"})
    idx = index(ckpt)
    idx["weight_map"] = {n: f for n, f in idx["weight_map"].items() if f != fname} | {n: fname for n in tensors}
    (ckpt / INDEX_FILE).write_text(json.dumps(idx))


def assert_rejected(ckpt: Path, *fragments: str, **validate_kwargs) -> None:
    """Reading or validating fails with one CheckpointError whose message holds every fragment."""
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(ckpt).validate(**validate_kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in:\n{info.value}"
    if not validate_kwargs:
        with pytest.raises(CheckpointError):
            load_model(ckpt)


# --- layout and round trip ----------------------------------------------------------------------------------


def test_layout_is_one_shard_per_block_plus_one_for_the_rest(tiny_checkpoint, tiny_config):
    idx = index(tiny_checkpoint)
    files = sorted(p.name for p in tiny_checkpoint.glob("*.safetensors"))
    assert files == [shard_name(k, 3) for k in range(3)]
    for name, fname in idx["weight_map"].items():
        expected = BLOCK0 if name.startswith("blocks.0.") else "model-00003-of-00003.safetensors" \
            if name.startswith("blocks.1.") else "model-00001-of-00003.safetensors"
        assert fname == expected, name
    sizes = {n: loc.nbytes for n in idx["weight_map"] for loc in [CheckpointReader(tiny_checkpoint).location(n)]}
    assert idx["metadata"]["total_size"] == sum(sizes.values())
    assert CheckpointReader(tiny_checkpoint).config == tiny_config


def test_load_model_holds_exactly_the_seeded_parameters(tiny_checkpoint, tiny_model):
    loaded = load_model(tiny_checkpoint)
    expected = tiny_model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert not any(p.requires_grad for p in loaded.parameters())


def test_same_seed_writes_identical_files_and_other_seed_does_not(tmp_path, tiny_config, tiny_checkpoint):
    again = make_checkpoint(tmp_path / "again", tiny_config, seed=0)
    other = make_checkpoint(tmp_path / "other", tiny_config, seed=1)
    for path in sorted(tiny_checkpoint.iterdir()):
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    assert (other / BLOCK0).read_bytes() != (tiny_checkpoint / BLOCK0).read_bytes()
    assert CheckpointReader(again).fingerprint == CheckpointReader(tiny_checkpoint).fingerprint
    assert CheckpointReader(other).fingerprint != CheckpointReader(tiny_checkpoint).fingerprint


def test_location_is_the_absolute_byte_range_of_the_tensor(tiny_checkpoint):
    reader = CheckpointReader(tiny_checkpoint)
    name = "blocks.1.adaln_proj.weight"
    loc = reader.location(name)
    with open(loc.path, "rb") as f:
        raw = os.pread(f.fileno(), loc.nbytes, loc.offset)
    tensor = reader.tensor(name)
    assert (loc.dtype, loc.shape) == (tensor.dtype, tuple(tensor.shape))
    assert raw == tensor.view(-1).view(torch.uint8).numpy().tobytes()


def test_shards_are_plain_safetensors(tiny_checkpoint):
    reader = CheckpointReader(tiny_checkpoint)
    with safe_open(tiny_checkpoint / BLOCK0, "pt") as f:
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), reader.tensor(name))


def test_load_without_adaln_reads_no_adaln_tensors(tiny_checkpoint, tiny_config):
    for fname in {f for n, f in index(tiny_checkpoint)["weight_map"].items() if is_adaln_proj(n)}:
        rewrite_shard(tiny_checkpoint, fname, lambda t: [t.pop(n) for n in list(t) if is_adaln_proj(n)])
    model = load_model(tiny_checkpoint, with_adaln=False)
    assert not any(is_adaln_proj(n) for n in model.state_dict())
    assert_rejected(tiny_checkpoint, "missing tensor 'blocks.0.adaln_proj.weight'", BLOCK0)


def test_adaln_only_checkpoint_holds_exactly_the_rebuild_inputs(tmp_path, tiny_config, tiny_checkpoint):
    only = make_checkpoint(tmp_path / "adaln", tiny_config, seed=0, only="adaln")
    reader, full = CheckpointReader(only), CheckpointReader(tiny_checkpoint)
    reader.validate(deep=True)
    assert set(reader.keys()) == {n for n in full.keys() if is_adaln_rebuild_input(n)}
    assert any(n.startswith("time_embed.") for n in reader.keys())
    for name in reader.keys():
        assert torch.equal(reader.tensor(name), full.tensor(name)), name
    with pytest.raises(CheckpointError, match="adaln"):
        load_model(only)


def test_cli_make_writes_a_checkpoint_that_validates(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["make", "--preset", "tiny", "--out", str(out), "--seed", "0", "--num-blocks", "1",
                 "--no-progress"]) == 0
    reader = CheckpointReader(out)
    assert reader.config == preset("tiny", num_blocks=1)
    assert main(["validate", str(out), "--deep"]) == 0
    (out / "model-00002-of-00002.safetensors").unlink()
    assert main(["validate", str(out)]) == 1
    assert "model-00002-of-00002.safetensors" in capsys.readouterr().err


def test_no_index_means_no_checkpoint(tiny_checkpoint):
    (tiny_checkpoint / INDEX_FILE).unlink()  # what an interrupted make leaves
    assert_rejected(tiny_checkpoint, INDEX_FILE)


# --- corruption ---------------------------------------------------------------------------------------------


def test_missing_tensor_is_rejected_naming_it_and_its_shard(tiny_checkpoint):
    rewrite_shard(tiny_checkpoint, BLOCK0, lambda t: t.pop("blocks.0.mlp.down.weight"))
    assert_rejected(tiny_checkpoint, "missing tensor 'blocks.0.mlp.down.weight'", BLOCK0)


def test_missing_shard_file_is_rejected_naming_it_and_its_tensors(tiny_checkpoint):
    (tiny_checkpoint / BLOCK0).unlink()
    assert_rejected(tiny_checkpoint, BLOCK0, "blocks.0.")


def test_unexpected_tensor_is_rejected_naming_it_and_its_shard(tiny_checkpoint):
    rewrite_shard(tiny_checkpoint, BLOCK0, lambda t: t.update({"blocks.0.extra.weight": torch.zeros(3)}))
    assert_rejected(tiny_checkpoint, "unexpected tensor 'blocks.0.extra.weight'", BLOCK0)


def test_tensor_in_a_shard_but_not_in_the_index_is_rejected(tiny_checkpoint):
    idx = index(tiny_checkpoint)
    del idx["weight_map"]["blocks.0.norm2.weight"]
    (tiny_checkpoint / INDEX_FILE).write_text(json.dumps(idx))
    assert_rejected(tiny_checkpoint, "'blocks.0.norm2.weight'", BLOCK0)


def test_wrong_shape_is_rejected_naming_tensor_and_shard(tiny_checkpoint):
    rewrite_shard(tiny_checkpoint, BLOCK0, lambda t: t.update({"blocks.0.attn.q.bias": torch.zeros(7, dtype=torch.bfloat16)}))
    assert_rejected(tiny_checkpoint, "shape mismatch for tensor 'blocks.0.attn.q.bias'", BLOCK0, "[7]")


def test_wrong_dtype_is_rejected_naming_tensor_and_shard(tiny_checkpoint):
    rewrite_shard(tiny_checkpoint, BLOCK0, lambda t: t.update({"blocks.0.norm1.weight": t["blocks.0.norm1.weight"].float()}))
    assert_rejected(tiny_checkpoint, "dtype mismatch for tensor 'blocks.0.norm1.weight'", BLOCK0, "float32")


def test_truncated_shard_is_rejected_naming_the_cut_tensor(tiny_checkpoint):
    path = tiny_checkpoint / BLOCK0
    with safe_open(path, "pt") as f:
        last = max(f.keys(), key=lambda n: CheckpointReader(tiny_checkpoint).location(n).offset)
    os.truncate(path, path.stat().st_size - 10)
    assert_rejected(tiny_checkpoint, "truncated shard", BLOCK0, repr(last))
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointReader(tiny_checkpoint).tensor(last)


def test_garbage_header_is_rejected_naming_shard_and_its_tensors(tiny_checkpoint):
    path = tiny_checkpoint / BLOCK0
    data = bytearray(path.read_bytes())
    data[8:16] = b"#garbage"
    path.write_bytes(bytes(data))
    assert_rejected(tiny_checkpoint, "corrupt header", BLOCK0, "'blocks.0.")


def test_header_length_past_end_of_file_is_rejected(tiny_checkpoint):
    path = tiny_checkpoint / BLOCK0
    data = bytearray(path.read_bytes())
    data[0:8] = (len(data) * 2).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    assert_rejected(tiny_checkpoint, "corrupt header", BLOCK0, "'blocks.0.")


def test_header_offsets_that_disagree_with_shape_are_rejected(tiny_checkpoint):
    path = tiny_checkpoint / BLOCK0
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["blocks.0.norm1.weight"]["shape"] = [3]
    raw = json.dumps(header).encode()
    raw += b" " * (n - len(raw))  # same length, so offsets stay valid for every other tensor
    path.write_bytes(data[:8] + raw[:n] + data[8 + n :])
    assert_rejected(tiny_checkpoint, "corrupt header", BLOCK0, "'blocks.0.norm1.weight'")


def test_config_mismatch_is_rejected_naming_the_field_and_config_json(tiny_checkpoint, tiny_config):
    assert_rejected(tiny_checkpoint, "config mismatch", "config.json", "num_blocks=2 (expected 3)",
                    expect=preset("tiny", num_blocks=3))
    CheckpointReader(tiny_checkpoint).validate(expect=tiny_config)  # the right config passes


def test_invalid_config_json_is_rejected(tiny_checkpoint):
    (tiny_checkpoint / "config.json").write_text('{"hidden": "wide"}')
    assert_rejected(tiny_checkpoint, "config.json")


def test_bit_flip_in_tensor_data_is_caught_only_by_deep_validation(tiny_checkpoint):
    reader = CheckpointReader(tiny_checkpoint)
    loc = reader.location("blocks.0.mlp.gate_up.weight")
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + loc.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    CheckpointReader(tiny_checkpoint).validate()  # shallow: cannot see data
    assert_rejected(tiny_checkpoint, "corrupt data for tensor 'blocks.0.mlp.gate_up.weight'", BLOCK0, deep=True)


def test_weights_from_another_seed_change_the_fingerprint_but_validate(tmp_path, tiny_config, tiny_checkpoint):
    other = make_checkpoint(tmp_path / "s7", tiny_config, seed=7)
    CheckpointReader(other).validate(expect=tiny_config, deep=True)
    assert CheckpointReader(other).fingerprint != CheckpointReader(tiny_checkpoint).fingerprint
    assert not torch.equal(load_model(other).blocks[0].attn.q.weight, DiT(tiny_config, seed=0).blocks[0].attn.q.weight)
