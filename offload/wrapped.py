"""Tensor-subclass parameters (a "traceable wrapper subclass", e.g. torchao's `Float8Tensor`: fp8 data plus fp32
scales) streamed as the plain tensors they wrap.

Such a parameter holds no storage of its own: its bytes are its inner tensors (`__tensor_flatten__` names them),
so the offloader packs and copies those and swaps them inside the wrapper. The wrapper's own metadata (shape,
device) is fixed when it is built, so it is rebuilt (`__tensor_unflatten__`) once on the device the block runs on
and once more on the way back (`LayerwiseOffloader.remove`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def is_wrapped(t: torch.Tensor) -> bool:
    """`t` is a wrapper subclass whose bytes live in its inner tensors."""
    return is_traceable_wrapper_subclass(t)


def inner_tensors(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The plain tensors `t` wraps, by attribute name in `__tensor_flatten__`'s order."""
    names, _ = t.__tensor_flatten__()
    inner = {name: getattr(t, name) for name in names}
    nested = sorted(name for name, value in inner.items() if is_wrapped(value))
    if nested:  # one level is what torchao's quantized weights use; deeper nesting is not streamed
        raise ValueError(f"{type(t).__name__} wraps further tensor subclasses in {nested}; cannot offload it")
    return inner


def rebuilt(t: torch.Tensor, inner: dict[str, torch.Tensor]) -> torch.Tensor:
    """A wrapper like `t` around `inner` (its shape and device are those `inner` gives it)."""
    _, context = t.__tensor_flatten__()
    return type(t).__tensor_unflatten__(inner, context, t.shape, t.stride())


def rebuilt_on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` rebuilt around copies of its inner tensors on `device` (the same tensors where they already are)."""
    return rebuilt(t, {name: value.to(device) for name, value in inner_tensors(t).items()})
