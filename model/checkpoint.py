"""Sharded safetensors checkpoints: a streaming seeded writer and a lazy, validating reader.

Layout of a checkpoint directory (HF style):
    config.json                                 DiTConfig dump
    model.safetensors.index.json                {"metadata": {...}, "weight_map": {name: shard file}}
    model-00001-of-0000n.safetensors            everything that is not a DiT block
    model-0000(i+2)-of-0000n.safetensors        blocks.{i}.*  (one shard per block, n = num_blocks + 1)

Index metadata: total_size (bytes of tensor data), format "ditserve", contents "full" | "adaln", seed,
tensor_sha256 {name: sha256 of the tensor's bytes} (checked by `validate(deep=True)`; per tensor rather than
per shard so a bit flip is reported with the tensor it hit).

A shard is a plain safetensors file: 8-byte little-endian header length N, N bytes of JSON header
({name: {dtype, shape, data_offsets: [begin, end]}}, offsets relative to the end of the header), then the data.
The reader parses headers itself so `location(name)` can hand out absolute byte ranges to parallel readers.

CLI:
    python -m model.checkpoint make --preset tiny --out DIR --seed 0 [--num-blocks N] [--only adaln]
    python -m model.checkpoint validate DIR [--deep]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import struct
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from pydantic import ValidationError
from tqdm import tqdm

from model.config import PRESET_NAMES, DiTConfig, preset
from model.dit import DiT, ParamSpec, is_adaln_proj, is_adaln_rebuild_input, parameter_specs
from model.init import init_rule, seeded_tensor

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
FORMAT = "ditserve"
CONTENTS = ("full", "adaln")
#: Largest JSON header accepted (safetensors uses the same bound).
MAX_HEADER_BYTES = 100_000_000

_DTYPE_TO_ST = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as is; the message names the tensor(s) and the file(s)."""


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes live: `nbytes` bytes at absolute `offset` in `path`."""

    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def shard_name(shard: int, num_shards: int) -> str:
    """shard is 0-based: 0 holds the non-block tensors, i+1 holds blocks.{i}."""
    return f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"


def shard_of(name: str) -> int:
    """0-based shard index of a parameter: blocks.{i}.* -> i+1, everything else -> 0."""
    if name.startswith("blocks."):
        return int(name.split(".", 2)[1]) + 1
    return 0


@functools.lru_cache(maxsize=8)
def _specs(config: DiTConfig) -> dict[str, ParamSpec]:
    return parameter_specs(config, with_adaln=True)


def checkpoint_specs(config: DiTConfig, contents: str = "full") -> dict[str, ParamSpec]:
    """The tensors a checkpoint of `contents` holds, in write order."""
    specs = _specs(config)
    if contents == "adaln":
        return {n: s for n, s in specs.items() if is_adaln_rebuild_input(n)}
    return dict(specs)


# ---------------------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------------------


def _header_bytes(specs: dict[str, ParamSpec], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """safetensors header (padded with spaces to 8 bytes) and each tensor's byte size, in order."""
    header: dict = {"__metadata__": metadata}
    sizes, offset = [], 0
    for name, spec in specs.items():
        nbytes = math.prod(spec.shape) * spec.dtype.itemsize
        header[name] = {"dtype": _DTYPE_TO_ST[spec.dtype], "shape": list(spec.shape),
                        "data_offsets": [offset, offset + nbytes]}
        sizes.append(nbytes)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, sizes


def make_checkpoint(
    out: str | os.PathLike, config: DiTConfig, *, seed: int = 0, only: str | None = None,
    progress: bool = False, workers: int | None = None,
) -> Path:
    """Write a seeded checkpoint whose tensors equal `DiT(config, seed=seed)`'s parameters.

    Streams tensor by tensor (generated straight in their dtype from per-chunk seeded generators, in a
    thread pool), so memory stays at ~2 tensors even for h3. Same seed and config -> identical bytes.
    `only="adaln"` writes just the AdaLN rebuild inputs (time_embed.*, *.adaln_proj.*).
    The index is written last: an interrupted make leaves no index and no reader accepts it.
    """
    contents = "adaln" if only == "adaln" else "full"
    if only not in (None, "full", "adaln"):
        raise ValueError(f"only must be 'adaln' or None, got {only!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX_FILE).unlink(missing_ok=True)  # no stale index may describe half-written shards

    specs = checkpoint_specs(config, contents)
    num_shards = config.num_blocks + 1
    by_shard: list[dict[str, ParamSpec]] = [{} for _ in range(num_shards)]
    for name, spec in specs.items():
        by_shard[shard_of(name)][name] = spec
    total = sum(math.prod(s.shape) * s.dtype.itemsize for s in specs.values())

    weight_map: dict[str, str] = {}
    tensor_sha256: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"make {config.name}", disable=not progress)
    workers = workers or min(32, os.cpu_count() or 1)
    # pool fills chunks of one tensor; `ahead` generates tensor k+1 while k is written; `hasher` hashes k
    # while it is written (hashlib and file writes both release the GIL on large buffers).
    with ThreadPoolExecutor(workers) as pool, ThreadPoolExecutor(1) as ahead, ThreadPoolExecutor(1) as hasher:
        for shard, shard_specs in enumerate(by_shard):
            if not shard_specs:
                continue
            fname = shard_name(shard, num_shards)
            header, _ = _header_bytes(shard_specs, {"format": "pt"})

            def generate(name: str) -> torch.Tensor:
                spec = shard_specs[name]
                mean, std = init_rule(name, spec.shape, config)
                return seeded_tensor(name, spec.shape, spec.dtype, mean=mean, std=std, seed=seed, pool=pool)

            names = list(shard_specs)
            with open(out / fname, "wb") as f:
                f.write(header)
                pending: Future = ahead.submit(generate, names[0])
                for k, name in enumerate(names):
                    tensor = pending.result()
                    if k + 1 < len(names):
                        pending = ahead.submit(generate, names[k + 1])
                    data = memoryview(tensor.view(-1).view(torch.uint8).numpy())
                    hashed = hasher.submit(lambda d: hashlib.sha256(d).hexdigest(), data)
                    f.write(data)
                    tensor_sha256[name] = hashed.result()
                    bar.update(len(data))
                    weight_map[name] = fname
                    del tensor, data
    bar.close()

    (out / CONFIG_FILE).write_text(config.model_dump_json(indent=2) + "\n")
    index = {
        "metadata": {"total_size": total, "format": FORMAT, "contents": contents, "seed": seed,
                     "tensor_sha256": tensor_sha256},
        "weight_map": weight_map,
    }
    tmp = out / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    tmp.replace(out / INDEX_FILE)
    return out


# ---------------------------------------------------------------------------------------------------------
# Reader
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


def _parse_shard(path: Path, expected_names: list[str]) -> _Shard:
    """Parse one shard's header into absolute locations; CheckpointError on anything malformed."""
    held = f"(holds {_names_summary(expected_names)})"
    if not path.is_file():
        raise CheckpointError(f"shard {path.name} {held} is missing from {path.parent}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"corrupt header in {path}: file is {size} bytes, shorter than the length field {held}")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"corrupt header in {path}: header length {n} does not fit the {size}-byte file {held}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt header in {path}: {e} {held}") from None

    base = 8 + n
    entries: dict[str, TensorLocation] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_TO_DTYPE[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"corrupt header in {path}: bad entry for tensor {name!r} ({e!r})") from None
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            raise CheckpointError(
                f"corrupt header in {path}: tensor {name!r} offsets {begin}..{end} do not match "
                f"shape {list(shape)} {info['dtype']}"
            )
        entries[name] = TensorLocation(path, base + begin, end - begin, dtype, shape)
        spans.append((begin, end, name))
    # Data must be contiguous from offset 0, without overlaps (what safetensors itself enforces).
    expected_begin = 0
    for begin, end, name in sorted(spans):
        if begin != expected_begin:
            raise CheckpointError(f"corrupt header in {path}: tensor {name!r} starts at {begin}, expected {expected_begin}")
        expected_begin = end
    return _Shard(path, size, prefix + raw, entries)


def _names_summary(names: Iterable[str], limit: int = 3) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "") if names else "no tensors"


class CheckpointReader:
    """Lazy access to a checkpoint directory. Construction reads only config.json, the index and each
    shard's header (CheckpointError if any is malformed); tensor data is read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        config_path, index_path = self.path / CONFIG_FILE, self.path / INDEX_FILE
        try:
            self._config_bytes = config_path.read_bytes()
            self.config = DiTConfig.model_validate_json(self._config_bytes)
        except FileNotFoundError:
            raise CheckpointError(f"{config_path} is missing (not a ditserve checkpoint?)") from None
        except ValidationError as e:
            raise CheckpointError(f"{config_path} is not a valid DiTConfig: {e}") from None
        try:
            self._index_bytes = index_path.read_bytes()
            index = json.loads(self._index_bytes)
            self.weight_map: dict[str, str] = dict(index["weight_map"])
            self.metadata: dict = dict(index.get("metadata", {}))
        except FileNotFoundError:
            raise CheckpointError(f"{index_path} is missing (unfinished make?)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid index: {e!r}") from None
        self.contents: str = self.metadata.get("contents", "full")
        if self.contents not in CONTENTS:
            raise CheckpointError(f"{index_path}: unknown contents {self.contents!r}")

        by_file: dict[str, list[str]] = {}
        for name, fname in self.weight_map.items():
            by_file.setdefault(fname, []).append(name)
        self._shards = {fname: _parse_shard(self.path / fname, names) for fname, names in sorted(by_file.items())}

    # --- Lookup ------------------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Tensor names in index order."""
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def location(self, name: str) -> TensorLocation:
        fname = self.weight_map.get(name)
        if fname is None:
            raise CheckpointError(f"tensor {name!r} is not in {self.path / INDEX_FILE}")
        loc = self._shards[fname].entries.get(name)
        if loc is None:
            raise CheckpointError(f"tensor {name!r}: the index maps it to {self.path / fname}, whose header lacks it")
        return loc

    def tensor(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Read one tensor (one pread of its byte range) and move it to `device`."""
        loc = self.location(name)
        buf = bytearray(loc.nbytes)
        with open(loc.path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buf], loc.offset) if loc.nbytes else 0
        if got != loc.nbytes:
            raise CheckpointError(f"truncated shard {loc.path}: tensor {name!r} needs {loc.nbytes} bytes, read {got}")
        if loc.nbytes == 0:
            return torch.empty(loc.shape, dtype=loc.dtype, device=device)
        return torch.frombuffer(buf, dtype=loc.dtype).reshape(loc.shape).to(device)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Stable id of the contents (config, index, each shard's size and header; no data read). The index
        holds each tensor's sha256 when written by make_checkpoint, so this covers the data as well."""
        h = hashlib.sha256()
        for part in (self._config_bytes, self._index_bytes):
            h.update(len(part).to_bytes(8, "little") + part)
        for fname, shard in sorted(self._shards.items()):
            h.update(fname.encode() + shard.size.to_bytes(8, "little") + shard.header)
        return h.hexdigest()[:16]

    # --- Validation --------------------------------------------------------------------------------------

    def validate(self, expect: DiTConfig | None = None, with_adaln: bool = True, deep: bool = False) -> None:
        """Raise CheckpointError listing every problem, each naming the tensor and the file:
        config mismatch, missing or unexpected keys, index/header disagreement, shape or dtype mismatch,
        truncated shard; with deep=True also each tensor's sha256 against the index (reads everything)."""
        problems: list[str] = []
        index_path = self.path / INDEX_FILE
        if expect is not None and expect != self.config:
            diffs = [f"{k}={getattr(self.config, k)!r} (expected {getattr(expect, k)!r})"
                     for k in DiTConfig.model_fields if getattr(self.config, k) != getattr(expect, k)]
            problems.append(f"config mismatch in {self.path / CONFIG_FILE}: {', '.join(diffs)}")

        specs = checkpoint_specs(self.config, self.contents)
        required = {n for n in specs if with_adaln or not is_adaln_proj(n)}
        num_shards = self.config.num_blocks + 1
        for name in specs:
            if name in required and name not in self.weight_map:
                problems.append(f"missing tensor {name!r}: not in {index_path} "
                                f"(expected in {shard_name(shard_of(name), num_shards)})")
        for name, fname in self.weight_map.items():
            if name not in specs:
                problems.append(f"unexpected tensor {name!r} in {self.path / fname}")
        for fname, shard in self._shards.items():
            for name in shard.entries:
                if self.weight_map.get(name) != fname:
                    problems.append(f"unexpected tensor {name!r} in {shard.path}: its header has it, the index does not")

        for name, fname in self.weight_map.items():
            loc = self._shards[fname].entries.get(name)
            if loc is None:
                problems.append(f"missing tensor {name!r}: the index maps it to {self.path / fname}, whose header lacks it")
                continue
            spec = specs.get(name)
            if spec is not None and loc.shape != spec.shape:
                problems.append(f"shape mismatch for tensor {name!r} in {loc.path}: {list(loc.shape)}, expected {list(spec.shape)}")
            if spec is not None and loc.dtype != spec.dtype:
                problems.append(f"dtype mismatch for tensor {name!r} in {loc.path}: {loc.dtype}, expected {spec.dtype}")

        for fname, shard in self._shards.items():
            if shard.size < shard.data_end:
                cut = [n for n, loc in shard.entries.items() if loc.offset + loc.nbytes > shard.size]
                problems.append(f"truncated shard {shard.path}: {shard.size} bytes, header needs {shard.data_end}; "
                                f"tensors cut off: {_names_summary(cut)}")

        if deep and not problems:
            problems += self._check_sha256()
        if problems:
            raise CheckpointError(f"invalid checkpoint {self.path} ({len(problems)} problem(s)):\n  " + "\n  ".join(problems))

    def _check_sha256(self) -> list[str]:
        recorded = self.metadata.get("tensor_sha256") or {}
        problems = []
        for name in self.weight_map:
            loc = self.location(name)
            if name not in recorded:
                problems.append(f"no sha256 recorded in {self.path / INDEX_FILE} for tensor {name!r} in {loc.path}")
                continue
            h = hashlib.sha256()
            with open(loc.path, "rb") as f:
                f.seek(loc.offset)
                left = loc.nbytes
                while left:
                    block = f.read(min(left, 1 << 24))
                    h.update(block)
                    left -= len(block)
            if h.hexdigest() != recorded[name]:
                problems.append(f"corrupt data for tensor {name!r} in {loc.path}: sha256 mismatch")
        return problems


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", with_adaln: bool = True) -> DiT:
    """Validate the checkpoint (shallow), then build the DiT on `device` from its tensors.
    with_adaln=False builds no adaln_proj modules and reads none of their bytes."""
    reader = CheckpointReader(path)
    reader.validate(with_adaln=with_adaln)
    if reader.contents != "full":
        raise CheckpointError(f"{reader.path / INDEX_FILE}: holds only {reader.contents!r} tensors, not a full model")
    model = DiT(reader.config, with_adaln=with_adaln, device="meta")
    state = {name: reader.tensor(name, device) for name, _ in model.named_parameters()}
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write a seeded checkpoint")
    make.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--num-blocks", type=int, default=None, help="override the preset's num_blocks")
    make.add_argument("--only", choices=["adaln"], default=None,
                      help="write only the AdaLN rebuild inputs (time_embed.*, *.adaln_proj.*)")
    make.add_argument("--workers", type=int, default=None, help="generator threads (default: all cores)")
    make.add_argument("--no-progress", action="store_true")
    check = sub.add_parser("validate", help="validate a checkpoint directory")
    check.add_argument("dir")
    check.add_argument("--deep", action="store_true", help="also verify each tensor's sha256 (reads everything)")
    args = parser.parse_args(argv)

    if args.command == "make":
        overrides = {} if args.num_blocks is None else {"num_blocks": args.num_blocks}
        config = preset(args.preset, **overrides)
        out = make_checkpoint(args.out, config, seed=args.seed, only=args.only,
                              progress=not args.no_progress, workers=args.workers)
        reader = CheckpointReader(out)
        print(f"wrote {out} ({reader.metadata['total_size'] / 1e9:.3f} GB, {len(reader.keys())} tensors, "
              f"fingerprint {reader.fingerprint})")
        return 0
    try:
        reader = CheckpointReader(args.dir)
        reader.validate(deep=args.deep)
    except CheckpointError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"ok {reader.path} ({reader.contents}, fingerprint {reader.fingerprint})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
