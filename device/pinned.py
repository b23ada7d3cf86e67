"""Pinned host memory: page-locked at its exact size, under one budget, pageable when that runs out.

`torch.empty(..., pin_memory=True)` goes through PyTorch's caching host allocator, which rounds every request
up to a power of two: a 520 MB rebuild staging buffer would lock 1 GiB, a 9 GB host tier 16 GiB, a 0.77 GB
offloaded block 1 GiB. `PinnedMemory` allocates ordinary host memory and page-locks exactly that through the
device (`Device.register_host`: `cudaHostRegister` on CUDA, ~0.05 s per GiB; H2D from it runs at the pinned
rate). The budget (`budget_bytes`) and a refusal by the OS both end in pageable memory (slower copies) with
one warning per owner, or in a `PinError` for callers that pick their own fallback (the host tier halves).

Registrations are undone by `free(tensor)` or, for whatever is still registered, when the `PinnedMemory` is
garbage collected; both first synchronize the device, so no copy still reads pages being unlocked. Until
then the owner keeps the tensor alive, so memory is never freed while registered.

`staging(shape, dtype)` is the one exception, for short-lived per-request buffers: PyTorch's caching host
allocator (rounded, but it recycles freed blocks without registering again, which per-request buffers need).
"""

from __future__ import annotations

import logging
import weakref

import torch

from .streams import Device

logger = logging.getLogger(__name__)


class PinError(RuntimeError):
    """Memory that could not be page-locked: over the budget, or refused by the OS."""


def _unregister_all(device: Device, registered: dict[int, torch.Tensor]) -> None:
    if not registered:
        return
    try:
        device.synchronize()  # no copy may still read or write the pages being unlocked
        for tensor in registered.values():
            device.unregister_host(tensor)
    except Exception:  # interpreter shutdown: the CUDA context may already be gone
        pass
    registered.clear()


class PinnedMemory:
    """Host buffers of one owner: page-locked at their exact size while the budget lasts, pageable after.

    Verbs: `pinned(shape, dtype)` (page-locked or `PinError`), `allocate(shape, dtype) -> (tensor, pinned)`
    (pageable after one warning when pinning is off, over budget or refused), `free(tensor)`, `lock(tensor)`
    / `unlock(tensor)` (page-lock memory allocated elsewhere, e.g. shared memory of Ray objects), `staging`.
    Invariant: `pinned_bytes` == the bytes of the registered tensors <= `budget_bytes` (when set).
    """

    def __init__(self, device: Device, *, pin: bool = True, budget_bytes: int | None = None,
                 owner: str = "host memory"):
        self.device = device
        self.pin = pin and device.pin_supported
        self.budget_bytes = budget_bytes
        self.owner = owner
        self.pinned_bytes = 0
        self.pageable_bytes = 0
        self._registered: dict[int, torch.Tensor] = {}  # data_ptr -> tensor, kept alive while registered
        self._warned = False
        weakref.finalize(self, _unregister_all, device, self._registered)

    def _warn_once(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("%s: %s; further buffers use pageable host memory (slower copies)", self.owner, why)

    def lock(self, tensor: torch.Tensor) -> None:
        """Page-lock `tensor`'s (contiguous) memory in place; PinError over budget or when refused."""
        if not self.pin:
            raise PinError(f"{self.owner}: pinned memory is off or unsupported on {self.device.torch_device}")
        nbytes = tensor.nbytes
        if self.budget_bytes is not None and self.pinned_bytes + nbytes > self.budget_bytes:
            raise PinError(f"pinned budget of {self.budget_bytes} bytes reached ({self.pinned_bytes} pinned, "
                           f"{nbytes} asked)")
        if nbytes == 0:
            return
        try:
            self.device.register_host(tensor)
        except RuntimeError as e:
            raise PinError(f"pinning {nbytes} bytes failed ({str(e).splitlines()[0]})") from e
        self._registered[tensor.data_ptr()] = tensor
        self.pinned_bytes += nbytes

    def unlock(self, tensor: torch.Tensor) -> None:
        """Undo `lock` without synchronizing: the caller knows no copy still reads the memory."""
        if self._registered.pop(tensor.data_ptr(), None) is not None:
            self.device.unregister_host(tensor)
            self.pinned_bytes -= tensor.nbytes

    def pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host tensor of exactly `shape`; PinError when it cannot be had."""
        tensor = torch.empty(shape, dtype=dtype)
        self.lock(tensor)
        return tensor

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        """A host tensor of exactly `shape` and whether it is page-locked (pageable after one warning)."""
        if self.pin:
            try:
                return self.pinned(shape, dtype), True
            except PinError as e:
                self._warn_once(str(e))
        tensor = torch.empty(shape, dtype=dtype)
        self.pageable_bytes += tensor.nbytes
        return tensor, False

    def free(self, tensor: torch.Tensor) -> None:
        """Give back a tensor from `pinned`/`allocate` (after the device finished every queued copy)."""
        if tensor.data_ptr() in self._registered:
            self.device.synchronize()  # no copy may still read or write the pages being unlocked
            self.unlock(tensor)
        else:
            self.pageable_bytes -= tensor.nbytes

    @property
    def pins_staging(self) -> bool:
        """Whether `staging` buffers are page-locked (CUDA with pinning on)."""
        return self.pin and self.device.torch_device.type == "cuda"

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A short-lived host buffer (per request): pinned through PyTorch's caching host allocator on CUDA
        (rounded up, not budgeted, recycled when dropped), plain memory on the fake device."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pins_staging)

    def release(self) -> None:
        """Unlock everything still registered (after synchronizing the device)."""
        _unregister_all(self.device, self._registered)
        self.pinned_bytes = 0
