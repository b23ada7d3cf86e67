"""A tiny, seeded MiniMax-H3 checkpoint in either published layout, for tests and local runs.

The transformer is diffusers' `MiniMaxH3Transformer3DModel` with `TINY_TRANSFORMER` and random weights drawn from
one generator seeded by `seed` (same seed -> same bytes), in the published dtypes. Both layouts of one seed hold
the same model:

    diffusers: save_pretrained into transformer/ (sharded with an index), model_index.json,
               modular_model_index.json, scheduler/ (shift 12) and audio_scheduler/ (shift 3), everything
               diffusers' `MiniMaxH3ModularPipeline` reads
    native:    FL2VA/transformer/ under native names and layouts (interleaved qkv, fc1 as [gate; value],
               rope.inv_freq), FL2VA/model_index.json with the `_minimax_h3` block

`ref2va=True` adds the Ref2VA partition: `transformer_ref/` at the diffusers root, `Ref2VA/` (its own transformer,
index and components) beside `FL2VA/` in the native layout; its transformer is `tiny_transformer(seed +
REF2VA_SEED_OFFSET)`. The model indexes carry `TINY_CANVAS` (`model.canvas.CanvasRule`).

Everything else (text encoder, tokenizer, processor, VAEs) is written by
`model.tiny_components.write_tiny_components(component_root, layout, seed)` into the directory that holds the
component directories: the root for the diffusers layout, FL2VA/ for the native one.

The checkpoint is written to a temporary sibling directory and renamed into place, so `out` either does not
exist or is complete.

CLI:  python -m model.tiny --layout diffusers|native --out DIR [--seed N] [--transformer-only]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import diffusers
import torch
from accelerate import init_empty_weights
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from safetensors.torch import save_file

from model.layout import (MODEL_INDEX, MODULAR_MODEL_INDEX, NATIVE_BLOCK, RELEASED_AUDIO_SHIFT, RELEASED_VIDEO_SHIFT,
                          H3Checkpoint, Layout, Partition)
from model.weights import (CONFIG_FILE, INDEX_FILE, NATIVE_ROPE_INV_FREQ, H3TransformerConfig, Transform,
                           native_source, parameter_specs)

TINY_TRANSFORMER = H3TransformerConfig(
    num_attention_heads=2, attention_head_dim=32, hidden_size=64, num_layers=4, num_refiner_layers=1, ffn_dim=128,
    in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=32, freq_dim=32, time_embed_hidden_dim=64,
    time_embed_dim=32, rope_freq_dim=4,
)
#: The tiny model's canvas rule (`model.canvas.CanvasRule`, in its model index as diffusers reads it): a 16:9 request
#: without a size is 64x32 (2 video rows per latent frame), a reference image's short edge 32.
TINY_CANVAS = {"canvas_short_edge": 32, "canvas_max_pixels": 32 * 64, "reference_image_short_edge": 32}
#: The Ref2VA partition's transformer is `tiny_transformer(seed + REF2VA_SEED_OFFSET)`: another model than FL2VA's.
REF2VA_SEED_OFFSET = 10_000
#: Small enough that the tiny diffusers transformer (~0.6 MB) is written as several shards plus an index.
DIFFUSERS_MAX_SHARD_SIZE = "200KB"
#: The hub repository a downloaded diffusers root points its components at (diffusers loads local copies).
HUB_REPO = "MiniMaxAI/MiniMax-H3"

#: (component name, library, class) of every component of the diffusers root, as the modular pipeline loads it.
_DIFFUSERS_COMPONENTS = (
    ("transformer", "diffusers", "MiniMaxH3Transformer3DModel"),
    ("scheduler", "diffusers", "MiniMaxH3Scheduler"),
    ("audio_scheduler", "diffusers", "MiniMaxH3Scheduler"),
    ("text_encoder", "transformers", "Qwen3VLForConditionalGeneration"),
    ("tokenizer", "transformers", "Qwen2TokenizerFast"),
    ("processor", "transformers", "Qwen3VLProcessor"),
    ("vae", "diffusers", "AutoencoderKLMiniMaxH3"),
    ("audio_vae", "diffusers", "AutoencoderKLMiniMaxH3Audio"),
)


def tiny_transformer(seed: int = 0, config: H3TransformerConfig = TINY_TRANSFORMER) -> MiniMaxH3Transformer3DModel:
    """The seeded random transformer, on CPU in the published dtypes. Draws only from its own generator."""
    generator = torch.Generator().manual_seed(seed)
    with init_empty_weights(include_buffers=False):
        model = MiniMaxH3Transformer3DModel.from_config(config.model_dump())
    modules = dict(model.named_modules())
    for name, spec in parameter_specs(config).items():
        noise = torch.randn(spec.shape, generator=generator)
        if len(spec.shape) == 2:     # weight matrices: unit-variance outputs
            value = noise * spec.shape[1] ** -0.5
        elif name.endswith(".bias"):
            value = noise * 0.02
        else:                        # norm scales: near 1, but not 1, so a swapped norm shows
            value = 1.0 + 0.1 * noise
        module_name, _, leaf = name.rpartition(".")
        modules[module_name].register_parameter(leaf, torch.nn.Parameter(value.to(spec.dtype), requires_grad=False))
    return model.eval()


def native_state_dict(model: MiniMaxH3Transformer3DModel) -> dict[str, torch.Tensor]:
    """The model's tensors under native names and layouts (the inverse of TransformerWeights' mapping)."""
    heads, head_dim = model.config.num_attention_heads, model.config.attention_head_dim
    native: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[Transform, torch.Tensor]] = {}
    for name, tensor in model.state_dict().items():
        source = native_source(name)
        if source.transform is Transform.VERBATIM:
            native[source.name] = tensor
        elif source.transform is Transform.SWAP_HALVES:  # diffusers [value; gate] -> native [gate; value]
            value, gate = tensor.chunk(2, dim=0)
            native[source.name] = torch.cat([gate, value])
        else:
            qkv.setdefault(source.name, {})[source.transform] = tensor
    for stored, parts in qkv.items():
        # [heads * head_dim, in] each -> [heads, 3 (q k v), head_dim, in] -> rows interleaved per head
        per_head = [parts[t].view(heads, head_dim, -1) for t in (Transform.QUERY_ROWS, Transform.KEY_ROWS,
                                                                 Transform.VALUE_ROWS)]
        native[stored] = torch.stack(per_head, dim=1).reshape(3 * heads * head_dim, -1)
    native[NATIVE_ROPE_INV_FREQ] = model.rope.inv_freq.clone()
    return native


def make_tiny_checkpoint(out: str | os.PathLike, layout: Layout | str, seed: int = 0, *,
                         components: bool = True, ref2va: bool = False) -> Path:
    """Write the tiny checkpoint of `layout` to `out` (which must not exist, or be empty) and return `out`.

    `components=False` writes only the transformer, indexes and scheduler configs (for tests that need nothing
    else); otherwise `model.tiny_components.write_tiny_components` adds the rest and the result must open as a
    complete H3Checkpoint. `ref2va` adds the Ref2VA partition (diffusers: `transformer_ref/` beside the shared
    components; native: `Ref2VA/` beside `FL2VA/`, each partition with its components, as released)."""
    out, layout = Path(out), Layout(layout)
    partitions = (Partition.FL2VA, Partition.REF2VA) if ref2va else (Partition.FL2VA,)
    with atomic_directory(out) as tmp:
        models = {partition: tiny_transformer(seed + (REF2VA_SEED_OFFSET if partition is Partition.REF2VA else 0))
                  for partition in partitions}
        if layout is Layout.DIFFUSERS:
            _write_diffusers(tmp, models)
            component_roots = [tmp]
        else:
            component_roots = [tmp / partition.native_dir_name for partition in partitions]
            for partition, model in models.items():
                _write_native(tmp / partition.native_dir_name, model, partition)
        if components:
            from model.tiny_components import write_tiny_components  # helper B's module: text encoder, VAEs
            for component_root in component_roots:
                write_tiny_components(component_root, layout, seed)
            for partition in partitions:
                H3Checkpoint.open(tmp, partition, require_components=True)
    return out


@contextlib.contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Write a checkpoint directory all at once: yield a temporary sibling of `out` (which must not exist, or be
    empty); when the block ends it is made world-readable and renamed to `out`, so a reader (another replica)
    never sees a half-written checkpoint; if the block raises it is removed."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        _make_readable(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_readable(root: Path) -> None:
    """mkdtemp and the safetensors writers create owner-only files; a checkpoint is read by other processes."""
    root.chmod(0o755)
    for directory, subdirs, files in os.walk(root):
        for name in subdirs:
            Path(directory, name).chmod(0o755)
        for name in files:
            Path(directory, name).chmod(0o644)


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _write_diffusers(root: Path, models: dict[Partition, MiniMaxH3Transformer3DModel]) -> None:
    for partition, model in models.items():
        model.save_pretrained(root / partition.diffusers_transformer_name, max_shard_size=DIFFUSERS_MAX_SHARD_SIZE)
    MiniMaxH3Scheduler(shift=RELEASED_VIDEO_SHIFT).save_pretrained(root / "scheduler")
    MiniMaxH3Scheduler(shift=RELEASED_AUDIO_SHIFT).save_pretrained(root / "audio_scheduler")
    header = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": diffusers.__version__}
    components = _DIFFUSERS_COMPONENTS
    if Partition.REF2VA in models:
        components += (("transformer_ref", "diffusers", "MiniMaxH3Transformer3DModel"),)
    _write_json(root / MODEL_INDEX, header | {name: [library, cls] for name, library, cls in components} | TINY_CANVAS)
    specs = {name: [library, cls, {"pretrained_model_name_or_path": HUB_REPO, "subfolder": name, "variant": None,
                                   "revision": None, "type_hint": [library, cls]}]
             for name, library, cls in components}
    _write_json(root / MODULAR_MODEL_INDEX, header | {"_blocks_class_name": "MiniMaxH3Blocks"} | specs | TINY_CANVAS)


def _write_native(partition_dir: Path, model: MiniMaxH3Transformer3DModel,
                  partition: Partition = Partition.FL2VA) -> None:
    transformer_dir = partition_dir / "transformer"
    transformer_dir.mkdir(parents=True)
    config = H3TransformerConfig.model_validate(
        {name: model.config[name] for name in H3TransformerConfig.model_fields})
    _write_json(transformer_dir / CONFIG_FILE, config.to_native_json())

    # One shard for everything outside the blocks, then one per block (as the released shards group them).
    tensors = native_state_dict(model)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ""
        groups.setdefault(group, {})[name] = tensor.contiguous()
    weight_map: dict[str, str] = {}
    for number, group in enumerate(sorted(groups, key=_block_order), start=1):
        fname = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file(groups[group], transformer_dir / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(groups[group], fname))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(transformer_dir / INDEX_FILE[Layout.NATIVE],
                {"metadata": {"total_size": total_size}, "weight_map": weight_map})

    _write_json(partition_dir / MODEL_INDEX, {NATIVE_BLOCK: {
        "schema_version": 1, "partition": partition.value, "tasks": list(partition.tasks), "task_aliases": {},
        "sigma_shift_scales": {"video": RELEASED_VIDEO_SHIFT, "audio": RELEASED_AUDIO_SHIFT}} | TINY_CANVAS})


def write_index_files(root: str | os.PathLike, layout: Layout | str) -> Path:
    """The files around a transformer that make `root` open as an H3Checkpoint of `layout`; returns the
    (created, empty) transformer directory for the caller to fill with config, index and shards.

    diffusers: model_index.json, modular_model_index.json, scheduler/ (shift 12), audio_scheduler/ (shift 3);
    native: FL2VA/model_index.json with the `_minimax_h3` block. Component directories (text encoder, VAEs)
    are not written (`write_tiny_components`, or `bench.checkpoints.write_h3_components` at full size)."""
    root, layout = Path(root), Layout(layout)
    if layout is Layout.DIFFUSERS:
        MiniMaxH3Scheduler(shift=RELEASED_VIDEO_SHIFT).save_pretrained(root / "scheduler")
        MiniMaxH3Scheduler(shift=RELEASED_AUDIO_SHIFT).save_pretrained(root / "audio_scheduler")
        header = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": diffusers.__version__}
        _write_json(root / MODEL_INDEX,
                    header | {name: [library, cls] for name, library, cls in _DIFFUSERS_COMPONENTS})
        specs = {name: [library, cls, {"pretrained_model_name_or_path": HUB_REPO, "subfolder": name,
                                       "variant": None, "revision": None, "type_hint": [library, cls]}]
                 for name, library, cls in _DIFFUSERS_COMPONENTS}
        _write_json(root / MODULAR_MODEL_INDEX, header | {"_blocks_class_name": "MiniMaxH3Blocks"} | specs)
        transformer_dir = root / Partition.FL2VA.diffusers_transformer_name
    else:
        partition = Partition.FL2VA
        _write_json(root / partition.native_dir_name / MODEL_INDEX, {NATIVE_BLOCK: {
            "schema_version": 1, "partition": partition.value, "tasks": list(partition.tasks), "task_aliases": {},
            "sigma_shift_scales": {"video": RELEASED_VIDEO_SHIFT, "audio": RELEASED_AUDIO_SHIFT}}})
        transformer_dir = root / partition.native_dir_name / "transformer"
    transformer_dir.mkdir(parents=True, exist_ok=True)
    return transformer_dir


def _block_order(group: str) -> int:
    return -1 if not group else int(group.split(".")[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=[layout.value for layout in Layout], required=True)
    parser.add_argument("--out", required=True, help="output directory (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transformer-only", action="store_true",
                        help="skip the text encoder, tokenizer, processor and VAEs")
    parser.add_argument("--ref2va", action="store_true", help="also write the Ref2VA partition")
    args = parser.parse_args(argv)
    out = make_tiny_checkpoint(args.out, args.layout, args.seed, components=not args.transformer_only,
                               ref2va=args.ref2va)
    checkpoint = H3Checkpoint.open(out)
    print(f"wrote {out} ({checkpoint.layout.value}, {checkpoint.partition.native_dir_name}, "
          f"transformer in {checkpoint.transformer_dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
