"""One MiniMax-H3 transformer block at the released width: each attention backend, compiled, FP8 + compiled,
each beside its compute floor.

    python -m bench.forward                     # one GPU: 7,800, 37,774 and 63,256 tokens (~4 min on an H200)
    python -m bench.forward --smoke             # CPU: tiny width, seconds (compile backend eager, no FP8)

The block is diffusers' `MiniMaxH3TransformerBlock` (hidden 5376, 56 heads of 128, SwiGLU 14336) with random bf16
weights, fed a packed sequence of `tokens` rows with two distinct timesteps (rows of the three modalities), as
a denoise step after the first feeds it. Rows, each the median of `--repeats` timed calls after warm-up:

- `attention <backend>`: the attention call alone (`dispatch_attention_fn`, q/k/v [1, S, 56, 128]);
- `block eager <backend>`: the block as ditserve runs it today, with that attention backend;
- `block compiled <backend>`: `engine.compiled.CompiledBlocks` (inductor, dynamic sequence), the fastest
  backend as `engine.attention: auto` chooses it (`engine.attention.choose_attention`);
- `block fp8 eager <backend>`: `engine.fp8.quantize_blocks_fp8` (what `engine.quantization: fp8` runs without
  `engine.compile`);
- `block fp8 + compiled <backend>`: the same FP8 block, compiled.

Token counts: a small canvas (~7.8k), 1344x768 5 s with a 64-token prompt (37,710 + 64) and 1344x768 with 209
frames (63,192 + 64; the longest request of the released limits). `peak GiB`: the most CUDA memory allocated
during the row's timed calls (the block's weights included: 0.9 GiB bf16, ~0.5 fp8).

Floor: matmul FLOPs (the q/k/v/o and SwiGLU projections over every row, QK^T and PV over the sequence) at the
bf16 GEMM rate `--gemm-tflops` (788: the H200's measured rate, bench/results/h3-nvidia-h200.md), and for the FP8
rows with the projections at twice that rate; `x bf16 floor` is every row against the bf16 floor. `rel. error`:
||out - eager||/||eager|| against the eager block on the default backend.
Writes bench/results/forward-<device>.md and .json.
"""

from __future__ import annotations

import argparse
import copy
import functools
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
from diffusers.models.transformers.transformer_minimax_h3 import (MiniMaxH3RotaryPosEmbed,
                                                                  MiniMaxH3TransformerBlock)
from torch import nn

from bench.common import write_run_results
from engine.attention import DEFAULT_BACKEND, choose_attention, dispatch_name
from engine.compiled import CompiledBlocks, CompileOptions
from engine.fp8 import QuantizationError, quantize_blocks_fp8

GEMM_TFLOPS = 788.0


@dataclass(frozen=True)
class Width:
    hidden: int
    heads: int
    head_dim: int
    ffn: int
    time_embed: int
    rope_freq_dim: int  # rotary over 2 * 3 * rope_freq_dim of each head's channels


RELEASED = Width(hidden=5376, heads=56, head_dim=128, ffn=14336, time_embed=2688, rope_freq_dim=16)
SMOKE = Width(hidden=64, heads=4, head_dim=16, ffn=128, time_embed=32, rope_freq_dim=2)
RELEASED_TOKENS = (7800, 37774, 63256)
SMOKE_TOKENS = (61, 97)


def block_flops(width: Width, tokens: int) -> tuple[float, float]:
    """(projection FLOPs, attention FLOPs) of one block over `tokens` rows."""
    inner = width.heads * width.head_dim
    linear = tokens * 2 * (4 * width.hidden * inner + 3 * width.hidden * width.ffn)
    attention = 4 * tokens * tokens * inner
    return float(linear), float(attention)


@dataclass(frozen=True)
class Inputs:
    hidden_states: torch.Tensor  # bf16 [1, S, hidden]
    temb: torch.Tensor  # fp32 [2, time_embed]: two distinct timesteps
    adaln_indices: torch.Tensor  # [S] in [0, 6): timestep x modality
    rotary_emb: tuple[torch.Tensor, torch.Tensor]

    def call(self, block: nn.Module) -> torch.Tensor:
        return block(self.hidden_states, self.temb, self.adaln_indices, self.rotary_emb)


def make_block(width: Width, device: torch.device) -> MiniMaxH3TransformerBlock:
    torch.manual_seed(0)
    block = MiniMaxH3TransformerBlock(width.hidden, width.heads, width.head_dim, width.ffn, width.time_embed,
                                      1e-5, 1e-5)
    return block.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)


def make_inputs(width: Width, tokens: int, device: torch.device) -> Inputs:
    g = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 64, (tokens, 3), generator=g)
    cos, sin = MiniMaxH3RotaryPosEmbed(width.rope_freq_dim)(positions)
    return Inputs(
        hidden_states=torch.randn(1, tokens, width.hidden, generator=g).to(device, torch.bfloat16),
        temb=torch.randn(2, width.time_embed, generator=g).to(device),
        adaln_indices=torch.randint(0, 6, (tokens,), generator=g).to(device),
        rotary_emb=(cos.to(device), sin.to(device)),
    )


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def set_backend(block: nn.Module, backend: str) -> None:
    block.attn.processor._attention_backend = dispatch_name(backend)


def rel_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny width, compile backend eager")
    parser.add_argument("--tokens", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gemm-tflops", type=float, default=GEMM_TFLOPS)
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    command = " ".join(["python -m bench.forward", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    width = SMOKE if args.smoke else RELEASED
    token_counts = tuple(args.tokens) if args.tokens else (SMOKE_TOKENS if args.smoke else RELEASED_TOKENS)
    compile_config = CompileOptions(backend="eager" if device.type == "cpu" else "inductor")
    rate = args.gemm_tflops * 1e12
    notes = [f"one MiniMaxH3TransformerBlock, hidden {width.hidden}, {width.heads} heads x {width.head_dim}, "
             f"ffn {width.ffn}, random bf16 weights; two timesteps; median of {args.repeats} after warm-up",
             f"floor: matmul FLOPs / {args.gemm_tflops:g} TFLOP/s bf16 (projections at 2x for fp8)",
             f"compile: {compile_config.backend}, dynamic={compile_config.dynamic}"]

    started = time.perf_counter()
    block = make_block(width, device)
    # What `engine.attention: auto` would choose on this device (on a CPU: the default, unmeasured).
    auto = _auto_choice(block, width, device)
    notes.append(f"engine.attention auto: {auto.summary()}")
    backends = list(auto.measured_ms) or [DEFAULT_BACKEND, AttentionBackendName._NATIVE_MATH.value]
    rows: list[dict] = []
    for tokens in token_counts:
        inputs = make_inputs(width, tokens, device)
        linear_flops, attention_flops = block_flops(width, tokens)
        bf16_floor = (linear_flops + attention_flops) / rate * 1e3
        fp8_floor = (linear_flops / 2 + attention_flops) / rate * 1e3

        def row(what: str, ms: float, floor_ms: float, error: float | None = None, peak: float | None = None):
            rows.append({"tokens": tokens, "what": what, "ms": float(f"{ms:.4g}"), "floor ms": float(f"{floor_ms:.4g}"),
                         "x bf16 floor": round(ms / bf16_floor, 3), "x own floor": round(ms / floor_ms, 3),
                         "rel. error": None if error is None else f"{error:.2e}",
                         "peak GiB": None if peak is None else round(peak, 2)})
            print(rows[-1], flush=True)

        q, k, v = (torch.randn(1, tokens, width.heads, width.head_dim, device=device, dtype=torch.bfloat16)
                   for _ in range(3))
        for backend in backends:
            name = dispatch_name(backend)
            ms = timed_ms(functools.partial(dispatch_attention_fn, q, k, v, backend=name), device, args.repeats)
            row(f"attention {backend}", ms, attention_flops / rate * 1e3)
        del q, k, v
        with torch.no_grad():
            set_backend(block, DEFAULT_BACKEND)
            reference = inputs.call(block)
            for backend in backends:
                set_backend(block, backend)
                _reset_peak(device)
                ms = timed_ms(lambda: inputs.call(block), device, args.repeats)
                row(f"block eager {backend}", ms, bf16_floor, rel_error(inputs.call(block), reference),
                    _peak(device))
            best = auto.backend
            compiled = nn.ModuleList([copy.deepcopy(block)])
            set_backend(compiled[0], best)
            blocks = CompiledBlocks(compiled, compile_config).apply()
            t = time.perf_counter()
            out = inputs.call(compiled[0])
            first_s = time.perf_counter() - t
            _reset_peak(device)
            ms = timed_ms(functools.partial(inputs.call, compiled[0]), device, args.repeats)
            row(f"block compiled {best}", ms, bf16_floor, rel_error(out, reference), _peak(device))
            notes.append(f"{tokens} tokens: first compiled call {first_s:.1f} s; dynamo: {blocks.stats()}")
            del compiled, blocks
            try:
                fp8 = nn.ModuleList([copy.deepcopy(block)])
                quantized = quantize_blocks_fp8(fp8, device)
                set_backend(fp8[0], best)
                _reset_peak(device)
                ms = timed_ms(functools.partial(inputs.call, fp8[0]), device, args.repeats)
                row(f"block fp8 eager {best}", ms, fp8_floor, rel_error(inputs.call(fp8[0]), reference),
                    _peak(device))
                blocks = CompiledBlocks(fp8, compile_config).apply()
                out = inputs.call(fp8[0])
                _reset_peak(device)
                ms = timed_ms(functools.partial(inputs.call, fp8[0]), device, args.repeats)
                row(f"block fp8 + compiled {best}", ms, fp8_floor, rel_error(out, reference), _peak(device))
                if tokens == token_counts[0]:
                    notes.append(f"fp8: {len(quantized)} linears quantized (torchao float8 dynamic activation, "
                                 f"rowwise weight)")
                del fp8, blocks
            except QuantizationError as exc:
                notes.append(f"fp8 rows skipped: {exc}")
            except Exception as exc:  # a torchao that does not fit this torch: the other rows still stand
                notes.append(f"fp8 row at {tokens} tokens failed: {type(exc).__name__}: {exc}")
    write_run_results("forward", rows, str(device), args.smoke, command, notes, started, args.out)
    return 0


def _auto_choice(block: MiniMaxH3TransformerBlock, width: Width, device: torch.device):
    """`choose_attention` on a one-block stand-in for the transformer (the config and the backend walk)."""

    class OneBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block
            self.config = argparse.Namespace(num_attention_heads=width.heads, attention_head_dim=width.head_dim)

        def set_attention_backend(self, name: str) -> None:
            set_backend(block, name)

    return choose_attention(OneBlock(), "auto", device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


if __name__ == "__main__":
    sys.exit(main())
