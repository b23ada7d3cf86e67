"""Deterministic initialisation, shared by `DiT`, `ByteTextEmbedder` and the checkpoint writer.

Every parameter is a pure function of (seed, name, shape, dtype, config): the writer can generate any tensor
on its own, in any order, and `DiT(config, seed=s)` equals a checkpoint made with `--seed s`.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import Executor

import torch
from torch import Tensor, nn

from model.config import DiTConfig

#: Elements per independently seeded chunk; fixed, so the bytes never depend on the number of threads.
INIT_CHUNK_NUMEL = 1 << 22


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    # torch's CPU generator (mt19937) uses 32 bits of the seed.
    return int.from_bytes(hashlib.sha256(f"ditserve/{seed}/{name}/{chunk}".encode()).digest()[:4], "little")


def init_rule(name: str, shape: tuple[int, ...], config: DiTConfig) -> tuple[float, float]:
    """(mean, std) of a parameter's initial values. Small enough that a random 50-block model stays finite:
    AdaLN projections are scaled by 0.1 (gates ~0.05) and residual-branch outputs by 1/sqrt(2*depth)."""
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        return 1.0, 0.02
    if name.endswith(".bias"):
        return 0.0, 0.02
    if name == "text_embedder.embed.weight":
        return 0.0, 1.0
    if name == "text_embedder.pos_embed":
        return 0.0, 0.1
    gain = 1.0
    if ".adaln_proj." in name:
        gain = 0.1
    elif name.endswith(("attn.o.weight", "mlp.down.weight", "fc2.weight")):
        gain = 1.0 / math.sqrt(2 * (config.num_blocks + config.num_refiner_blocks))
    return 0.0, gain / math.sqrt(shape[-1])  # shape[-1] is fan_in for a Linear weight


def seeded_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, *, mean: float, std: float, seed: int,
    pool: Executor | None = None,
) -> Tensor:
    """Deterministic CPU tensor: uniform with the given mean/std, from per-(seed, name, chunk) generators.

    Uniform (not normal) values: torch.rand plus exact fp32 arithmetic gives the same bits on every CPU,
    while normal sampling goes through vectorised log/cos that may differ by ISA. Chunks are independent,
    so a thread pool can fill them in parallel (the h3 writer does) with identical results.
    """
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    numel = flat.numel()
    half_width = std * math.sqrt(3.0)  # uniform on [-a, a] has std a/sqrt(3)

    def fill(chunk: int) -> None:
        start = chunk * INIT_CHUNK_NUMEL
        end = min(numel, start + INIT_CHUNK_NUMEL)
        gen = torch.Generator().manual_seed(_chunk_seed(seed, name, chunk))
        u = torch.rand(end - start, generator=gen, dtype=torch.float32)
        flat[start:end].copy_(u.mul_(2 * half_width).add_(mean - half_width))  # copy_ casts to dtype

    chunks = range(-(-numel // INIT_CHUNK_NUMEL))
    if pool is None or len(chunks) == 1:
        for c in chunks:
            fill(c)
    else:
        for f in [pool.submit(fill, c) for c in chunks]:
            f.result()
    return out


@torch.no_grad()
def init_parameters(module: nn.Module, config: DiTConfig, seed: int, prefix: str = "", pool: Executor | None = None) -> None:
    """Fill every parameter of `module` in place; names are taken as `prefix.name` (their checkpoint keys)."""
    for name, p in module.named_parameters(prefix=prefix):
        mean, std = init_rule(name, tuple(p.shape), config)
        p.copy_(seeded_tensor(name, tuple(p.shape), p.dtype, mean=mean, std=std, seed=seed, pool=pool))
