"""FlashAttention-4 from the `flash-attn-4` wheel (module `flash_attn.cute`) as the transformer's attention kernel.

diffusers 0.42.1 runs FA4 only as `flash_4_hub`: its backend function calls a kernel that the `kernels` package
downloads from the Hugging Face Hub at first use, which a replica without network cannot do. The same kernels ship
on the registry as the `flash-attn-4` wheel (CuTe DSL: compiled for the device at first call, Hopper and
Blackwell). `engine.attention: flash_4` runs diffusers' own FA4 backend function with its kernel taken from that
wheel instead: we fill the hub registry's kernel slot (so diffusers never downloads) and point the attention
processors at `flash_4_hub` ourselves (diffusers' requirement check for that name asks for `kernels`, which this
path does not use). Reading diffusers' private registry is why diffusers is pinned to 0.42 (pyproject).

The kernel is wrapped as a torch custom op (`ditserve::flash_attention_4`): dynamo does not trace into the CuTe DSL
launcher, so without the op a compiled block would break its graph at every attention call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

#: ditserve's name for this backend in `engine.attention` (diffusers has no name for FA4 without the hub).
FLASH_4 = "flash_4"
#: The wheel's module that must import.
MODULE = "flash_attn.cute"
INSTALL = ("pip install 'ditserve[flash-attn-4]' (the flash-attn-4 wheel, module flash_attn.cute: Hopper or "
           "Blackwell GPUs; its kernels compile for the device at first call)")


def _kernel() -> Callable[..., object]:
    """The wheel's attention function (imported on first use: it pulls the CuTe DSL)."""
    from flash_attn.cute import flash_attn_func

    return flash_attn_func


@torch.library.custom_op("ditserve::flash_attention_4", mutates_args=())
def flash_attention_4(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
                      causal: bool = False) -> torch.Tensor:
    """FA4 attention of [B, S, heads, head_dim] q/k/v (diffusers' layout), the output in q's shape."""
    out = _kernel()(query, key, value, softmax_scale=scale, causal=causal)
    out = out[0] if isinstance(out, tuple) else out  # the wheel returns (out, lse) in some versions
    return out.contiguous()


@flash_attention_4.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
      causal: bool = False) -> torch.Tensor:
    return torch.empty_like(query)


def _hub_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                   causal: bool = False) -> torch.Tensor:
    """What diffusers' `flash_4_hub` backend function calls its kernel with."""
    return flash_attention_4(q, k, v, softmax_scale, causal)


@functools.cache
def install() -> object:
    """Fill diffusers' FA4 kernel slot with the wheel's kernel (idempotent) and return diffusers' backend name
    (`AttentionBackendName.FLASH_4_HUB`) that now runs it. Raises ImportError when the wheel does not import."""
    import importlib

    importlib.import_module(MODULE)  # fail here, naming the module, rather than at the first attention call
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB].kernel_fn = _hub_signature
    return AttentionBackendName.FLASH_4_HUB


def set_on(transformer: nn.Module) -> None:
    """`flash_4` on every attention processor of `transformer` (diffusers' `set_attention_backend` would refuse the
    hub name without the `kernels` package)."""
    from diffusers.models.attention import AttentionModuleMixin

    backend = install()
    for module in transformer.modules():
        if isinstance(module, AttentionModuleMixin):
            module.processor._attention_backend = backend
