"""`text_encoder.quantization: fp8`: the Qwen3-VL language model's decoder-layer linears in float8, with the
transformer tier's recipe (torchao float8 dynamic activations x rowwise float8 weights, `engine.fp8`).

Quantized: in every decoder layer the attention's q/k/v/o projections and the MLP's gate/up/down projections (7
per layer, ~all of the encoder's weight bytes). Kept in the checkpoint's dtype: the token embedding, the RMSNorms,
the vision tower (its linears are small and run once per image) and the rotary tables; the LM head and final norm
are never loaded (`model.text_encoder`). The encoder applies `TextEncoderFp8` to each decoder layer as soon as its
weights are on the device and before the next layer is read, so it never holds the bf16 stack whole: the peak
is the float8 model plus one bf16 layer.

Composes with `engine.parallel.text_encoder_tp`: each rank quantizes its own slice of every layer (the
column-parallel projections keep whole output rows, so their rowwise scales are the unsplit ones; the
row-parallel ones scale their partial rows) and the all-reduce hooks on o_proj / down_proj stay on the modules.
Float8 GEMMs need a CUDA device of compute capability >= 8.9: elsewhere the start fails with `QuantizationError`
naming `text_encoder.quantization`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import fp8

FIELD = "text_encoder.quantization"


def decoder_linears(layer: nn.Module) -> list[str]:
    """Names (within one decoder layer) of its linears: what the fp8 tier quantizes."""
    return [name for name, module in layer.named_modules() if isinstance(module, nn.Linear)]


class TextEncoderFp8:
    """The prompt encoder's `model.text_encoder.LayerTransform` for `text_encoder.quantization: fp8`: each
    decoder layer's linears quantized on `device` (the encoder's), counted in `quantized`."""

    label = "fp8"

    def __init__(self, device: torch.device) -> None:
        fp8.check_fp8_device(device, FIELD)  # through the module: tests lift it there
        self.device = device
        #: `layers.{i}.<name>` of every linear quantized so far, in load order.
        self.quantized: list[str] = []

    def apply(self, index: int, layer: nn.Module) -> None:
        names = decoder_linears(layer)
        fp8.quantize_named_fp8(layer, names, self.device, FIELD)
        self.quantized += [f"layers.{index}.{name}" for name in names]
