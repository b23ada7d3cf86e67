"""Random MiniMax-H3 checkpoints of the real architecture at any width and depth, for benchmarks.

    make_random_checkpoint(out, H3TransformerConfig(), "diffusers", seed=0, num_blocks=12)   # h3 width, 12 blocks
    make_random_checkpoint(out, config, "native", seed=0, num_blocks=50, only="adaln")        # the AdaLN bytes only
    write_h3_components(out, "diffusers", seed=0, text_layers=5)   # Qwen3-VL of the real width, released-size VAEs
    make_random_checkpoint(out, config, "diffusers", num_blocks=4, ref2va=True)  # + the Ref2VA transformer_ref/
    write_h3_components(out, "diffusers", text_layers=5, vision="released")    # + Qwen3-VL-32B's vision tower

The 50-block transformer is 66 GB, more than the disk (and host memory) of a one-GPU machine, so nothing here
holds the model: every shard is written tensor by tensor (its header first, computed from the shapes, then each
tensor drawn and appended), one shard for the tensors outside `transformer_blocks` and one per block, several
shards at once (`workers` threads; drawing on CUDA and writing to disk both release the GIL). Host memory holds
at most `workers` tensors.

Values: each tensor is drawn from its own generator, seeded from (seed, diffusers name), so the bytes do not
depend on the order or parallelism of the writes, and both layouts of one seed hold the same model (the native
one stores the same tensors under native names and layouts: interleaved qkv, fc1 as [gate; value]). Draws on
`device` (CUDA is ~100x faster than the CPU for h3 sizes); CPU and CUDA generators differ, so the bytes are
a function of (seed, device type). Scales as `model.tiny.tiny_transformer`: weight matrices give unit-variance
outputs, biases N(0, 0.02), norm scales 1 + N(0, 0.1); dtypes as published (bf16, the 12 fp32 tensors).

`only="adaln"` writes the AdaLN projections (`transformer_blocks.{i}.adaln_proj.linear`, `norm_out.linear`)
and the timestep MLP that computes their input: what the plan cache reads, 26 GB at h3 scale. Such a
checkpoint opens as `TransformerWeights` (locations, fingerprint) but not as a loadable model.

`ref2va=True` (diffusers layout) also writes the Ref2VA partition's transformer, `transformer_ref/`, of the same
architecture drawn from seed + `model.tiny.REF2VA_SEED_OFFSET` (another model, as in the release), and lists it
in both model indexes; the components are shared by the two partitions.

The checkpoint is written into a temporary sibling and renamed, so `out` is either absent or complete.

CLI:  python -m bench.checkpoints --out DIR [--layout diffusers|native] [--preset h3|tiny] [--num-blocks N]
          [--only adaln] [--ref2va] [--seed S] [--workers W] [--device cpu|cuda]
          [--components --text-layers K --vision tiny|released]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
from accelerate import init_empty_weights
from diffusers import MiniMaxH3Transformer3DModel
from transformers import Qwen2VLImageProcessorPil

from model.canvas import CANVAS_KEYS, CanvasRule
from model.layout import MODEL_INDEX, MODULAR_MODEL_INDEX, NATIVE_BLOCK, H3Checkpoint, Layout, Partition
from model.tiny import REF2VA_SEED_OFFSET, TINY_TRANSFORMER, atomic_directory, write_index_files
from model.tiny_components import TINY_VIDEO_PROCESSOR_CONFIG, tiny_image_processor
from model.weights import (CONFIG_FILE, INDEX_FILE, NATIVE_ROPE_INV_FREQ, H3TransformerConfig, ParamSpec,
                           Transform, is_adaln_param, native_source, parameter_specs)

Only = Literal["adaln"]
#: The vision tower `write_h3_components` writes: one tiny block (text-only benches never run it) or the release's.
Vision = Literal["tiny", "released"]
PRESETS = {"h3": H3TransformerConfig(), "tiny": TINY_TRANSFORMER}
#: Parameters the AdaLN plan cache needs besides the projections: the timestep MLP computing their input.
ADALN_INPUT_PREFIX = "time_embedder."

_DTYPE_TO_ST = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


class RandomCheckpointError(ValueError):
    """Arguments a random checkpoint cannot be made from; the message names the value and the limit."""


# ---------------------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------------------


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor `name` in a checkpoint of `seed` (63 bits of sha256)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def random_tensor(name: str, spec: ParamSpec, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Diffusers parameter `name` of a random checkpoint of `seed`, on `device` in its published dtype."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    noise = torch.randn(spec.shape, generator=generator, device=device)
    if len(spec.shape) == 2:      # weight matrices: unit-variance outputs
        noise.mul_(spec.shape[1] ** -0.5)
    elif name.endswith(".bias"):
        noise.mul_(0.02)
    else:                         # norm scales: near 1, not 1
        noise.mul_(0.1).add_(1.0)
    return noise.to(spec.dtype)


def random_transformer(config: H3TransformerConfig, seed: int = 0, device: str | torch.device = "cpu",
                       *, skip_adaln: bool = False) -> MiniMaxH3Transformer3DModel:
    """The model `make_random_checkpoint(config, seed)` writes, built in memory on `device` (eval, frozen).
    `skip_adaln`: leave the AdaLN projections on meta, as `load_transformer(..., skip=is_adaln_param)` does."""
    with init_empty_weights(include_buffers=False):
        model = MiniMaxH3Transformer3DModel.from_config(config.model_dump())
    model.rope.to(device)
    modules = dict(model.named_modules())
    for name, spec in parameter_specs(config).items():
        if skip_adaln and is_adaln_param(name):
            continue
        module_name, _, leaf = name.rpartition(".")
        modules[module_name].register_parameter(
            leaf, torch.nn.Parameter(random_tensor(name, spec, seed, device), requires_grad=False))
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a shard stores it, and the diffusers parameters it is assembled from."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[str, ...]        # diffusers names (native qkv: to_q, to_k, to_v; empty for rope.inv_freq)
    transform: Transform

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


def stored_tensors(config: H3TransformerConfig, layout: Layout, only: Only | None = None) -> list[StoredTensor]:
    """Every tensor a checkpoint of `layout` stores, in model order (what `only` selects)."""
    specs = parameter_specs(config)
    wanted = [n for n in specs if only is None or is_adaln_param(n) or n.startswith(ADALN_INPUT_PREFIX)]
    if layout is Layout.DIFFUSERS:
        return [StoredTensor(n, specs[n].shape, specs[n].dtype, (n,), Transform.VERBATIM) for n in wanted]
    grouped: dict[str, list[str]] = {}
    transforms: dict[str, Transform] = {}
    for name in wanted:
        source = native_source(name)
        grouped.setdefault(source.name, []).append(name)
        transforms[source.name] = source.transform
    out = []
    for stored, parts in grouped.items():
        transform = transforms[stored]
        shape = specs[parts[0]].shape
        if transform in (Transform.QUERY_ROWS, Transform.KEY_ROWS, Transform.VALUE_ROWS):
            order = {Transform.QUERY_ROWS: 0, Transform.KEY_ROWS: 1, Transform.VALUE_ROWS: 2}
            parts = sorted(parts, key=lambda n: order[native_source(n).transform])
            shape = (3 * shape[0],) + shape[1:]
        out.append(StoredTensor(stored, shape, specs[parts[0]].dtype, tuple(parts), transform))
    if only is None:
        out.append(StoredTensor(NATIVE_ROPE_INV_FREQ, (config.rope_freq_dim,), torch.float32, (),
                                Transform.VERBATIM))
    return out


def _stored_value(tensor: StoredTensor, config: H3TransformerConfig, seed: int,
                  device: torch.device) -> torch.Tensor:
    """The stored tensor's values on `device`, assembled from its diffusers parameters' draws."""
    specs = parameter_specs(config)
    if not tensor.parts:  # native rope.inv_freq: what diffusers computes from the config
        with init_empty_weights(include_buffers=False):
            model = MiniMaxH3Transformer3DModel.from_config(config.model_dump())
        return model.rope.inv_freq.detach().to(torch.float32)
    values = [random_tensor(name, specs[name], seed, device) for name in tensor.parts]
    if tensor.transform is Transform.VERBATIM:
        return values[0]
    if tensor.transform is Transform.SWAP_HALVES:  # diffusers [value; gate] -> native [gate; value]
        value, gate = values[0].chunk(2, dim=0)
        return torch.cat([gate, value])
    # q, k, v [heads * head_dim, in] -> rows interleaved per head: [heads, 3, head_dim, in]
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    return torch.stack([v.view(heads, head_dim, -1) for v in values], dim=1).reshape(tensor.shape)


def _shard_header(tensors: list[StoredTensor]) -> bytes:
    """The safetensors header (length + JSON, padded to 8 bytes) for `tensors` stored in this order."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        entries[t.name] = {"dtype": _DTYPE_TO_ST[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_shard(path: Path, tensors: list[StoredTensor], config: H3TransformerConfig, seed: int,
                 device: torch.device) -> int:
    """Write one shard tensor by tensor; returns its data bytes."""
    with open(path, "wb") as f:
        f.write(_shard_header(tensors))
        for t in tensors:
            value = _stored_value(t, config, seed, device).contiguous()
            if tuple(value.shape) != t.shape or value.dtype != t.dtype:
                raise RuntimeError(f"{t.name}: drew {value.dtype} {list(value.shape)}, the header says "
                                   f"{t.dtype} {list(t.shape)}")
            f.write(memoryview(value.cpu().view(torch.uint8).numpy()))
    return sum(t.nbytes for t in tensors)


def _block_of(name: str) -> int | None:
    """Block index of a stored tensor name of either layout (None outside the block stack)."""
    for prefix in ("transformer_blocks.", "blocks."):
        if name.startswith(prefix):
            return int(name[len(prefix):].split(".")[0])
    return None


# ---------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------


def make_random_checkpoint(out: str | os.PathLike, config: H3TransformerConfig, layout: Layout | str, seed: int = 0,
                           *, num_blocks: int | None = None, only: Only | None = None, workers: int = 8,
                           device: str | torch.device = "cpu", ref2va: bool = False) -> Path:
    """Write a random transformer checkpoint of `config` (with `num_blocks` blocks, default its own) in
    `layout` to `out` (absent or an empty directory), with the layout's index files; returns `out`.
    `ref2va` (diffusers layout): also the Ref2VA partition's `transformer_ref/` (seed + REF2VA_SEED_OFFSET).

    Shards: the tensors outside the block stack, then one per block, `workers` written at once."""
    out, layout = Path(out), Layout(layout)
    if num_blocks is not None:
        if num_blocks < 1:
            raise RandomCheckpointError(f"num_blocks={num_blocks} must be >= 1")
        config = config.model_copy(update={"num_layers": num_blocks})
    if only not in (None, "adaln"):
        raise RandomCheckpointError(f"only={only!r} must be None or 'adaln'")
    if workers < 1:
        raise RandomCheckpointError(f"workers={workers} must be >= 1")
    if ref2va and layout is not Layout.DIFFUSERS:
        # A native Ref2VA/ partition holds its own copy of every component (as released): not worth the disk here.
        raise RandomCheckpointError(f"ref2va=True writes the diffusers layout's transformer_ref/, not {layout.value}")
    device = torch.device(device)
    with atomic_directory(out) as tmp:
        transformer_dir = write_index_files(tmp, layout)
        _write_transformer(transformer_dir, config, layout, seed, only, workers, device)
        if ref2va:
            ref_dir = tmp / Partition.REF2VA.diffusers_transformer_name
            _write_transformer(ref_dir, config, layout, seed + REF2VA_SEED_OFFSET, only, workers, device)
            _list_in_model_indexes(tmp, Partition.REF2VA.diffusers_transformer_name,
                                   like=Partition.FL2VA.diffusers_transformer_name)
    return out


def _write_transformer(transformer_dir: Path, config: H3TransformerConfig, layout: Layout, seed: int,
                       only: Only | None, workers: int, device: torch.device) -> None:
    """The shards, their index and config.json of one transformer into `transformer_dir`."""
    transformer_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[int, list[StoredTensor]] = {}
    for tensor in stored_tensors(config, layout, only):
        block = _block_of(tensor.name)
        groups.setdefault(-1 if block is None else block, []).append(tensor)
    stem = "diffusion_pytorch_model" if layout is Layout.DIFFUSERS else "model"
    names = {g: f"{stem}-{k:05d}-of-{len(groups):05d}.safetensors" for k, g in enumerate(sorted(groups), 1)}
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(_write_shard, transformer_dir / names[g], groups[g], config, seed, device)
                   for g in sorted(groups, key=lambda g: -len(groups[g]) if g < 0 else g)]
        total_size = sum(f.result() for f in futures)
    weight_map = {t.name: names[g] for g, tensors in groups.items() for t in tensors}
    _write_json(transformer_dir / INDEX_FILE[layout],
                {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(transformer_dir / CONFIG_FILE, transformer_config_json(config, layout))


def _list_in_model_indexes(root: Path, component: str, *, like: str) -> None:
    """Add `component` to a diffusers root's model_index.json and modular_model_index.json, as `like` is listed
    (the same library and class; the modular spec pointing at its own subfolder)."""
    index = json.loads((root / MODEL_INDEX).read_text())
    index[component] = index[like]
    _write_json(root / MODEL_INDEX, index)
    modular = json.loads((root / MODULAR_MODEL_INDEX).read_text())
    library, cls, spec = modular[like]
    modular[component] = [library, cls, {**spec, "subfolder": component}]
    _write_json(root / MODULAR_MODEL_INDEX, modular)


def write_canvas_rule(root: str | os.PathLike, layout: Layout | str, rule: CanvasRule) -> None:
    """State `rule` in the model index(es) of a checkpoint `make_random_checkpoint` wrote (the keys diffusers reads;
    without them the released rule applies: 768 short edge, reference images at 2048). For CPU runs, whose tiny
    vision tower and VAEs cannot take 2048-px references in seconds."""
    root, layout = Path(root), Layout(layout)
    values = dict(zip(CANVAS_KEYS, (rule.short_edge, rule.max_pixels, rule.reference_image_short_edge)))
    if layout is Layout.DIFFUSERS:
        for name in (MODEL_INDEX, MODULAR_MODEL_INDEX):
            _write_json(root / name, json.loads((root / name).read_text()) | values)
        return
    path = root / Partition.FL2VA.native_dir_name / MODEL_INDEX
    index = json.loads(path.read_text())
    index[NATIVE_BLOCK] = index[NATIVE_BLOCK] | values
    _write_json(path, index)


def transformer_config_json(config: H3TransformerConfig, layout: Layout) -> dict[str, object]:
    """config.json of the transformer directory in `layout`."""
    if layout is Layout.NATIVE:
        return config.to_native_json()
    import diffusers

    return {"_class_name": MiniMaxH3Transformer3DModel.__name__, "_diffusers_version": diffusers.__version__,
            **config.model_dump(mode="json")}


def checkpoint_nbytes(config: H3TransformerConfig, layout: Layout | str = Layout.DIFFUSERS,
                      only: Only | None = None) -> int:
    """Tensor bytes `make_random_checkpoint` writes for `config` (headers and index files aside)."""
    return sum(t.nbytes for t in stored_tensors(config, Layout(layout), only))


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------------------
# Components at the released sizes
# ---------------------------------------------------------------------------------------------------------

#: Qwen3-VL 32B's language model (h3.md section 3); `text_layers` of them are written.
QWEN3_VL_TEXT: dict[str, object] = {"hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144,
                 "tie_word_embeddings": False,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                                     "mrope_interleaved": True}}


@dataclass(frozen=True)
class ComponentSizes:
    """Sizes of the random components: `text` overrides Qwen3-VL text config fields, `video_vae` / `audio_vae`
    are constructor arguments of the diffusers VAEs (empty: the released architecture)."""

    text: dict[str, object]
    video_vae: dict[str, object]
    audio_vae: dict[str, object]


RELEASED_COMPONENTS = ComponentSizes(text=QWEN3_VL_TEXT, video_vae={}, audio_vae={})
#: Audio VAE arguments a native audio_vae/metadata.json records; the native loader takes the others as released.
NATIVE_AUDIO_VAE_FIELDS = frozenset({"encoder_dim", "encoder_rates", "latent_dim", "decoder_dim", "decoder_rates"})
#: Small enough for CPU tests; the text width matches the tiny transformer's text_dim. The audio VAE's few
#: resblocks and upsampling stages decode 40x faster than the tiny checkpoint's, but a native audio_vae/ cannot
#: record them (diffusers layout only; for native, keep the audio_vae fields to NATIVE_AUDIO_VAE_FIELDS).
SMALL_COMPONENTS = ComponentSizes(
    text={**QWEN3_VL_TEXT, "hidden_size": TINY_TRANSFORMER.text_dim, "intermediate_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024, "max_position_embeddings": 4096,
          "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 3, 3],
                              "mrope_interleaved": True}},
    video_vae={"block_out_channels": (32, 32, 32, 32), "layers_per_block": 1, "spatial_downsample_factors": (2, 2, 2, 2),
               "temporal_downsample_factors": (1, 2, 2, 1), "decoder_num_layers": 1,
               "decoder_num_attention_heads": 2, "decoder_attention_head_dim": 8},
    audio_vae={"encoder_dim": 4, "latent_dim": 64, "decoder_dim": 32, "decoder_rates": (8, 10, 10),
               "decoder_kernel_sizes": (16, 20, 20), "resblock_kernel_sizes": (3,), "resblock_dilation_sizes": ((1,),)},
)


@dataclass(frozen=True)
class VisionSizes:
    """Qwen3-VL's vision tower (`Qwen3VLVisionConfig` fields; its `out_hidden_size` is always the text width) and the
    processors sized for it (their patch, merge and temporal sizes must be the tower's)."""

    tower: dict[str, object]
    image_processor: Callable[[], Qwen2VLImageProcessorPil]   # saved as processor/preprocessor_config.json
    video_processor: dict[str, object]   # processor/video_preprocessor_config.json, as transformers saves it


def released_image_processor() -> Qwen2VLImageProcessorPil:
    """Qwen3-VL's image processor as the release configures it: 16-px patches merged 2x2, 64k to 16.8M pixels."""
    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 65536, "longest_edge": 16777216},
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


VISION: dict[Vision, VisionSizes] = {
    "tiny": VisionSizes(
        tower={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 4,
               "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
               "deepstack_visual_indexes": [0]},
        image_processor=tiny_image_processor, video_processor=TINY_VIDEO_PROCESSOR_CONFIG),
    # Qwen3-VL-32B's tower (transformers' Qwen3VLVisionConfig defaults are that tower): 27 blocks 1152 wide,
    # 0.6 B parameters with its mergers; its processors' pixel bounds (a 2048-px image reference stays whole).
    "released": VisionSizes(
        tower={"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
               "num_heads": 16, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
               "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]},
        image_processor=released_image_processor,
        video_processor={"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "merge_size": 2,
                         "temporal_patch_size": 2, "size": {"shortest_edge": 4096, "longest_edge": 25165824},
                         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                         "rescale_factor": 1 / 255, "resample": 3, "do_resize": True, "do_rescale": True,
                         "do_normalize": True, "do_convert_rgb": True, "do_sample_frames": True, "fps": 2,
                         "min_frames": 4, "max_frames": 768, "return_metadata": False}),
}


@torch.no_grad()
def write_h3_components(root: str | os.PathLike, layout: Layout | str, seed: int = 0, *, text_layers: int = 5,
                        device: str | torch.device = "cpu", sizes: ComponentSizes = RELEASED_COMPONENTS,
                        vision: Vision = "tiny") -> dict[str, int]:
    """Random text encoder, tokenizer, processor, video and audio VAE at the released sizes into the component
    root of `layout` (the diffusers root, or native FL2VA/). Returns each component's parameter bytes.

    What differs from the release, and why: the Qwen3-VL has `text_layers` decoder layers (the release 64, of
    which H3 reads 50: a bench loads `text_layers - 1` and scales) and, by default, a one-block vision tower
    (text-only prompts never run it; `vision="released"`: Qwen3-VL-32B's, for keyframe and reference benches);
    the image and video processors match the tower (released: the release's pixel bounds); the tokenizer is the tiny locally trained BPE (no download), so prompts tokenize to
    more, shorter tokens than the real vocabulary would give. The VAEs are the released architectures
    (`AutoencoderKLMiniMaxH3()`: 2.6 B parameters, fp32 10.4 GB; `AutoencoderKLMiniMaxH3Audio()`: 0.15 B).
    `sizes=SMALL_COMPONENTS` writes the same files at CPU-test size."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from model.qwen_video import VIDEO_PROCESSOR_FILE
    from model.tiny_components import tiny_tokenizer, write_native_audio_vae, write_native_video_vae

    root, layout, device = Path(root), Layout(layout), torch.device(device)
    if layout is Layout.NATIVE:
        root = root / "FL2VA"
    if text_layers < 2:
        raise RandomCheckpointError(f"text_layers={text_layers} must be >= 2 (a layer output is read, not the last)")
    if vision not in ("tiny", "released"):
        raise RandomCheckpointError(f"vision={vision!r} must be 'tiny' or 'released'")
    vision_sizes = VISION[vision]
    unrecorded = sorted(set(sizes.audio_vae) - NATIVE_AUDIO_VAE_FIELDS)
    if layout is Layout.NATIVE and unrecorded:
        raise RandomCheckpointError(f"audio VAE arguments {unrecorded} cannot be recorded in a native audio_vae/ "
                                    f"(its metadata.json holds only {sorted(NATIVE_AUDIO_VAE_FIELDS)})")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    tokenizer.save_pretrained(root / "processor")
    vision_sizes.image_processor().save_pretrained(root / "processor")
    _write_json(root / "processor" / VIDEO_PROCESSOR_FILE, vision_sizes.video_processor)
    token_id = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config={**sizes.text, "num_hidden_layers": text_layers},
        vision_config={**vision_sizes.tower, "out_hidden_size": sizes.text["hidden_size"]},
        image_token_id=token_id("<|image_pad|>"), video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"), vision_end_token_id=token_id("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    param_bytes: dict[str, int] = {}
    video_mean, video_std = _latent_statistics(24, seed)
    audio_mean, audio_std = _latent_statistics(32, seed)
    torch.manual_seed(seed)  # the libraries' own initialisations draw from the global generators
    with torch.device(device):
        text_encoder = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
        param_bytes["text_encoder"] = _param_bytes(text_encoder)
        text_encoder.save_pretrained(root / "text_encoder", max_shard_size="5GB")
        del text_encoder
        video_vae = AutoencoderKLMiniMaxH3(**sizes.video_vae, latents_mean=video_mean, latents_std=video_std)
        param_bytes["video_vae"] = _param_bytes(video_vae)
        if layout is Layout.DIFFUSERS:
            video_vae.save_pretrained(root / "vae")
        else:
            write_native_video_vae(root / "video_vae", video_vae.cpu())
        del video_vae
        audio_vae = AutoencoderKLMiniMaxH3Audio(**sizes.audio_vae, latents_mean=audio_mean, latents_std=audio_std)
        param_bytes["audio_vae"] = _param_bytes(audio_vae)
        if layout is Layout.DIFFUSERS:
            audio_vae.save_pretrained(root / "audio_vae")
        else:
            write_native_audio_vae(root / "audio_vae", audio_vae.cpu())
    return param_bytes


def ensure_bench_checkpoint(path: str | os.PathLike, *, tiny: bool, num_blocks: int, text_layers: int) -> Path:
    """The checkpoint a benchmark runs on, made at `path` on first use and reused afterwards: the tiny one
    (`model.tiny`), else an h3-width one with `num_blocks` blocks and released-size components whose Qwen3-VL
    has `text_layers` layers to read (one more is written: conditioning is `hidden_states[text_layers]`).
    Drawn on CUDA when there is one (~100x faster at h3 sizes)."""
    path = Path(path)
    if (path / "model_index.json").exists() or (path / "FL2VA").is_dir():
        return path
    if tiny:
        from model.tiny import make_tiny_checkpoint

        make_tiny_checkpoint(path, "diffusers", seed=0)
        return path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    make_random_checkpoint(path, PRESETS["h3"], "diffusers", seed=0, num_blocks=num_blocks, device=device)
    write_h3_components(path, "diffusers", 0, text_layers=text_layers + 1, device=device)
    return path


def _latent_statistics(channels: int, seed: int) -> tuple[list[float], list[float]]:
    """Per-channel latent mean and std (the release ships measured ones; any fixed values time the same)."""
    generator = torch.Generator().manual_seed(seed + channels)
    mean = 0.1 * torch.randn(channels, generator=generator)
    std = 0.5 + torch.rand(channels, generator=generator)
    return mean.tolist(), std.tolist()


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoints", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory (absent or empty)")
    parser.add_argument("--layout", choices=[layout.value for layout in Layout], default="diffusers")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h3", help="width (h3: the released model)")
    parser.add_argument("--num-blocks", type=int, default=None, help="blocks (default: the preset's)")
    parser.add_argument("--only", choices=["adaln"], default=None, help="write only the AdaLN projections + input")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=8, help="shards written at once")
    parser.add_argument("--device", default="cpu", help="where values are drawn (cuda: much faster at h3 size)")
    parser.add_argument("--components", action="store_true",
                        help="also write the text encoder, tokenizer and VAEs at the released sizes")
    parser.add_argument("--text-layers", type=int, default=5, help="Qwen3-VL decoder layers with --components")
    parser.add_argument("--vision", choices=["tiny", "released"], default="tiny",
                        help="Qwen3-VL vision tower with --components (released: Qwen3-VL-32B's, 0.6 B parameters)")
    parser.add_argument("--ref2va", action="store_true", help="also the Ref2VA transformer (transformer_ref/)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = make_random_checkpoint(args.out, PRESETS[args.preset], args.layout, args.seed,
                                 num_blocks=args.num_blocks, only=args.only, workers=args.workers,
                                 device=args.device, ref2va=args.ref2va)
    if args.components:
        write_h3_components(out, args.layout, args.seed, text_layers=args.text_layers, device=args.device,
                            vision=args.vision)
    checkpoint = H3Checkpoint.open(out, require_components=args.components)
    nbytes = sum(p.stat().st_size for p in checkpoint.transformer_dir.glob("*.safetensors"))
    print(f"wrote {out} ({checkpoint.layout.value}, transformer {nbytes / 1e9:.2f} GB in "
          f"{time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
