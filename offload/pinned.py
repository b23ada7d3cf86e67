"""Consolidated host buffers for offloaded blocks (pinned through `device.pinned.PinnedMemory`, its budget).

A block's parameters and buffers are packed into one flat host tensor per dtype. Every tensor gets a
slot at an aligned offset and keeps its strides, so the device copy of the block is one copy per dtype
and each parameter is a strided view of the device buffer with the same layout it had before offloading
(same layout, same kernels, bit-identical results).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from device.pinned import PinnedMemory


@dataclass(frozen=True)
class TensorSlot:
    """Where one of a block's tensors lives inside the block's flat per-dtype buffer."""

    name: str  # name relative to the block, e.g. "attn.q.weight"
    is_buffer: bool  # a module buffer rather than a parameter
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of `dtype`, aligned
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """`t`'s strides when it is non-overlapping and dense (any dim order), else contiguous strides.

    A dense tensor occupies exactly `numel` elements from its storage offset, so its strides can be
    kept in a packed buffer; an overlapping or gappy view (e.g. `expand`) is stored contiguously.
    """
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: t.stride(d)):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return torch.empty(t.shape).stride()
        expected *= t.size(d)
    return tuple(t.stride())


@dataclass(frozen=True)
class BlockLayout:
    """The slots of one block and the size of its flat buffer per dtype."""

    slots: tuple[TensorSlot, ...]
    numel_per_dtype: dict[torch.dtype, int]

    @property
    def nbytes(self) -> int:
        """Bytes of the block's flat buffers, alignment padding included (= bytes of one load)."""
        return sum(n * dt.itemsize for dt, n in self.numel_per_dtype.items())

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @classmethod
    def build(cls, tensors: list[tuple[str, torch.Tensor, bool]], alignment_bytes: int) -> "BlockLayout":
        """Lay out `(name, tensor, is_buffer)` in order; offsets aligned to `alignment_bytes`."""
        ends: dict[torch.dtype, int] = {}
        slots = []
        for name, t, is_buffer in tensors:
            align = max(1, alignment_bytes // t.dtype.itemsize)
            start = -(-ends.get(t.dtype, 0) // align) * align
            slots.append(TensorSlot(name, is_buffer, t.dtype, tuple(t.shape), dense_stride(t), start, t.numel()))
            ends[t.dtype] = start + t.numel()
        # Pad each buffer's end too, so consecutive device allocations stay aligned for any allocator.
        numel = {dt: -(-n // max(1, alignment_bytes // dt.itemsize)) * max(1, alignment_bytes // dt.itemsize)
                 for dt, n in ends.items()}
        return cls(tuple(slots), numel)


def slot_view(flat: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The slot's tensor as a strided view of the flat buffer it lives in."""
    return flat.as_strided(slot.shape, slot.stride, slot.offset)


class BlockHostBuffers:
    """The host copy of one block: its layout and one flat host tensor per dtype."""

    def __init__(self, layout: BlockLayout, memory: PinnedMemory):
        self.layout = layout
        self.flat: dict[torch.dtype, torch.Tensor] = {}
        self.pinned = True
        for dtype, numel in layout.numel_per_dtype.items():
            self.flat[dtype], pinned = memory.allocate((numel,), dtype)
            self.pinned &= pinned
        self.slots = {s.name: s for s in layout.slots}

    def view(self, slot: TensorSlot) -> torch.Tensor:
        return slot_view(self.flat[slot.dtype], slot)

    def fill_(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy every slot's tensor in (from any device). Alignment padding is never read."""
        for name, slot in self.slots.items():
            self.view(slot).copy_(tensors[name])
