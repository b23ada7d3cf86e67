"""Checkpoints for weight-update tests (no tests here): a fine-tune of a tiny checkpoint, and one that must be refused.

A weight update loads the transformer only (the text encoder and VAEs stay), so the checkpoint an updated engine
serves exactly is the old one with a new transformer: `finetune_of`. `with_wrong_shape` copies a checkpoint and
gives one transformer tensor an extra row, which the update's check must refuse before writing anything.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.layout import H3Checkpoint
from model.tiny import make_tiny_checkpoint
from model.weights import TransformerWeights

#: The tensor `with_wrong_shape` changes: [64, 64] in the tiny transformer, [65, 64] in the copy.
WRONG_SHAPE_TENSOR = "transformer_blocks.2.attn.to_q.weight"


def finetune_of(checkpoint: Path, out: Path, seed: int = 1) -> Path:
    """A copy of the complete diffusers-layout `checkpoint` at `out` whose transformer is the seed-`seed` tiny one."""
    transformer_only = make_tiny_checkpoint(out.with_name(f".{out.name}-transformer"), "diffusers", seed=seed,
                                            components=False)
    shutil.copytree(checkpoint, out, ignore=shutil.ignore_patterns("transformer"))
    shutil.copytree(transformer_only / "transformer", out / "transformer")
    shutil.rmtree(transformer_only)
    return out


def with_wrong_shape(checkpoint: Path, out: Path) -> Path:
    """A copy of `checkpoint` at `out` whose `WRONG_SHAPE_TENSOR` has one row too many."""
    shutil.copytree(checkpoint, out)
    h3 = H3Checkpoint.open(out)
    shard = TransformerWeights(h3.transformer_dir, h3.layout).location(WRONG_SHAPE_TENSOR).path
    with safe_open(shard, "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    tensors[WRONG_SHAPE_TENSOR] = torch.cat([tensors[WRONG_SHAPE_TENSOR], tensors[WRONG_SHAPE_TENSOR][:1]])
    save_file(tensors, shard, metadata={"format": "pt"})
    return out
