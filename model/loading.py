"""Build diffusers' `MiniMaxH3Transformer3DModel` from a checkpoint of either layout, tensor by tensor.

The model is created with its parameters on the meta device (no memory), then each parameter is read from the
checkpoint (`TransformerWeights.tensor`: one host buffer of that tensor's size) and moved to `device` in its
published dtype (bf16 blocks; fp32 patch projections, timestep MLP and output heads). Host memory therefore
never holds more than one tensor, and never a second copy of the transformer.

Parameters for which `skip(name)` is true are left on meta for the caller to replace (AdaLN projections
served from a plan cache, blocks offloaded to pinned host memory).
"""

from __future__ import annotations

from typing import Callable

import torch
from accelerate import init_empty_weights
from diffusers import MiniMaxH3Transformer3DModel

from model.layout import CheckpointError, Layout
from model.weights import NATIVE_ROPE_INV_FREQ, TransformerWeights, is_adaln_param


def load_transformer(
    weights: TransformerWeights, device: str | torch.device, *, skip: Callable[[str], bool] | None = None,
) -> MiniMaxH3Transformer3DModel:
    """Validate `weights` (headers only), then build the transformer on `device`, in eval mode, frozen."""
    names = weights.names()
    skipped = {name for name in names if skip is not None and skip(name)}
    weights.validate(with_adaln=not any(is_adaln_param(name) for name in skipped))

    # Parameters on meta; buffers (rope.inv_freq, computed from the config) real, as diffusers' own loader does.
    with init_empty_weights(include_buffers=False):
        model = MiniMaxH3Transformer3DModel.from_config(weights.config.model_dump())
    model.rope.to(device)
    if weights.layout is Layout.NATIVE:
        _check_rope(weights, model)

    modules = dict(model.named_modules())
    for name in names:
        if name in skipped:
            continue
        module_name, _, leaf = name.rpartition(".")
        tensor = weights.tensor(name, device)
        modules[module_name].register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return model.eval().requires_grad_(False)


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
