"""Tensor parallel Qwen3-VL prompt encoding over one replica's ranks (`model.text_encoder.LanguageModelSplit`).

Every decoder layer is split the Megatron way, so each rank holds and computes 1/N of it:

    attention  q_proj, k_proj, v_proj   column parallel: rank r keeps heads [r H/N, (r+1) H/N) and kv heads
                                        [r KV/N, (r+1) KV/N) (rows of the weight); the query heads of rank r use
                                        exactly the kv heads of rank r (query head j reads kv head j // (H/KV))
               o_proj                   row parallel: the matching columns; partial outputs all-reduced
    MLP        gate_proj, up_proj       column parallel: rows [r I/N, (r+1) I/N) of the intermediate width
               down_proj                row parallel: the matching columns; partial outputs all-reduced

The token embedding, the RMSNorms (input, post-attention, q/k per head) and the rotary tables are replicated.
Each rank builds transformers' own `Qwen3VLTextModel` from a config with H/N heads, KV/N kv heads and I/N
intermediate width (its modules then have exactly the shard's shapes and attention runs on the local heads
unchanged), reads only its slice of each split tensor from the safetensors files, and hooks the two row
parallel projections with the all-reduce. Two all-reduces per layer, each [tokens, hidden].

Numerics: the all-reduce changes the summation order of o_proj and down_proj (each rank's partial GEMM sums
K/N products and is rounded to the model dtype, then the partials are added), so the result is not bit-equal to
one process; it differs by rounding of the model dtype (tests/test_parallel_text_encoder.py bounds it in bf16
and fp32). The partials are summed in fp32 and rounded once, so the reduction itself adds no rounding step
beyond one per partial. gloo and NCCL hand every rank the same reduced bits, so every rank encodes the same
embedding (the sequence-parallel transformer then sees the same text on every rank).

The ranks must encode the same prompts in the same order (`encode` is a collective): the engine encodes once
per request on every rank, and its prompt caches, fed the same requests, hit and miss alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

from model.text_encoder import SafetensorsHandle
from parallel.group import SpGroup

#: Split tensors by their name within a decoder layer (`layers.{i}.<suffix>`): the dimension cut into N slices.
#: dim 0 = output rows (column parallel), dim 1 = input columns (row parallel).
COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


class TextEncoderSplitError(ValueError):
    """A tensor parallel degree the text encoder cannot be split by; names the sizes and the valid degrees."""


def valid_text_degrees(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """Degrees that divide the attention heads, the kv heads and the MLP width."""
    return [d for d in range(1, num_kv_heads + 1)
            if num_heads % d == 0 and num_kv_heads % d == 0 and intermediate_size % d == 0]


def check_text_degree(degree: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """TextEncoderSplitError unless `degree` divides the heads, the kv heads and the MLP width."""
    if degree < 1 or num_heads % degree or num_kv_heads % degree or intermediate_size % degree:
        raise TextEncoderSplitError(
            f"text encoder tensor parallel degree {degree} does not divide its {num_heads} attention heads, "
            f"{num_kv_heads} kv heads and MLP width {intermediate_size}; valid degrees: "
            f"{valid_text_degrees(num_heads, num_kv_heads, intermediate_size)} (or set "
            "engine.parallel.text_encoder_tp: false to run the whole encoder on every rank)")


@dataclass(frozen=True)
class _Cut:
    dim: int  # which dimension of the stored tensor is sliced
    row_parallel_bias: bool = False  # a row-parallel layer's bias: added once (rank 0), not N times


class TextTensorParallel:
    """`LanguageModelSplit` over `group`: this rank's 1/N of every decoder layer (see the module docstring).

    `install` registers a forward hook on every o_proj and down_proj that all-reduces the partial output;
    installing twice is an error.
    """

    HOOK_NAME = "ditserve_text_tp_all_reduce"

    def __init__(self, group: SpGroup):
        self.group = group
        self.rank, self.degree = group.rank, group.world_size
        self._installed = False

    @property
    def label(self) -> str:
        return f"tp{self.degree}"

    def local_config(self, config: Qwen3VLTextConfig) -> Qwen3VLTextConfig:
        heads, kv_heads, width = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
        check_text_degree(self.degree, heads, kv_heads, width)
        return Qwen3VLTextConfig.from_dict({
            **config.to_dict(), "num_attention_heads": heads // self.degree,
            "num_key_value_heads": kv_heads // self.degree, "intermediate_size": width // self.degree,
            # head_dim must not be derived from hidden_size / heads once the heads are split
            "head_dim": config.head_dim,
        })

    def read(self, handle: SafetensorsHandle, stored_name: str, name: str) -> torch.Tensor:
        """This rank's slice of `stored_name` (the whole tensor if it is replicated), read without the rest."""
        cut = _cut_of(name)
        if cut is None:
            return handle.get_tensor(stored_name)
        if cut.row_parallel_bias:
            bias = handle.get_tensor(stored_name)
            return bias if self.rank == 0 else torch.zeros_like(bias)
        piece = handle.get_slice(stored_name)
        size = piece.get_shape()[cut.dim]
        if size % self.degree:
            raise TextEncoderSplitError(f"{stored_name}: dim {cut.dim} of size {size} does not divide by the text "
                                        f"encoder tensor parallel degree {self.degree}")
        step = size // self.degree
        part = slice(self.rank * step, (self.rank + 1) * step)
        return (piece[part] if cut.dim == 0 else piece[:, part]).contiguous()

    def install(self, model: Qwen3VLTextModel) -> None:
        if self._installed:
            raise RuntimeError(f"{self.HOOK_NAME} is already installed on a model: one TextTensorParallel per model")
        for layer in model.layers:
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.register_forward_hook(self._all_reduce)
        self._installed = True

    def _all_reduce(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        # Partials summed in fp32, rounded to the model dtype once (a bf16 sum would round after every add).
        total = output.float().contiguous()
        self.group.all_reduce(total)
        return total.to(output.dtype)


def _cut_of(name: str) -> _Cut | None:
    """How the parameter `name` (e.g. `layers.3.mlp.down_proj.weight`) is split; None: replicated."""
    if not name.startswith("layers."):
        return None  # embed_tokens, norm
    layer_part, _, kind = name.split(".", 2)[2].rpartition(".")
    if layer_part in COLUMN_PARALLEL:
        return _Cut(dim=0)  # weight rows and bias entries alike
    if layer_part in ROW_PARALLEL:
        return _Cut(dim=1, row_parallel_bias=kind == "bias")
    return None  # norms
