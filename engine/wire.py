"""Tensors that cross processes (Serve handle calls, Ray actor calls) travel as numpy byte arrays.

Pickling a `torch.Tensor` puts its storage in the pickle stream itself. A numpy array pickled with protocol 5 (as
Ray does) is an out-of-band buffer that Ray moves through its object store without that in-band copy: through one
Serve hop on the 2-core CI box, a 16 MiB bf16 tensor took 41-50 ms as a tensor and 10-16 ms as an array
(`bench/results/wire-cpu.md`). H3's prompt embeddings reach 16 MiB and a long clip's latents more.

Ray has the same idea behind `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`, but it is process-wide and hands out tensors
over the object store's read-only buffer (writes corrupt it); here the receiver copies the bytes once into memory
of its own, which also releases the store's buffer at once. Dataclasses opt in with `TensorsAsArrays`. (The node
plan pool keeps read-only views on purpose: its plans go straight from shared memory to the GPU,
`actors.host_cache_pool`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["TensorsAsArrays", "WireTensor"]


@dataclass(frozen=True)
class WireTensor:
    """A CPU tensor as its raw bytes: `data` (uint8, 1-D), the torch dtype's name, the shape."""

    data: np.ndarray
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> WireTensor:
        """The tensor's bytes (copied to the CPU and made contiguous first where it is not already)."""
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        return cls(flat.view(torch.uint8).numpy(), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))

    def tensor(self) -> torch.Tensor:
        """A CPU tensor owning a copy of the bytes (the received buffer may be the object store's, read-only)."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"WireTensor: {self.dtype!r} is not a torch dtype")
        if self.data.size == 0:  # numpy's empty array has a stride torch cannot view across element sizes
            return torch.empty(self.shape, dtype=dtype)
        return torch.from_numpy(self.data.copy()).view(dtype).reshape(self.shape)


class TensorsAsArrays:
    """Mixin for (frozen or not) dataclasses: every `torch.Tensor` attribute pickles as a `WireTensor` and comes
    back as a CPU tensor of its own. Other attributes pickle as usual."""

    def __getstate__(self) -> dict[str, Any]:
        return {name: WireTensor.of(value) if isinstance(value, torch.Tensor) else value
                for name, value in vars(self).items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value.tensor() if isinstance(value, WireTensor) else value)
