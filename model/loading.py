"""Build diffusers' `MiniMaxH3Transformer3DModel` from a checkpoint of either layout, read by parallel threads.

The model is created with its parameters on the meta device (no memory), then every parameter is read from the
checkpoint in its published dtype (bf16 blocks; fp32 patch projections, timestep MLP and output heads) by
`num_readers` threads, each taking the next byte range (at most `chunk_bytes`) of any tensor:

- to the CPU: `os.preadv` straight into the destination tensor (no mmap, no second copy);
- to a GPU (`device.streams.Device`): `preadv` into one of the thread's two pinned staging buffers, then an
  asynchronous copy on the thread's own stream into the destination, so reading the next range overlaps the
  copy of the last one and the copies run at pinned bandwidth (pageable `.to(device)` per tensor: 8.4 GB/s on
  an H200, one reader thread from page cache: ~6 GB/s; 16 readers into pinned memory: ~39 GB/s,
  shared/reference.md). Host memory holds the staging buffers only, never a copy of the transformer.

Readers are plain threads: `preadv` and the copies release the GIL. Bit for bit what `TransformerWeights.tensor`
(one host tensor, then `.to(device)`) gives; `num_readers=1` on the CPU is that serial reader.

Parameters for which `skip(name)` is true are left on meta for the caller to replace (AdaLN projections
served from a plan cache, blocks offloaded to pinned host memory).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from accelerate import init_empty_weights
from diffusers import MiniMaxH3Transformer3DModel

from device.pinned import PinnedMemory
from device.streams import Device, Event, make_device
from model.layout import CheckpointError, Layout
from model.weights import NATIVE_ROPE_INV_FREQ, TensorRead, TransformerWeights, is_adaln_param

#: Reader threads (16 readers reach ~39 GB/s from page cache into pinned memory on the H200 host; on a cold
#: disk more readers do not hurt: shared/reference.md).
DEFAULT_NUM_READERS = 16
#: Largest byte range one reader takes at a time (also the size of each of its two staging buffers).
DEFAULT_CHUNK_BYTES = 32 << 20


def load_transformer(
    weights: TransformerWeights, device: str | torch.device, *, skip: Callable[[str], bool] | None = None,
    staging: Device | None = None, num_readers: int = DEFAULT_NUM_READERS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> MiniMaxH3Transformer3DModel:
    """Validate `weights` (headers only), then build the transformer on `device`, in eval mode, frozen.

    `staging`: how tensors reach the device (its `Device`: pinned staging buffers and copy streams); by default
    `make_device(device)` for a GPU and none on a CPU, where the readers fill the parameters in place (tests
    pass a `FakeDevice` with `device="cpu"` to run the staged path on a CPU)."""
    names = weights.names()
    skipped = {name for name in names if skip is not None and skip(name)}
    weights.validate(with_adaln=not any(is_adaln_param(name) for name in skipped))

    # Parameters on meta; buffers (rope.inv_freq, computed from the config) real, as diffusers' own loader does.
    with init_empty_weights(include_buffers=False):
        model = MiniMaxH3Transformer3DModel.from_config(weights.config.model_dump())
    model.rope.to(device)
    if weights.layout is Layout.NATIVE:
        _check_rope(weights, model)

    reads = [weights.read_plan(name) for name in names if name not in skipped]
    if staging is None and torch.device(device).type != "cpu":
        staging = make_device(device)
    tensors = read_tensors(reads, num_readers=num_readers, chunk_bytes=chunk_bytes, staging=staging)
    modules = dict(model.named_modules())
    for read, tensor in zip(reads, tensors):
        module_name, _, leaf = read.name.rpartition(".")
        modules[module_name].register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class _Range:
    """Bytes [begin, end) of tensor `index` (in its diffusers layout)."""

    index: int
    begin: int
    end: int


def _ranges(reads: list[TensorRead], chunk_bytes: int) -> Iterator[_Range]:
    # Largest tensors first, so the last ranges handed out are small and the readers finish together.
    for index in sorted(range(len(reads)), key=lambda i: -reads[i].nbytes):
        for begin in range(0, reads[index].nbytes, chunk_bytes):
            yield _Range(index, begin, min(begin + chunk_bytes, reads[index].nbytes))


def read_tensors(reads: list[TensorRead], *, num_readers: int = DEFAULT_NUM_READERS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, staging: Device | None = None) -> list[torch.Tensor]:
    """Every tensor of `reads`, filled by `num_readers` threads: on the CPU in place (`staging` None), else on
    `staging`'s device through pinned staging buffers. The first reader error is raised once all stopped."""
    if num_readers < 1 or chunk_bytes < 1:
        raise ValueError(f"num_readers ({num_readers}) and chunk_bytes ({chunk_bytes}) must be >= 1")
    if staging is None:
        flat = [torch.empty(read.nbytes, dtype=torch.uint8) for read in reads]  # pages touched by the readers
    else:
        flat = [staging.empty(read.nbytes // read.dtype.itemsize, read.dtype).view(torch.uint8) for read in reads]
    work = _ranges(reads, chunk_bytes)
    lock = threading.Lock()
    errors: list[BaseException] = []
    files = _Files()

    def next_range() -> _Range | None:
        with lock:
            return None if errors else next(work, None)

    def reader() -> None:
        try:
            if staging is None:
                while (r := next_range()) is not None:
                    view = memoryview(flat[r.index].numpy())[r.begin:r.end]
                    reads[r.index].read_into(files.fd(reads[r.index].location.path), view, r.begin, r.end)
            else:
                _staged_reader(staging, reads, flat, next_range, files, chunk_bytes)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=reader, name=f"load-reader-{i}", daemon=True)
               for i in range(min(num_readers, max(1, sum(-(-read.nbytes // chunk_bytes) for read in reads))))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        files.close()
    if errors:
        raise errors[0]
    return [tensor.view(read.dtype).reshape(read.shape) for read, tensor in zip(reads, flat)]


def _staged_reader(device: Device, reads: list[TensorRead], flat: list[torch.Tensor],
                   next_range: Callable[[], _Range | None], files: _Files, chunk_bytes: int) -> None:
    """One reader of the staged path: preadv into a pinned buffer, copy it on this thread's stream, alternate
    between two buffers so the next read overlaps the last copy."""
    stream = device.new_stream("load")
    pinned = PinnedMemory(device, owner="checkpoint load staging")
    buffers = [pinned.staging((chunk_bytes,), torch.uint8) for _ in range(2)]
    copied: list[Event | None] = [None, None]  # the copy that last read each buffer
    k = 0
    try:
        while (r := next_range()) is not None:
            if copied[k] is not None:
                copied[k].synchronize()  # else the read below overwrites bytes its last copy has not taken yet
            n = r.end - r.begin
            buffer = buffers[k][:n]
            reads[r.index].read_into(files.fd(reads[r.index].location.path), memoryview(buffer.numpy()),
                                     r.begin, r.end)
            with device.use_stream(stream):
                device.copy_(flat[r.index][r.begin:r.end], buffer)
                copied[k] = stream.record_event()
            k = 1 - k
    finally:
        # Every copy done before the tensors are used (on any stream) and before the staging memory is reused.
        stream.synchronize()


class _Files:
    """One read-only descriptor per shard, shared by the readers (`preadv` takes its own offset)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _check_rope(weights: TransformerWeights, model: MiniMaxH3Transformer3DModel) -> None:
    """A native checkpoint stores `rope.inv_freq`; diffusers recomputes it from rope_theta. They must agree
    bit for bit, or the config's rope_theta is not the one the weights were trained with."""
    if NATIVE_ROPE_INV_FREQ not in weights.weight_map:
        return
    stored = weights.stored_tensor(NATIVE_ROPE_INV_FREQ)
    computed = model.rope.inv_freq.cpu()
    if stored.shape != computed.shape or not torch.equal(stored, computed):
        raise CheckpointError(
            f"{NATIVE_ROPE_INV_FREQ} in {weights.transformer_dir} is {stored.tolist()}, but the config's "
            f"rope_theta={weights.config.rope_theta} and rope_freq_dim={weights.config.rope_freq_dim} give "
            f"{computed.tolist()}")
