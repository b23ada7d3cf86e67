"""Online rebuild: stream every block's `adaln_proj.linear` from the checkpoint and project the missing plans.

One pass over the checkpoint serves every missing plan of a request. Per unit (blocks 0..N-1's
`transformer_blocks.{i}.adaln_proj.linear`, then the final layer's `norm_out.linear`):

    readers (thread pool, os.preadv)  : checkpoint bytes -> pinned staging[k]          (unit i+1, i+2...)
    copy stream                       : staging[k] -> device weight buffer[k]            (unit i)
    compute stream                    : per plan, F.linear with exactly M rows -> slab   (unit i)

with k = i % staging_buffers, so reading unit i+1 overlaps the copy and the GEMMs of unit i. Peak memory is
`staging_buffers` units (weight + bias) pinned on the host and as many on the device: 2 x 520 MB each for
H3 with the default 2 buffers, never the 26 GB of all projections. Units whose pages are not in the page
cache are read with O_DIRECT (see `_Files`).

Measured on one H200 at H3 AdaLN scale (26.08 GB, 49 plans of width 2; bench/results/adaln-nvidia-h200.md):
0.78-0.85 s from the page cache (sglang: 8.46 s; floor ~0.66 s), 13.5 s from a cold disk (1.02 x bytes/disk
bandwidth).

Bit-exactness: each plan gets its own `project()` call (cache/projection.py) with the same M rows the
resident path uses; the weight crosses disk and PCIe once per unit and is re-read from HBM once per plan
(~7 ms per unit for 49 plans, hidden under the next unit's read). Plans are never batched into one GEMM:
a different M lets cuBLAS pick a different kernel, and no batching could be shown to give the same bits.
Weights are viewed at 4 KiB-aligned offsets of the device buffer, like a caching-allocator block, so
alignment-based kernel choices match too.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from cache.residency import page_cache_bytes
from cache.projection import Projection, prepare_weight, project, projection_guard
from device.pinned import PinnedMemory
from device.streams import Device, Event

if TYPE_CHECKING:  # model/ is only needed for types here (the ingress imports this module for RebuildError)
    from model.adaln import AdalnDims
    from model.weights import TensorLocation

_ALIGN = 4096
_MIN_CHUNK = 1 << 20

class RebuildError(ValueError):
    """The checkpoint cannot provide an adaln tensor (missing, wrong shape or dtype, short read)."""


class TensorLocator(Protocol):
    """Where a checkpoint keeps each tensor's bytes (`model.weights.TransformerWeights`); `location` raises a
    ValueError (`model.layout.CheckpointError`) for a tensor it cannot place."""

    def location(self, name: str) -> TensorLocation: ...


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Span:
    """A tensor's bytes in a checkpoint shard."""

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, location: TensorLocation) -> "Span":
        """From a `TensorLocator.location(...)` result."""
        return cls(os.fspath(location.path), int(location.offset), int(location.nbytes), location.dtype,
                   tuple(int(s) for s in location.shape))


@dataclass(frozen=True)
class AdalnUnit:
    """One projection to stream: a block's (`block` = its index) or the final layer's (`block` None)."""

    name: str
    block: int | None  # None for the final layer
    weight: Span
    bias: Span

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.bias.nbytes

    @property
    def staging_bytes(self) -> int:
        """Host staging bytes: the weight's 4 KiB-aligned superset (for O_DIRECT), then the bias."""
        return _align(self.weight.nbytes) + _ALIGN + self.bias.nbytes


def resolve_adaln_units(reader: TensorLocator, dims: AdalnDims,
                        unit_names: Sequence[tuple[str, int | None]]) -> list[AdalnUnit]:
    """Locate and check every adaln tensor of `reader` against `dims` before any byte is read.

    `unit_names`: (module name, block index or None) per projection, blocks first (`AdalnModel.unit_names()`,
    `model.weights.adaln_unit_names`: `transformer_blocks.{i}.adaln_proj.linear`, then `norm_out.linear`); the
    tensors are `{name}.weight` and `{name}.bias`.
    Raises `RebuildError` naming the first missing tensor or wrong shape/dtype (and the file, when known).
    """
    units = []
    in_dim = dims.time_embed_dim
    for name, block in unit_names:
        width = dims.adaln_width if block is not None else dims.final_adaln_width
        spans = {}
        for part, shape in (("weight", (width, in_dim)), ("bias", (width,))):
            tensor_name = f"{name}.{part}"
            try:
                span = Span.of(reader.location(tensor_name))
            except RebuildError:
                raise
            except (KeyError, ValueError, OSError) as e:
                raise RebuildError(f"checkpoint has no usable tensor {tensor_name!r}: {e}") from e
            if span.shape != shape or span.dtype != dims.torch_dtype:
                raise RebuildError(
                    f"{tensor_name} in {span.path} is {span.dtype} {list(span.shape)}, expected "
                    f"{dims.torch_dtype} {list(shape)}"
                )
            if span.nbytes != math.prod(shape) * span.dtype.itemsize:
                raise RebuildError(f"{tensor_name} in {span.path}: {span.nbytes} bytes for shape {list(shape)}")
            spans[part] = span
        units.append(AdalnUnit(name, block, spans["weight"], spans["bias"]))
    return units


@dataclass
class RebuildTarget:
    """One missing plan: its adaln input on the device and the slab rows it fills."""

    adaln_input: torch.Tensor  # [M, time_embed_dim], model dtype, on the device
    first_row: int              # rows first_row .. first_row + M - 1 of the slab


@dataclass
class RebuildReport:
    """What one rebuild did. `page_cache_bytes + disk_bytes == bytes_read` when the split is known (Linux:
    `cache.residency`, asked just before each range is read; O_DIRECT reads count as disk); both None when not."""

    bytes_read: int
    seconds: float
    num_units: int
    num_plans: int
    page_cache_bytes: int | None = None
    disk_bytes: int | None = None


def _pread_into(fd: int, view: memoryview, offset: int, need: int, path: str) -> None:
    """Fill `view` from `offset`; at least `need` bytes must arrive (an O_DIRECT read of the last aligned
    block may stop at end of file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            if done >= need:
                return
            raise RebuildError(f"short read in {path}: wanted {need} bytes at offset {offset}, got {done}")
        done += n


class _Files:
    """Open shard files of one rebuild: buffered fds, and O_DIRECT fds for units not in the page cache.

    Buffered reads from a cold disk reached ~1.7 GB/s on the H200 machine, O_DIRECT ~1.9 GB/s (the disk's
    sequential rate is 1.96); from the page cache buffered reads run at ~50 GB/s and O_DIRECT would go
    to disk. So with `direct_io="auto"` each unit is probed with RWF_NOWAIT (fails if a page is not cached).
    """

    def __init__(self, direct_io: str):
        self.direct_io = direct_io
        self._fds: dict[str, int] = {}
        self._direct: dict[str, int | None] = {}

    def fd(self, path: str) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:  # a shard deleted or unreadable since start: typed, like a short read
                raise RebuildError(f"cannot open checkpoint shard {path}: {e.strerror or e}") from e
        return self._fds[path]

    def direct_fd(self, path: str) -> int | None:
        """An O_DIRECT fd, or None where the filesystem refuses O_DIRECT (tmpfs)."""
        if path not in self._direct:
            try:
                self._direct[path] = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) \
                    if hasattr(os, "O_DIRECT") else None
            except OSError:
                self._direct[path] = None
        return self._direct[path]

    def cached(self, span: Span) -> bool:
        """Whether a few pages of `span` (at 1/8, 3/8, 5/8 and 7/8 of it) are in the page cache.

        Not its first, middle or last page: `TransformerWeights.fingerprint` reads exactly those of every
        tensor, so after fingerprinting they are cached however cold the rest of the unit is."""
        probe = bytearray(1)
        fd = self.fd(span.path)
        for eighth in (1, 3, 5, 7):
            offset = span.offset + span.nbytes * eighth // 8
            try:
                os.preadv(fd, [probe], offset, os.RWF_NOWAIT)
            except BlockingIOError:
                return False
            except (OSError, AttributeError):  # RWF_NOWAIT unsupported: assume cached (buffered reads)
                return True
        return True

    def page_cache_bytes(self, span: Span) -> int | None:
        """Bytes of `span` in the page cache now (None: unknown on this platform)."""
        return page_cache_bytes(self.fd(span.path), span.offset, span.nbytes)

    def use_direct(self, span: Span) -> int | None:
        if self.direct_io == "never" or (self.direct_io == "auto" and self.cached(span)):
            return None
        return self.direct_fd(span.path)

    def close(self) -> None:
        for fd in [*self._fds.values(), *(d for d in self._direct.values() if d is not None)]:
            os.close(fd)
        self._fds.clear()
        self._direct.clear()


class AdalnRebuilder:
    """Pipelined streaming projection (see the module docstring). Reuses its buffers across rebuilds.

    `rebuild(units, targets, blocks_out, final_out)` writes, for every target and unit, rows
    `first_row .. first_row+M-1` of `blocks_out[block]` (or `final_out`). On return the compute stream
    has finished every write (one host sync per rebuild, for `seconds`); on an exception nothing is
    committed and the caller gives the rows back.

    Staging layout of a unit: on the device the weight at 0 and the bias at `_align(weight bytes)` (so the
    weight is 4 KiB aligned, like a resident parameter); on the host the weight at `weight_src[k]` (0, or
    its offset inside the first 4 KiB block for an O_DIRECT read) and the bias at `_align(weight) + 4 KiB`.
    """

    def __init__(self, *, gpu: Device, readers: int = 16, chunk_bytes: int = 8 << 20,
                 direct_chunk_bytes: int = 32 << 20, num_buffers: int = 2, projection: Projection = "match",
                 direct_io: str = "auto"):
        self.gpu = gpu
        self._memory = PinnedMemory(gpu, owner="AdaLN rebuild staging")
        self.readers = readers
        self.chunk_bytes = chunk_bytes
        self.direct_chunk_bytes = max(_ALIGN, direct_chunk_bytes // _ALIGN * _ALIGN)
        self.num_buffers = num_buffers
        self.projection = projection
        self.direct_io = direct_io
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="adaln-reader")
        self._copy_stream = gpu.new_stream("copy")
        self._raw: list[torch.Tensor] = []  # what `_host` views (4 KiB aligned slices of it)
        self._host: list[torch.Tensor] = []
        self._device: list[torch.Tensor] = []
        self._host_views: list[memoryview] = []
        self._weight_src = [0] * num_buffers
        self._copied: list[Event | None] = [None] * num_buffers
        self._computed: list[Event | None] = [None] * num_buffers
        self.num_direct_units = 0  # units read with O_DIRECT so far (cumulative)
        self.num_staging_allocations = 0  # times the staging buffers were (re)allocated (cumulative)
        # Per rebuild: bytes queued for reading that were in the page cache / that go to the disk (None once
        # any range's residency was unknown).
        self._cached_bytes: int | None = 0
        self._disk_bytes: int | None = 0

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def warm_up_readers(self) -> None:
        """Start every reader thread now (a ThreadPoolExecutor starts them lazily, one per submit, on the
        first rebuild otherwise): `readers` tasks that each wait until all of them run."""
        barrier = threading.Barrier(self.readers)
        futures = [self._pool.submit(barrier.wait, 30.0) for _ in range(self.readers)]
        for f in futures:
            f.result()

    @property
    def staging_nbytes(self) -> int:
        """Bytes held by the host staging buffers (the device ones are as large)."""
        return sum(b.numel() for b in self._host)

    @staticmethod
    def _bias_src(unit: AdalnUnit) -> int:
        return _align(unit.weight.nbytes) + _ALIGN

    def reserve(self, nbytes: int) -> None:
        """Staging for units of up to `nbytes` (`AdalnUnit.staging_bytes`), allocated now unless already held
        (a rebuild calls it too; the engine calls it at start so no request pays for pinning and faulting in
        ~1 GB of host memory and the device buffers)."""
        if self._host and self._host[0].numel() >= nbytes:
            return
        self.num_staging_allocations += 1
        nbytes = _align(nbytes)
        for raw in self._raw:
            self._memory.free(raw)  # after the device finished the copies out of it
        self._raw, self._host = [], []
        for _ in range(self.num_buffers):
            # One extra block so the buffer can start 4 KiB aligned (O_DIRECT needs aligned addresses).
            raw, _ = self._memory.allocate((nbytes + _ALIGN,), torch.uint8)
            skip = -raw.data_ptr() % _ALIGN
            self._raw.append(raw)
            self._host.append(raw[skip: skip + nbytes])
        self._host_views = [memoryview(h.numpy()) for h in self._host]
        for h in self._host:  # fault the pages in now, not under the first rebuild's readers
            h.zero_()
        self._device = [self.gpu.empty(nbytes, torch.uint8) for _ in range(self.num_buffers)]
        self._copied = [None] * self.num_buffers
        self._computed = [None] * self.num_buffers

    def _submit_read(self, unit: AdalnUnit, k: int, files: _Files) -> list[Future]:
        """Queue the reads of `unit` into host staging `k`; sets `_weight_src[k]`."""
        view, futures = self._host_views[k], []

        def submit(fd: int, span_offset: int, nbytes: int, dst: int, chunk: int, need_end: int, path: str):
            for s in range(0, nbytes, chunk):
                n = min(chunk, nbytes - s)
                need = max(0, min(n, need_end - s))
                futures.append(self._pool.submit(
                    _pread_into, fd, view[dst + s: dst + s + n], span_offset + s, need, path))

        w, b = unit.weight, unit.bias
        direct = files.use_direct(w)
        self._count_residency(files, w, direct is not None)
        self._count_residency(files, b, False)
        if direct is not None:
            start = w.offset // _ALIGN * _ALIGN          # aligned superset of the weight's bytes
            delta = w.offset - start
            self._weight_src[k] = delta
            submit(direct, start, _align(delta + w.nbytes), 0, self.direct_chunk_bytes, delta + w.nbytes, w.path)
            self.num_direct_units += 1
        else:
            self._weight_src[k] = 0
            chunk = min(self.chunk_bytes, max(_MIN_CHUNK, -(-w.nbytes // self.readers)))
            submit(files.fd(w.path), w.offset, w.nbytes, 0, chunk, w.nbytes, w.path)
        submit(files.fd(b.path), b.offset, b.nbytes, self._bias_src(unit), max(b.nbytes, 1), b.nbytes, b.path)
        return futures

    def _count_residency(self, files: _Files, span: Span, direct: bool) -> None:
        """Add `span` to this rebuild's page-cache / disk bytes (an O_DIRECT read always goes to the disk)."""
        if self._cached_bytes is None:
            return
        cached = 0 if direct else files.page_cache_bytes(span)
        if cached is None:
            self._cached_bytes = self._disk_bytes = None
            return
        self._cached_bytes += cached
        self._disk_bytes += span.nbytes - cached

    def _operands(self, unit: AdalnUnit, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self._device[k]
        w, b = unit.weight, unit.bias
        weight = buf[: w.nbytes].view(w.dtype).view(w.shape)
        start = _align(w.nbytes)
        bias = buf[start: start + b.nbytes].view(b.dtype).view(b.shape)
        return weight, bias

    def rebuild(self, units: Sequence[AdalnUnit], targets: Sequence[RebuildTarget],
                blocks_out: torch.Tensor, final_out: torch.Tensor) -> RebuildReport:
        start = time.perf_counter()
        if not targets:
            return RebuildReport(0, 0.0, 0, 0)
        self.reserve(max(u.staging_bytes for u in units))
        compute = self.gpu.current_stream()
        copy = self._copy_stream
        S = self.num_buffers
        files = _Files(self.direct_io)
        self._cached_bytes, self._disk_bytes = 0, 0
        pending: dict[int, list[Future]] = {}
        try:
            # A previous rebuild's copies out of staging[k] must be done before readers refill it.
            for event in self._copied:
                if event is not None:
                    event.synchronize()
            for i in range(min(S, len(units))):
                pending[i] = self._submit_read(units[i], i % S, files)
            with projection_guard(self.projection):
                for i, unit in enumerate(units):
                    k = i % S
                    for f in pending.pop(i):
                        f.result()
                    if self._computed[k] is not None:
                        # device[k] still feeds the GEMMs of unit i-S; without this wait the copy would
                        # overwrite their weights mid-GEMM.
                        copy.wait_event(self._computed[k])
                    w_src, w_n, b_n = self._weight_src[k], unit.weight.nbytes, unit.bias.nbytes
                    b_src, b_dst = self._bias_src(unit), _align(w_n)
                    with self.gpu.use_stream(copy):
                        self.gpu.copy_(self._device[k][:w_n], self._host[k][w_src: w_src + w_n])
                        self.gpu.copy_(self._device[k][b_dst: b_dst + b_n], self._host[k][b_src: b_src + b_n])
                        self._copied[k] = copy.record_event()
                    # The GEMMs must not read device[k] before the copy lands (stale previous unit).
                    compute.wait_event(self._copied[k])
                    weight, bias = prepare_weight(*self._operands(unit, k), self.projection)
                    out = blocks_out[unit.block] if unit.block is not None else final_out
                    for target in targets:
                        m = target.adaln_input.shape[0]
                        rows = project(target.adaln_input, weight, bias, self.projection, out.dtype)
                        out[target.first_row: target.first_row + m].copy_(rows)
                    self._computed[k] = compute.record_event()
                    if i + S < len(units):
                        # The copy reads pinned staging[k] asynchronously; without this host wait the
                        # readers would overwrite it while the DMA is still in flight.
                        self._copied[k].synchronize()
                        pending[i + S] = self._submit_read(units[i + S], k, files)
            # One sync per rebuild: the slot may be published and `seconds` reported only once the
            # projections are written.
            compute.record_event().synchronize()
        finally:
            # Never leave a reader writing into staging after we return (the next rebuild reuses it).
            for futures in pending.values():
                for f in futures:
                    f.exception()
            files.close()
        return RebuildReport(
            bytes_read=sum(u.nbytes for u in units), seconds=time.perf_counter() - start,
            num_units=len(units), num_plans=len(targets), page_cache_bytes=self._cached_bytes,
            disk_bytes=self._disk_bytes,
        )
