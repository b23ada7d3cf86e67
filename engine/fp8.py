"""The FP8 tier (`engine.quantization: fp8`): torchao float8 dynamic activations x rowwise float8 weights on
the transformer blocks' linears only.

Quantized: in every `transformer_blocks[i]`, the attention's `to_q`, `to_k`, `to_v`, `to_out.0` and the SwiGLU
feed-forward's linears (the GEMMs that are ~all of a block's FLOPs but attention's). Kept: the fp32 patch,
timestep and output heads, the token refiner (runs once per request) and every AdaLN projection (`adaln_proj`:
its rows come from the bf16 checkpoint, resident or through the plan cache, so online AdaLN composes with FP8).
Quantized in place right after the bf16 load, one linear at a time on the device that runs it (no second host
copy). With layerwise offload the blocks are loaded on the host: each linear visits the device to be quantized
and its FP8 weight goes back to the host, so streamed and resident blocks hold the same bytes, and what the
offloader streams is the fp8 data and its scales (`offload.wrapped`: about half a bf16 block's bytes).

Float8 GEMMs need a CUDA device of compute capability 8.9 or more (Ada, Hopper); anywhere else the start fails
with `QuantizationError` naming the field. A weight update re-quantizes the new checkpoint's bf16 weights the same
way (`requantized`): an updated engine serves what a fresh one on the new checkpoint serves.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.limits import Linears, Quantization
from offload.wrapped import inner_tensors, is_wrapped, rebuilt_on

#: Compute capability of the first GPUs with float8 tensor cores (Ada: 8.9; Hopper: 9.0).
MIN_CAPABILITY = (8, 9)


class QuantizationError(ValueError):
    """`engine.quantization` cannot be served on this device or with this setup."""


def fp8_targets(blocks: nn.ModuleList) -> list[str]:
    """Names (within `blocks`, the transformer's `transformer_blocks`) of the linears the FP8 tier quantizes:
    each block's attention and feed-forward, in module order."""
    return [name for name, module in blocks.named_modules() if _is_target(name, module)]


def _is_target(name: str, module: nn.Module) -> bool:
    parts = name.split(".")
    return isinstance(module, nn.Linear) and "adaln_proj" not in parts and ("attn" in parts or "ff" in parts)


def check_fp8_device(device: torch.device, field: str = "engine.quantization") -> None:
    """QuantizationError naming `field` (the setting that asked for fp8) unless `device` runs float8 GEMMs."""
    if device.type != "cuda":
        raise QuantizationError(f"{field}: fp8 needs a CUDA GPU with float8 tensor cores (compute "
                                f"capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}); it runs on "
                                f"{device.type} here. Use quantization: none")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise QuantizationError(f"{field}: fp8 needs compute capability >= {MIN_CAPABILITY[0]}."
                                f"{MIN_CAPABILITY[1]}; {torch.cuda.get_device_name(device)} has "
                                f"{capability[0]}.{capability[1]}. Use quantization: none")


def quantize_blocks_fp8(blocks: nn.ModuleList, device: torch.device) -> list[str]:
    """Quantize `fp8_targets(blocks)` in place for blocks that run on `device` (a float8-capable GPU); returns
    their names."""
    check_fp8_device(device)
    return quantize_linears_fp8(blocks, device)


def requantized(new: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors an FP8 weight wraps (fp8 data, scales), made from the bf16 checkpoint tensor `new` on `device`
    exactly as `quantize_linears_fp8` makes them at load: what a weight update writes into a served FP8 weight
    (whose shape the update's checks already matched to `new`)."""
    from torchao.quantization import quantize_

    linear = nn.Linear(new.shape[1], new.shape[0], bias=False, device=device, dtype=new.dtype)
    with torch.no_grad():
        linear.weight.copy_(new)
    quantize_(linear, _config())
    return inner_tensors(linear.weight)


def _config():
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())


def quantize_linears_fp8(blocks: nn.ModuleList, device: torch.device) -> list[str]:
    """`quantize_blocks_fp8` without our device check (torchao still checks the machine): each target linear is
    quantized on `device` and left where its weight was."""
    targets = fp8_targets(blocks)
    if not targets:
        raise QuantizationError("engine.quantization: fp8 found no attention or feed-forward linears in the blocks")
    quantize_named_fp8(blocks, targets, device, "engine.quantization")
    return targets


def quantize_named_fp8(root: nn.Module, names: list[str], device: torch.device, field: str) -> None:
    """The FP8 quantizer of every tier (`field` names the setting in errors): each linear `names` gives (within
    `root`) quantized in place on `device` and left where its weight was."""
    from torchao.quantization import quantize_

    config = _config()
    for name in names:
        linear = root.get_submodule(name)
        home = linear.weight.device
        quantize_(linear.to(device), config)
        if not is_wrapped(linear.weight):  # torchao leaves a linear whose shape its float8 GEMM cannot take
            raise QuantizationError(f"{field}: fp8 cannot quantize {name} (weight "
                                    f"{tuple(linear.weight.shape)}: float8 GEMMs need both dims multiples of 16)")
        if home != device:  # back where the linear's weights were loaded (the offloader streams it from there)
            linear.weight = nn.Parameter(rebuilt_on(linear.weight, home), requires_grad=False)
            if linear.bias is not None:
                linear.bias.data = linear.bias.data.to(home)


def stored_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers as stored (a float8 weight: its fp8 data and scales)."""
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_meta:
            continue
        parts = inner_tensors(t).values() if is_wrapped(t) else (t,)
        total += sum(p.numel() * p.element_size() for p in parts)
    return total


def float8_copy(weight: torch.Tensor) -> nn.Parameter:
    """The FP8 weight `quantize_linears_fp8` would make of the bf16 `weight` (same bits), made beside it: `weight`
    itself is left as it is (torchao reads it through a throwaway linear that shares it)."""
    from torchao.quantization import quantize_

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    quantize_(linear, _config())
    if not is_wrapped(linear.weight):
        raise QuantizationError(f"engine.quantization: bf16+fp8 cannot quantize a weight of {tuple(weight.shape)} "
                                "(float8 GEMMs need both dims multiples of 16)")
    return nn.Parameter(linear.weight, requires_grad=False)


class LinearPrecision:
    """`engine.quantization: bf16+fp8`: every FP8 target linear of the blocks keeps its bf16 weight and holds a
    float8 copy of it (no second bf16 copy); `use(linears)` points each linear at one of the two (a parameter
    swap, no copy), between requests only.

    The linears are held as modules, so the swap still reaches them once peft wraps them as a LoRA layer's
    `base_layer` (unfused adapters compose). Invariant: every target's `weight` is its `active` one."""

    def __init__(self, blocks: nn.ModuleList, device: torch.device):
        check_fp8_device(device)
        names = fp8_targets(blocks)
        if not names:
            raise QuantizationError("engine.quantization: bf16+fp8 found no attention or feed-forward linears")
        self.names = names
        self._linears = [blocks.get_submodule(name) for name in names]
        self._weights: dict[Linears, list[nn.Parameter]] = {"bf16": [linear.weight for linear in self._linears]}
        self.active: Linears = "bf16"
        self.refresh()

    def refresh(self) -> None:
        """The float8 copies made again from the bf16 weights (after a weight update wrote those)."""
        self._weights["fp8"] = [float8_copy(weight) for weight in self._weights["bf16"]]

    def use(self, linears: Linears) -> None:
        """Every target linear runs with its `linears` weight from now on (nothing moves when it already does)."""
        if linears == self.active:
            return
        for linear, weight in zip(self._linears, self._weights[linears]):
            linear.weight = weight
        self.active = linears

    def check(self) -> None:
        wrong = [name for name, linear, weight in zip(self.names, self._linears, self._weights[self.active])
                 if linear.weight is not weight]
        if wrong:
            raise RuntimeError(f"linears {wrong} do not run their {self.active} weight")
