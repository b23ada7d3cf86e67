"""`model.weights.TransformerWeights` refuses malformed files when it opens them (headers are parsed before any
tensor is read), naming the file and the tensors it holds: corrupt or oversized shard headers, header offsets that
disagree with a tensor's shape, a config.json that is not a transformer config, no index at all. Complements
test_h3_checkpoint.py (missing, unexpected, mis-shaped and truncated tensors, found by `validate`)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from model.layout import CheckpointError, H3Checkpoint, Layout
from model.weights import INDEX_FILE, SINGLE_FILE, TransformerWeights
from tests.adaln_support import Models, open_weights

#: A tensor of the block-1 shard in each layout (stored name).
BLOCK1_TENSOR = {Layout.DIFFUSERS: "transformer_blocks.1.norm1.weight", Layout.NATIVE: "blocks.1.norm1.weight"}


@pytest.fixture(params=list(Layout), ids=lambda layout: layout.value)
def copy(request, tmp_path) -> tuple[Path, Layout]:
    """A private copy of the seed-0 tiny checkpoint in each layout, safe to corrupt."""
    models: Models = request.getfixturevalue("tiny" if request.param is Layout.DIFFUSERS else "tiny_native")
    return Path(shutil.copytree(models.path, tmp_path / "tiny")), request.param


def shard_holding(root: Path, stored: str) -> Path:
    transformer_dir = H3Checkpoint.open(root).transformer_dir
    index = json.loads(next(transformer_dir.glob("*.index.json")).read_text())
    return transformer_dir / index["weight_map"][stored]


def header_of(shard: Path) -> tuple[int, dict]:
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8:8 + n])


def test_garbage_header_is_refused_naming_the_shard_and_its_tensors(copy):
    root, layout = copy
    shard = shard_holding(root, BLOCK1_TENSOR[layout])
    data = bytearray(shard.read_bytes())
    data[8:16] = b"#garbage"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"corrupt header in {shard}: .* \(holds '.*' and \d+ more\)$") as info:
        open_weights(root)
    index = json.loads(next(shard.parent.glob("*.index.json")).read_text())["weight_map"]
    named = re.findall(r"'([^']+)'", str(info.value).rpartition("(holds ")[2])
    assert len(named) == 3 and all(index[name] == shard.name for name in named)  # tensors of that shard


def test_header_length_past_the_end_of_the_file_is_refused(copy):
    root, layout = copy
    shard = shard_holding(root, BLOCK1_TENSOR[layout])
    data = bytearray(shard.read_bytes())
    data[0:8] = (len(data) * 2).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"corrupt header in {shard}: header length {2 * len(data)} does not "
                                              rf"fit the {len(data)}-byte file"):
        open_weights(root)


def test_header_offsets_that_disagree_with_the_shape_are_refused(copy):
    root, layout = copy
    stored = BLOCK1_TENSOR[layout]
    shard = shard_holding(root, stored)
    n, header = header_of(shard)
    header[stored]["shape"] = [3]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))  # same length, so offsets stay valid for every other tensor
    data = shard.read_bytes()
    shard.write_bytes(data[:8] + raw[:n] + data[8 + n:])
    with pytest.raises(CheckpointError, match=rf"corrupt header in {shard}: tensor '{stored}' offsets \d+\.\.\d+ do "
                                              r"not match shape \[3\] BF16"):
        open_weights(root)


def test_overlapping_tensors_in_a_header_are_refused(copy):
    root, layout = copy
    stored = BLOCK1_TENSOR[layout]
    shard = shard_holding(root, stored)
    n, header = header_of(shard)
    begin, end = header[stored]["data_offsets"]
    other = next(name for name, info in header.items() if name not in ("__metadata__", stored)
                 and info["data_offsets"][1] - info["data_offsets"][0] == end - begin)
    header[other]["data_offsets"] = [begin, end]  # two tensors on the same bytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    data = shard.read_bytes()
    shard.write_bytes(data[:8] + raw[:n] + data[8 + n:])
    with pytest.raises(CheckpointError, match=rf"corrupt header in {shard}: tensor '.*' starts at \d+, expected \d+"):
        open_weights(root)


@pytest.mark.parametrize("contents", ['{"hidden_size": "wide"}', "not json", "[1, 2]"])
def test_a_config_that_is_not_a_transformer_config_is_refused(copy, contents):
    root, _ = copy
    config = H3Checkpoint.open(root).transformer_dir / "config.json"
    config.write_text(contents)
    with pytest.raises(CheckpointError, match=rf"{config} is not a valid (MiniMax-H3 transformer )?config"):
        open_weights(root)


def test_a_transformer_directory_without_an_index_is_refused(copy):
    root, layout = copy
    transformer_dir = H3Checkpoint.open(root).transformer_dir
    (transformer_dir / INDEX_FILE[layout]).unlink()
    with pytest.raises(CheckpointError, match=rf"{transformer_dir} has neither {INDEX_FILE[layout]} nor "
                                              rf"{SINGLE_FILE[layout]} \(not a {layout.value}-layout transformer\?\)"):
        TransformerWeights(transformer_dir, layout)


@pytest.mark.parametrize("field,stored_native,value", [
    ("in_channels", "latents_dim", 16), ("audio_in_channels", "audio_latents_dim", 8),
    ("patch_size", "patch_size", [1, 4, 4]),
])
def test_a_transformer_whose_latent_widths_differ_from_the_vaes_is_refused_at_open(copy, field, stored_native, value):
    # A denoiser-only process holds no VAE to disagree with: without this check it accepted the checkpoint and
    # failed every request with "mat1 and mat2 shapes cannot be multiplied".
    root, layout = copy
    config = H3Checkpoint.open(root).transformer_dir / "config.json"
    data = json.loads(config.read_text())
    data[stored_native if layout is Layout.NATIVE else field] = value
    config.write_text(json.dumps(data))
    shown = re.escape(str(tuple(value) if isinstance(value, list) else value))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(config))}: {field} is {shown}.*latent"):
        open_weights(root)
