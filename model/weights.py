"""The MiniMax-H3 transformer's tensors, read lazily under diffusers names from either published layout.

Everything here speaks diffusers' parameter names (`transformer_blocks.{i}.attn.to_q.weight`, `norm_out.linear.bias`).
A diffusers checkpoint stores exactly those tensors. A native checkpoint stores them under other names, and three
kinds in another layout (h3.md section 2; diffusers' own `convert_minimax_h3_transformer_checkpoint_to_diffusers`):

    attn.to_q / to_k / to_v   rows of attn.qkv_proj, interleaved per head: [head0: q k v, head1: q k v, ...]
    ff.net.0.proj             mlp.fc1 with its halves swapped: native [gate; value], diffusers [value; gate]
    (rope.inv_freq)           native only; diffusers recomputes it from the config

Each diffusers tensor is read from its stored tensor as a few byte ranges ("pieces") straight into its final
layout, so no converted copy of a stored tensor is ever made. Tensors stored verbatim (every AdaLN projection, in
both layouts) also have a single absolute byte range, `location(name)`, for parallel pread-based readers.

A shard is a plain safetensors file: 8-byte little-endian header length N, N bytes of JSON header
({name: {dtype, shape, data_offsets: [begin, end]}}, offsets relative to the end of the header), then the data.
Headers are parsed here so that construction, `validate` and `location` never read tensor data.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from diffusers import MiniMaxH3Transformer3DModel
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model.geometry import H3_LATENTS, LatentSpec
from model.layout import CheckpointError, Layout

CONFIG_FILE = "config.json"
INDEX_FILE = {Layout.DIFFUSERS: "diffusion_pytorch_model.safetensors.index.json",
              Layout.NATIVE: "model.safetensors.index.json"}
SINGLE_FILE = {Layout.DIFFUSERS: "diffusion_pytorch_model.safetensors", Layout.NATIVE: "model.safetensors"}
DIFFUSERS_CLASS_NAME = "MiniMaxH3Transformer3DModel"
#: Largest JSON header accepted (safetensors uses the same bound).
MAX_HEADER_BYTES = 100_000_000
#: Bytes hashed from the start, middle and end of every tensor for the fingerprint.
FINGERPRINT_SAMPLE_BYTES = 64

_ST_TO_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

_ADALN_PARAM = re.compile(r"transformer_blocks\.\d+\.adaln_proj\.linear\.(weight|bias)|norm_out\.linear\.(weight|bias)")


def is_adaln_param(name: str) -> bool:
    """Whether `name` is an AdaLN projection parameter: a block's `adaln_proj.linear` or `norm_out.linear`."""
    return _ADALN_PARAM.fullmatch(name) is not None


def adaln_unit_names(num_blocks: int) -> list[tuple[str, int | None]]:
    """(module name, block index or None) of every AdaLN projection, in streaming order."""
    return [(f"transformer_blocks.{i}.adaln_proj.linear", i) for i in range(num_blocks)] + [("norm_out.linear", None)]


@dataclass(frozen=True)
class TensorLocation:
    """Where one stored tensor's bytes live: `nbytes` bytes at absolute `offset` in `path`."""

    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------

#: diffusers config name -> native config name, where they differ.
_NATIVE_CONFIG_NAMES = {"num_refiner_layers": "token_refiner_num_layers", "ffn_dim": "ffn_hidden_size",
                        "in_channels": "latents_dim", "audio_in_channels": "audio_latents_dim",
                        "freq_dim": "timestep_input_dim", "time_embed_hidden_dim": "time_embed_hidden_size",
                        "rope_freq_dim": "rope_inv_freq_len"}


class H3TransformerConfig(BaseModel):
    """`MiniMaxH3Transformer3DModel`'s config (diffusers names; defaults are the released 33B model)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_attention_heads: int = Field(56, gt=0)
    attention_head_dim: int = Field(128, gt=0)
    hidden_size: int = Field(5376, gt=0)
    num_layers: int = Field(50, gt=0)
    num_refiner_layers: int = Field(2, ge=0)
    ffn_dim: int = Field(14336, gt=0)
    in_channels: int = Field(24, gt=0)
    audio_in_channels: int = Field(32, gt=0)
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = Field(5120, gt=0)
    freq_dim: int = Field(256, gt=0)
    time_embed_hidden_dim: int = Field(5376, gt=0)
    time_embed_dim: int = Field(2688, gt=0)
    rope_freq_dim: int = Field(16, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-5, gt=0)
    qk_norm_eps: float = Field(1e-5, gt=0)
    final_norm_eps: float = Field(1e-5, gt=0)

    @property
    def num_blocks(self) -> int:
        return self.num_layers

    @property
    def adaln_width(self) -> int:
        """Output width of a block's adaln_proj: [modality 3][chunk 6][hidden]."""
        return 18 * self.hidden_size

    @property
    def final_adaln_width(self) -> int:
        """Output width of norm_out.linear: shift then scale."""
        return 2 * self.hidden_size

    @property
    def torch_dtype(self) -> torch.dtype:
        """The blocks' dtype (the AdaLN projections included); see `published_dtype` for the fp32 exceptions."""
        return torch.bfloat16

    @property
    def patch_dim(self) -> int:
        return self.in_channels * math.prod(self.patch_size)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_json(cls, raw: bytes, layout: Layout, source: Path) -> H3TransformerConfig:
        """Parse a transformer config.json of `layout`; CheckpointError naming `source` if it is not one."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{source} is not a valid config: {e}") from None
        names = {name: _NATIVE_CONFIG_NAMES.get(name, name) if layout is Layout.NATIVE else name
                 for name in cls.model_fields}
        if layout is Layout.DIFFUSERS and data.get("_class_name", DIFFUSERS_CLASS_NAME) != DIFFUSERS_CLASS_NAME:
            raise CheckpointError(f"{source} is a {data['_class_name']} config, not {DIFFUSERS_CLASS_NAME}")
        try:
            config = cls(**{field: data[stored] for field, stored in names.items() if stored in data})
        except ValidationError as e:
            raise CheckpointError(f"{source} is not a valid MiniMax-H3 transformer config: {e}") from None
        if layout is Layout.NATIVE:  # the native config restates two derived widths; they must agree
            for stored, derived in (("adaln_out_features", config.adaln_width),
                                    ("final_adaln_out_features", config.final_adaln_width)):
                if stored in data and data[stored] != derived:
                    raise CheckpointError(f"{source}: {stored} is {data[stored]}, but hidden_size "
                                          f"{config.hidden_size} implies {derived}")
        config.check_latents(H3_LATENTS, source)
        return config

    def check_latents(self, spec: LatentSpec, source: Path) -> None:
        """CheckpointError naming `source` if the transformer's latent interface is not `spec`'s (the VAEs').
        Checked where the transformer is opened, so a process that holds no VAE (a denoiser alone) refuses the
        checkpoint at load instead of failing every request inside the patch embedding."""
        for field, value, expected in (("in_channels", self.in_channels, spec.latent_channels),
                                       ("audio_in_channels", self.audio_in_channels, spec.audio_latent_channels),
                                       ("patch_size", self.patch_size, spec.patch_size)):
            if value != expected:
                raise CheckpointError(f"{source}: {field} is {value}, but the served VAEs' latent spec needs "
                                      f"{expected} (model.geometry.H3_LATENTS)")

    def to_native_json(self) -> dict[str, object]:
        """The native config.json contents for this config."""
        native: dict[str, object] = {_NATIVE_CONFIG_NAMES.get(k, k): v for k, v in self.model_dump().items()}
        native["patch_size"] = list(self.patch_size)
        native["adaln_out_features"] = self.adaln_width
        native["final_adaln_out_features"] = self.final_adaln_width
        return native


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def published_dtype(name: str) -> torch.dtype:
    """The dtype MiniMax-H3 publishes a parameter in: fp32 for the patch projections, the timestep MLP and the
    output heads (the modules diffusers keeps in fp32), bf16 for everything else."""
    parts = name.split(".")
    fp32 = any(module in parts for module in MiniMaxH3Transformer3DModel._keep_in_fp32_modules)
    return torch.float32 if fp32 else torch.bfloat16


@functools.lru_cache(maxsize=8)
def parameter_specs(config: H3TransformerConfig) -> dict[str, ParamSpec]:
    """Every parameter of the diffusers model for `config`, in model order, with its published dtype."""
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel.from_config(config.model_dump())
    return {name: ParamSpec(tuple(p.shape), published_dtype(name)) for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------------
# Native names and layouts
# ---------------------------------------------------------------------------------------------------------


class Transform(Enum):
    """How a diffusers tensor is cut from its stored tensor."""

    VERBATIM = "stored as is"
    QUERY_ROWS = "the per-head query rows"
    KEY_ROWS = "the per-head key rows"
    VALUE_ROWS = "the per-head value rows"
    SWAP_HALVES = "the halves swapped"


_QKV_PART = {Transform.QUERY_ROWS: 0, Transform.KEY_ROWS: 1, Transform.VALUE_ROWS: 2}


@dataclass(frozen=True)
class StoredSource:
    """The stored tensor a diffusers tensor comes from, and how."""

    name: str
    transform: Transform


_NATIVE_TOP_LEVEL = {"proj_in.": "video_patch_proj.", "audio_proj_in.": "audio_patch_proj.",
                     "context_embedder.": "condition_proj.", "time_embedder.linear_1.": "time_embedder.proj_in.",
                     "time_embedder.linear_2.": "time_embedder.proj_out.", "norm_out.norm.": "final_layer.norm.",
                     "norm_out.linear.": "final_layer.adaln_proj.linear.", "proj_out.": "final_layer.video_out.",
                     "audio_proj_out.": "final_layer.audio_out.", "token_refiner.final_norm.": "token_refiner.final_norm."}
_NATIVE_BLOCK_LISTS = {"transformer_blocks.": "blocks.", "token_refiner.refiner_blocks.": "token_refiner.blocks."}
_NATIVE_IN_BLOCK = {"norm1.": ("norm1.", Transform.VERBATIM), "norm2.": ("norm2.", Transform.VERBATIM),
                    "attn.to_q.": ("attn.qkv_proj.", Transform.QUERY_ROWS),
                    "attn.to_k.": ("attn.qkv_proj.", Transform.KEY_ROWS),
                    "attn.to_v.": ("attn.qkv_proj.", Transform.VALUE_ROWS),
                    "attn.norm_q.": ("attn.q_norm.", Transform.VERBATIM),
                    "attn.norm_k.": ("attn.k_norm.", Transform.VERBATIM),
                    "attn.to_out.0.": ("attn.out_proj.", Transform.VERBATIM),
                    "ff.net.0.proj.": ("mlp.fc1.", Transform.SWAP_HALVES),
                    "ff.net.2.": ("mlp.fc2.", Transform.VERBATIM),
                    "adaln_proj.linear.": ("adaln_proj.linear.", Transform.VERBATIM)}
#: Stored in native checkpoints, not a diffusers parameter (the model recomputes it from the config).
NATIVE_ROPE_INV_FREQ = "rope.inv_freq"


def native_source(name: str) -> StoredSource:
    """The native tensor holding diffusers parameter `name`; ValueError if `name` is not an H3 parameter."""
    for prefix, native in _NATIVE_TOP_LEVEL.items():
        if name.startswith(prefix):
            return StoredSource(native + name[len(prefix):], Transform.VERBATIM)
    for prefix, native in _NATIVE_BLOCK_LISTS.items():
        match = re.fullmatch(re.escape(prefix) + r"(\d+)\.(.+)", name)
        if match is None:
            continue
        index, rest = match.groups()
        for part, (native_part, transform) in _NATIVE_IN_BLOCK.items():
            if rest.startswith(part):
                return StoredSource(f"{native}{index}.{native_part}{rest[len(part):]}", transform)
    raise ValueError(f"{name!r} is not a MiniMax-H3 transformer parameter name")


def stored_shape(transform: Transform, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the stored tensor a diffusers tensor of `shape` is cut from."""
    if transform in _QKV_PART:
        return (3 * shape[0],) + shape[1:]
    return shape


@dataclass(frozen=True)
class _Piece:
    """`nbytes` bytes at `source_offset` of the stored tensor go to `target_offset` of the diffusers tensor."""

    source_offset: int
    nbytes: int
    target_offset: int


def _pieces(transform: Transform, location: TensorLocation, num_heads: int) -> list[_Piece]:
    if transform is Transform.VERBATIM:
        return [_Piece(0, location.nbytes, 0)]
    if transform is Transform.SWAP_HALVES:
        half = location.nbytes // 2
        return [_Piece(half, half, 0), _Piece(0, half, half)]
    # Rows of head h, part p start at row (3h + p) * head_dim: each head's block is contiguous in the file.
    head_bytes = location.nbytes // (3 * num_heads)
    part = _QKV_PART[transform]
    return [_Piece((3 * h + part) * head_bytes, head_bytes, h * head_bytes) for h in range(num_heads)]


# ---------------------------------------------------------------------------------------------------------
# Shard headers
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shard:
    path: Path
    size: int  # file size in bytes
    header: bytes  # the 8-byte length plus the JSON header, as stored
    entries: dict[str, TensorLocation]

    @property
    def data_end(self) -> int:
        return max((loc.offset + loc.nbytes for loc in self.entries.values()), default=len(self.header))


def _parse_shard(path: Path, held: list[str]) -> _Shard:
    """Parse one shard's header into absolute locations; CheckpointError on anything malformed."""
    holds = f"(holds {_summary(held)})"
    if not path.is_file():
        raise CheckpointError(f"shard {path.name} {holds} is missing from {path.parent}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"corrupt header in {path}: the file is {size} bytes, shorter than the length field")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"corrupt header in {path}: header length {n} does not fit the {size}-byte file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt header in {path}: {e} {holds}") from None

    base = 8 + n
    entries: dict[str, TensorLocation] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_TO_DTYPE[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"corrupt header in {path}: bad entry for tensor {name!r} ({e!r})") from None
        if begin < 0 or end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"corrupt header in {path}: tensor {name!r} offsets {begin}..{end} do not match "
                                  f"shape {list(shape)} {info['dtype']}")
        entries[name] = TensorLocation(path, base + begin, end - begin, dtype, shape)
    # Data must tile [0, end) without gaps or overlaps (what safetensors itself enforces).
    expected_begin = 0
    for name, loc in sorted(entries.items(), key=lambda item: item[1].offset):
        if loc.offset - base != expected_begin:
            raise CheckpointError(f"corrupt header in {path}: tensor {name!r} starts at {loc.offset - base}, "
                                  f"expected {expected_begin}")
        expected_begin += loc.nbytes
    return _Shard(path, size, prefix + raw, entries)


def _summary(names: list[str], limit: int = 3) -> str:
    if not names:
        return "no tensors"
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _pread_exact(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `offset`; returns the bytes read (fewer only at end of file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def _read(loc: TensorLocation, stored: str, pieces: list[_Piece], shape: tuple[int, ...]) -> torch.Tensor:
    """Fill one host tensor of `shape` from `pieces` of the stored tensor at `loc`."""
    read = TensorRead(stored, stored, loc, tuple(pieces), shape)
    host = torch.empty(read.nbytes, dtype=torch.uint8)
    with open(loc.path, "rb", buffering=0) as f:
        read.read_into(f.fileno(), memoryview(host.numpy()), 0, read.nbytes)
    return host.view(loc.dtype).reshape(shape)


@dataclass(frozen=True)
class TensorRead:
    """How diffusers parameter `name` is read: byte `pieces` of the stored tensor `stored` at `location`, each
    to its offset in the diffusers tensor of `shape` (dtype: the stored one). Parallel loaders split a tensor
    into byte ranges of its diffusers layout (`read_into(fd, view, begin, end)`), so any number of threads can
    fill one tensor, each range straight into its destination (or a staging buffer)."""

    name: str
    stored: str
    location: TensorLocation
    pieces: tuple[_Piece, ...]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.location.dtype

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.pieces)

    def read_into(self, fd: int, view: memoryview, begin: int, end: int) -> None:
        """Fill `view` (len `end - begin`) with bytes [begin, end) of the diffusers tensor from the shard open
        as `fd`; CheckpointError naming the shard when it is cut short."""
        for piece in self.pieces:  # the pieces tile [0, nbytes) of the target: copy each one's overlap
            lo, hi = max(begin, piece.target_offset), min(end, piece.target_offset + piece.nbytes)
            if lo >= hi:
                continue
            file_offset = self.location.offset + piece.source_offset + (lo - piece.target_offset)
            if _pread_exact(fd, view[lo - begin:hi - begin], file_offset) != hi - lo:
                raise CheckpointError(f"truncated shard {self.location.path}: tensor {self.stored!r} needs bytes up "
                                      f"to {self.location.offset + self.location.nbytes}, the file has "
                                      f"{os.fstat(fd).st_size}")


# ---------------------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------------------


class TransformerWeights:
    """Lazy access to a transformer directory of either layout, under diffusers names.

    Construction reads only config.json, the index and each shard's header (CheckpointError if any is
    missing or malformed); tensor data is read on demand by `tensor`.
    """

    def __init__(self, transformer_dir: str | os.PathLike, layout: Layout | str):
        self.transformer_dir = Path(transformer_dir)
        self.layout = Layout(layout)
        config_path = self.transformer_dir / CONFIG_FILE
        try:
            self._config_bytes = config_path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{config_path} is missing (not a MiniMax-H3 transformer directory?)") from None
        self.config = H3TransformerConfig.from_json(self._config_bytes, self.layout, config_path)
        self._index_bytes, self.weight_map = self._read_index()
        by_file: dict[str, list[str]] = {}
        for name, fname in self.weight_map.items():
            by_file.setdefault(fname, []).append(name)
        self._shards = {fname: _parse_shard(self.transformer_dir / fname, names)
                        for fname, names in sorted(by_file.items())}

    def _read_index(self) -> tuple[bytes, dict[str, str]]:
        index_path = self.transformer_dir / INDEX_FILE[self.layout]
        single_path = self.transformer_dir / SINGLE_FILE[self.layout]
        if not index_path.is_file():
            if not single_path.is_file():
                raise CheckpointError(f"{self.transformer_dir} has neither {index_path.name} nor {single_path.name} "
                                      f"(not a {self.layout.value}-layout transformer?)")
            names = [n for n in _parse_shard(single_path, []).entries]
            return b"", {name: single_path.name for name in names}
        raw = index_path.read_bytes()
        try:
            weight_map = json.loads(raw)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError("weight_map is not an object of file names")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid index: {e!r}") from None
        for fname in set(weight_map.values()):
            if Path(fname).name != fname:  # a shard outside the directory is never read
                raise CheckpointError(f"{index_path} names shard {fname!r} outside {self.transformer_dir}")
        return raw, dict(weight_map)

    # --- Names -----------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The diffusers parameter names of the model this config describes, in model order."""
        return list(parameter_specs(self.config))

    def source(self, name: str) -> StoredSource:
        """The stored tensor behind diffusers parameter `name` in this layout."""
        if name not in parameter_specs(self.config):
            raise CheckpointError(f"{name!r} is not a parameter of the transformer in {self.transformer_dir}")
        if self.layout is Layout.DIFFUSERS:
            return StoredSource(name, Transform.VERBATIM)
        return native_source(name)

    def _stored_location(self, stored: str, wanted: str) -> TensorLocation:
        fname = self.weight_map.get(stored)
        for_wanted = "" if stored == wanted else f" (for {wanted!r})"
        if fname is None:
            raise CheckpointError(f"tensor {stored!r}{for_wanted} is not in the index of {self.transformer_dir}")
        loc = self._shards[fname].entries.get(stored)
        if loc is None:
            raise CheckpointError(f"tensor {stored!r}{for_wanted}: the index maps it to "
                                  f"{self.transformer_dir / fname}, whose header lacks it")
        return loc

    # --- Data ------------------------------------------------------------------------------------------

    def location(self, name: str) -> TensorLocation:
        """The absolute byte range of diffusers parameter `name`; only for tensors stored verbatim (every AdaLN
        projection in both layouts). CheckpointError for a tensor cut from a differently laid out one."""
        source = self.source(name)
        loc = self._stored_location(source.name, name)
        if source.transform is not Transform.VERBATIM:
            raise CheckpointError(f"tensor {name!r} has no single byte range: it is {source.transform.value} of "
                                  f"{source.name!r} in {loc.path}")
        return loc

    def tensor(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Read diffusers parameter `name` in its stored dtype, laid out as diffusers expects, onto `device`.

        One host buffer of the tensor's size is filled by preads of its pieces and moved to `device`."""
        read = self.read_plan(name)
        return _read(read.location, read.stored, list(read.pieces), read.shape).to(device)

    def read_plan(self, name: str) -> TensorRead:
        """How diffusers parameter `name` is read (its stored tensor checked against the expected shape)."""
        source = self.source(name)
        loc = self._stored_location(source.name, name)
        shape = parameter_specs(self.config)[name].shape
        if loc.shape != stored_shape(source.transform, shape):
            raise CheckpointError(f"shape mismatch for tensor {source.name!r} in {loc.path}: {list(loc.shape)}, "
                                  f"expected {list(stored_shape(source.transform, shape))}")
        pieces = _pieces(source.transform, loc, self.config.num_attention_heads)
        return TensorRead(name, source.name, loc, tuple(pieces), shape)

    def stored_tensor(self, stored: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Read a tensor by its stored name, as stored (e.g. a native `blocks.0.attn.qkv_proj.weight`)."""
        loc = self._stored_location(stored, stored)
        return _read(loc, stored, [_Piece(0, loc.nbytes, 0)], loc.shape).to(device)

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex chars identifying these weights: the config, the index, every shard's name, size and header,
        and FINGERPRINT_SAMPLE_BYTES from the start, middle and end of every tensor.

        The samples are there because headers alone are identical for every checkpoint of one architecture
        (two seeds, two fine-tunes); a few hundred KB of reads (~3 pages per tensor) tell them apart. Equal for
        byte-identical copies wherever they are."""
        h = hashlib.sha256()
        for part in (self.layout.value.encode(), self._config_bytes, self._index_bytes):
            h.update(len(part).to_bytes(8, "little") + part)
        for fname, shard in self._shards.items():
            h.update(fname.encode() + shard.size.to_bytes(8, "little") + shard.header)
            with open(shard.path, "rb", buffering=0) as f:
                # Random access: without this hint each 64-byte sample can trigger a multi-MB readahead, which on a
                # cold 66 GB checkpoint would pull GBs into the page cache at start for a few hundred KB read.
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                for name, loc in sorted(shard.entries.items()):
                    sample = min(FINGERPRINT_SAMPLE_BYTES, loc.nbytes)
                    for offset in sorted({0, (loc.nbytes - sample) // 2, loc.nbytes - sample}):
                        buf = bytearray(sample)
                        got = _pread_exact(f.fileno(), memoryview(buf), loc.offset + offset)
                        h.update(bytes(buf[:got]))
        return h.hexdigest()[:16]

    # --- Validation ------------------------------------------------------------------------------------

    def validate(self, expect: H3TransformerConfig | None = None, with_adaln: bool = True) -> None:
        """Check from shard headers only (no tensor data read): the config against `expect`, every tensor the
        model needs is present (AdaLN projections only if `with_adaln`) with the right shape and dtype, no
        tensor is unexpected, no shard is truncated. CheckpointError listing every problem, each naming the
        tensor and the file."""
        problems: list[str] = []
        config_path = self.transformer_dir / CONFIG_FILE
        if expect is not None and expect != self.config:
            diffs = [f"{k}={getattr(self.config, k)!r} (expected {getattr(expect, k)!r})"
                     for k in H3TransformerConfig.model_fields if getattr(self.config, k) != getattr(expect, k)]
            problems.append(f"config mismatch in {config_path}: {', '.join(diffs)}")

        expected = self._expected_stored()
        index_name = INDEX_FILE[self.layout] if self._index_bytes else SINGLE_FILE[self.layout]
        for stored, (spec, wanted) in expected.items():
            for_wanted = "" if wanted == [stored] else f" (for {_summary(wanted)})"
            optional = not wanted or (not with_adaln and all(is_adaln_param(n) for n in wanted))
            if optional and stored not in self.weight_map:
                continue
            fname = self.weight_map.get(stored)
            if fname is None:
                problems.append(f"missing tensor {stored!r}{for_wanted}: not in {self.transformer_dir / index_name}")
                continue
            loc = self._shards[fname].entries.get(stored)
            if loc is None:
                problems.append(f"missing tensor {stored!r}{for_wanted}: the index maps it to "
                                f"{self.transformer_dir / fname}, whose header lacks it")
                continue
            if loc.shape != spec.shape:
                problems.append(f"shape mismatch for tensor {stored!r}{for_wanted} in {loc.path}: "
                                f"{list(loc.shape)}, expected {list(spec.shape)}")
            if loc.dtype != spec.dtype:
                problems.append(f"dtype mismatch for tensor {stored!r}{for_wanted} in {loc.path}: "
                                f"{loc.dtype}, expected {spec.dtype}")

        for stored, fname in self.weight_map.items():
            if stored not in expected:
                problems.append(f"unexpected tensor {stored!r} in {self.transformer_dir / fname}")
        for fname, shard in self._shards.items():
            for stored in shard.entries:
                if self.weight_map.get(stored) != fname:
                    problems.append(f"unexpected tensor {stored!r} in {shard.path}: its header has it, the index does not")
            if shard.size < shard.data_end:
                cut = [n for n, loc in shard.entries.items() if loc.offset + loc.nbytes > shard.size]
                problems.append(f"truncated shard {shard.path}: {shard.size} bytes, its header needs "
                                f"{shard.data_end}; tensors cut off: {_summary(cut)}")
        if problems:
            raise CheckpointError(f"invalid transformer checkpoint {self.transformer_dir} "
                                  f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems))

    def _expected_stored(self) -> dict[str, tuple[ParamSpec, list[str]]]:
        """Stored name -> (its spec, the diffusers parameters read from it)."""
        expected: dict[str, tuple[ParamSpec, list[str]]] = {}
        for name, spec in parameter_specs(self.config).items():
            source = self.source(name)
            if source.name in expected:
                expected[source.name][1].append(name)
            else:
                expected[source.name] = (ParamSpec(stored_shape(source.transform, spec.shape), spec.dtype), [name])
        if self.layout is Layout.NATIVE:
            # optional (wanted by no parameter), shape- and dtype-checked when present
            expected[NATIVE_ROPE_INV_FREQ] = (ParamSpec((self.config.rope_freq_dim,), torch.float32), [])
        return expected
