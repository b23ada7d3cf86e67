"""Plan keys: one step's distinct fp32 timesteps, by exact bit pattern, plus the weights' version.

Two plans are the same only if every timestep has the same fp32 bits (so 0.0 and -0.0 differ, and
0.30000001 never aliases 0.3) and they were built from the same weights with the same projection (both in the
plan cache's `weights_version`). The key is a plain tuple of Python ints so it hashes fast and never keeps a
tensor alive.
"""

from __future__ import annotations

import torch

#: (weights_version, (bits_0, bits_1, ...)) with bits as signed int32 values of the fp32 timesteps.
PlanKey = tuple[object, tuple[int, ...]]


def check_plan(timesteps: torch.Tensor) -> None:
    """Raise ValueError unless `timesteps` is a non-empty 1-D fp32 tensor of finite values."""
    _check_form(timesteps)
    if not bool(torch.isfinite(timesteps).all()):
        raise ValueError(f"plan timesteps must be finite, got {timesteps.tolist()}")


def _check_form(timesteps: torch.Tensor) -> None:
    if not isinstance(timesteps, torch.Tensor):
        raise ValueError(f"a plan must be a torch.Tensor of fp32 timesteps, got {type(timesteps).__name__}")
    if timesteps.dtype != torch.float32 or timesteps.dim() != 1 or timesteps.numel() == 0:
        raise ValueError(
            f"a plan must be a non-empty 1-D float32 tensor, got dtype={timesteps.dtype} "
            f"shape={tuple(timesteps.shape)}"
        )


def plan_key(timesteps: torch.Tensor, weights_version: object) -> PlanKey:
    """Key of the plan `timesteps` (fp32 [M], host or device) under `weights_version` (hashable); ValueError
    as `check_plan` for a plan that is not a non-empty 1-D fp32 tensor of finite values."""
    _check_form(timesteps)
    bits = timesteps.detach().to("cpu").contiguous().view(torch.int32).tolist()
    # Finite <=> exponent bits not all ones; read off the ints already in hand (a torch.isfinite per plan was
    # most of a 50-step request's GPU-slab hit on the host).
    if any((b >> 23) & 0xFF == 0xFF for b in bits):
        raise ValueError(f"plan timesteps must be finite, got {timesteps.tolist()}")
    return (weights_version, tuple(bits))


def plan_timesteps(key: PlanKey) -> torch.Tensor:
    """The fp32 [M] timesteps a key was made from (bit-exact inverse of `plan_key`)."""
    return torch.tensor(key[1], dtype=torch.int32).view(torch.float32)
