"""The transformer forward's kernels, set up once per engine: FP8 block linears (`engine.quantization`), the
attention backend (`engine.attention`), compiled blocks (`engine.compile`) and the start-up warm-up of the
configured canvases. The engine calls `quantize` right after the load, `install` after every hook
(ExternalModulation, sequence parallel, offloader, Cache-DiT) is in place, and `warm_up` once it can serve.

What it set up is `describe()["forward"]` (`GET /v1/models`) and a line of the start-up log.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers import MiniMaxH3Transformer3DModel

from engine.attention import AttentionChoice, choose_attention
from engine.compiled import CompiledBlocks, CompileStats
from engine.config import CompileConfig, WarmupCanvas
from engine.fp8 import LinearPrecision, quantize_blocks_fp8

#: Prompt rows of the warm-up's stand-in embedding (the sequence dimension is dynamic: any length would do).
WARMUP_TEXT_TOKENS = 64


@dataclass
class ForwardKernels:
    """What runs inside the transformer's forward on this engine."""

    attention: AttentionChoice
    quantization: str  # engine.quantization
    quantized_linears: int  # block linears in FP8 (0: none)
    compiled: CompiledBlocks | None
    precision: LinearPrecision | None = None  # bf16+fp8: which weights the block linears run, per request

    def compile_stats(self) -> CompileStats | None:
        return self.compiled.stats() if self.compiled is not None else None

    def describe(self) -> dict[str, object]:
        stats = self.compile_stats()
        return {"attention": {**dataclasses.asdict(self.attention), "ms": self.attention.ms},
                "quantization": self.quantization, "quantized_linears": self.quantized_linears,
                "compile": dataclasses.asdict(stats) if stats is not None else None}

    def summary(self) -> str:
        compiled = "off" if self.compiled is None else f"blocks ({self.compiled.options.backend})"
        return (f"attention {self.attention.summary()}; quantization {self.quantization} "
                f"({self.quantized_linears} linears); compile {compiled}")


def quantize(transformer: MiniMaxH3Transformer3DModel, quantization: str,
             device: torch.device) -> tuple[int, LinearPrecision | None]:
    """FP8 on the block linears when configured (quantized on `device`, the one the blocks run on, wherever
    they are loaded): how many linears hold float8 weights, and for bf16+fp8 the switch between the two."""
    if quantization == "none":
        return 0, None
    if quantization == "bf16+fp8":
        precision = LinearPrecision(transformer.transformer_blocks, device)
        return len(precision.names), precision
    return len(quantize_blocks_fp8(transformer.transformer_blocks, device)), None


def install(transformer: MiniMaxH3Transformer3DModel, *, attention: str, compile_config: CompileConfig, quantized_linears: int,
            quantization: str, device: torch.device, precision: LinearPrecision | None = None) -> ForwardKernels:
    """Choose the attention backend (measured on `device` for `auto`), then compile the blocks if configured."""
    choice = choose_attention(transformer, attention, device)
    compiled = CompiledBlocks(transformer.transformer_blocks, compile_config.options).apply() \
        if compile_config.mode == "blocks" else None
    return ForwardKernels(choice, quantization, quantized_linears, compiled, precision)


def warm_up(kernels: ForwardKernels, canvases: tuple[WarmupCanvas, ...], run: Callable[[WarmupCanvas], None]) -> None:
    """`run` each canvas (a whole request through the engine's denoiser), then start counting compiles as
    after the warm-up. A canvas the engine refuses fails the start naming it."""
    begin = time.perf_counter()
    for index, canvas in enumerate(canvases):
        try:
            run(canvas)
        except ValueError as exc:
            raise ValueError(f"engine.compile.warmup[{index}] ({canvas.width}x{canvas.height}, {canvas.seconds:g} s, "
                             f"{canvas.steps} steps): {exc}") from exc
    if kernels.compiled is not None:
        kernels.compiled.warmup_ended(time.perf_counter() - begin)
