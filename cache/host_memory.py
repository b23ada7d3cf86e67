"""Exact-size pinned host buffers.

`torch.empty(..., pin_memory=True)` goes through PyTorch's caching host allocator, which rounds every
request up to a power of two: one H3 staging buffer (520 MB) would pin 1 GiB, a 9 GB host tier 16 GiB.
`pinned_empty` allocates ordinary host memory and page-locks exactly that with `cudaHostRegister`
(~0.05 s per GiB; H2D from it runs at the pinned rate), falling back to the caching allocator if
registration is refused. The registration is undone when the tensor's `PinOwner` is garbage collected;
the tensor is kept alive until then, so memory is never freed while registered.
"""

from __future__ import annotations

import weakref

import torch


class PinOwner:
    """Owns registrations: when it is collected, its buffers are unpinned (then freed)."""


def _unregister(tensor: torch.Tensor) -> None:
    try:
        torch.cuda.synchronize()  # no copy may still be reading or writing the pages being unlocked
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    except Exception:  # interpreter shutdown: the CUDA context may already be gone
        pass


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, owner: PinOwner) -> torch.Tensor:
    """A page-locked host tensor of exactly `shape`; unregistered when `owner` is collected.

    Raises RuntimeError (as the caching allocator does) when the memory cannot be pinned at all.
    """
    tensor = torch.empty(shape, dtype=dtype)
    if tensor.numel() == 0:
        return tensor
    try:
        rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
        torch.cuda.check_error(rc)
    except (RuntimeError, AttributeError):
        del tensor
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(owner, _unregister, tensor)
    return tensor
