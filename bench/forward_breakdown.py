"""Where a compiled MiniMax-H3 block's time goes at one token count, and what two cheaper forwards would give:
the GPU kernels of one compiled call grouped (GEMM, attention, fused elementwise, other) beside their floors,
the time the GPU sits idle between them and the host calls that can make it wait, each call also timed with
`--back-to-back` calls queued (as a 50-block forward queues them), inductor's `max-autotune-no-cudagraphs`
against its default, FP8 with rowwise against tensorwise scales (`--fp8`) and, `--static`, the block compiled for
its one token count against the served dynamic one. `--attention` overrides auto. Each compiled variant's notes
say what layouts (sizes, strides) its graph hands the attention kernel (`attention_inputs`, from inductor's code),
and the eager bf16 and FP8 blocks' attention calls are replayed alone beside fresh N(0, 1) q/k/v of the same
layout (`bench.attention_replay`): whether the kernel's time follows the values it reads or the block around it.
Beside every timed row and the profiled call: the SM clock (mean/lowest) and board power over it, from
`nvidia-smi` samples (read only), since a call timed under sustained load may not run at the profiled call's
clocks.

    python -m bench.forward_breakdown                 # one GPU, 37,774 tokens (~5 min with max-autotune)
    python -m bench.forward_breakdown --smoke         # CPU, tiny width: the code path only

The block, inputs, attention choice and floors are `bench.forward`'s (diffusers' `MiniMaxH3TransformerBlock`,
random bf16 weights, `engine.attention: auto`'s backend). GEMM floor: projection FLOPs at `--gemm-tflops`;
attention floor: QK^T and PV FLOPs at the same rate; the elementwise floor: the bytes the block's norms,
modulation, rotary, gating and residuals must move at least (`ELEMENTWISE_PASSES` reads/writes of the hidden
rows, `FFN_PASSES` of the SwiGLU rows) at `--hbm-tbps`. `rel. error` is against the eager block on the same
backend. Writes bench/results/forward-breakdown-<device>.md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import logging
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

import torch
from torch import nn

from bench.attention_replay import caught_attention, fresh_like
from bench.common import write_run_results
from bench.forward import (GEMM_TFLOPS, RELEASED, SMOKE, _auto_choice, _peak, _reset_peak, block_flops, make_block,
                           make_inputs, rel_error, set_backend, timed_ms)
from engine.compiled import CompiledBlocks, CompileOptions
from engine.fp8 import QuantizationError, check_fp8_device

#: H200 HBM3e as measured for bench.adaln's floors is 4.8 TB/s nominal; H100 SXM 3.35. Override per device.
HBM_TBPS = 4.8
#: Passes over the [S, hidden] bf16 rows outside the GEMMs and attention: two norms (read + write each), two
#: modulations, rotary on q and k (read + write each, 7168 wide ~ hidden), two gated residual adds (3 reads + 1
#: write each): ~20 row-widths. A lower bound only if inductor fuses them as far as it can.
ELEMENTWISE_PASSES = 20
#: SwiGLU: read gate and up, write the product ([S, ffn] each).
FFN_PASSES = 3

KERNEL_GROUPS = (  # (group, substrings of the kernel names that put a kernel in it), first match wins
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "sm90", "matmul", "scaled_mm")),
    ("fused elementwise (triton)", ("triton",)),
)


def kernel_group(name: str) -> str:
    lowered = name.lower()
    for group, needles in KERNEL_GROUPS:
        if any(needle in lowered for needle in needles):
            return group
    return "other"


@dataclass(frozen=True)
class ClockReading:
    """The GPU's mean and lowest SM clock (MHz) and mean board power (W) over a region, from `n` samples."""

    mean_mhz: float
    min_mhz: float
    mean_w: float
    n: int


@contextlib.contextmanager
def output_code() -> Iterator[list[str]]:
    """The wrapper code (`def call(args)`) of every graph inductor compiles or loads from its cache inside the
    `with`, as inductor logs it (its `output_code` artifact), kept instead of printed."""
    codes: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "def call(" in message:
                codes.append(message)

    # The modules that log it, imported first: their loggers exist from their import on.
    importlib.import_module("torch._inductor.compile_fx")
    importlib.import_module("torch._inductor.codecache")
    importlib.import_module("torch._inductor.graph")
    torch._logging.set_logs(output_code=True)
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith("torch._inductor") and name.endswith("__output_code")]
    keep = Keep()
    for logger in loggers:
        logger.propagate = False  # torch's own handlers above would print every graph's code
        logger.addHandler(keep)
    try:
        yield codes
    finally:
        for logger in loggers:
            logger.removeHandler(keep)
            logger.propagate = True
        torch._logging.set_logs()


_ATTENTION_CALL = re.compile(r"torch\.ops\.([\w.]*(?:attention|flash)[\w.]*)\((.*)\)\s*$", re.IGNORECASE)
_EMPTY = re.compile(r"^(buf\d+) = empty_strided_\w+\((\(.*?\)), (\(.*?\))")
_ASSERTED = re.compile(r"^assert_size_stride\((\w+), (\(.*?\)), (\(.*?\))")
_REINTERPRET = re.compile(r"^reinterpret_tensor\((\w+), (\(.*?\)), (\(.*?\)), (.+)\)$")


def _top_level_args(text: str) -> list[str]:
    args, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
    return [a for a in args + [text[start:].strip()] if a]


def attention_inputs(code: str) -> list[str]:
    """Each attention call in a wrapper's `code` with the sizes and strides of the tensors it is handed (a buffer's
    from its allocation or the graph input's asserted layout; a view's own): where two graphs hand one kernel
    different layouts, its time may differ though its FLOPs do not."""
    layouts: dict[str, str] = {}
    lines = [line.strip() for line in code.splitlines()]
    for line in lines:
        if match := _EMPTY.match(line) or _ASSERTED.match(line):
            layouts.setdefault(match.group(1), f"{match.group(2)} strides {match.group(3)}")
    calls = []
    for line in lines:
        match = _ATTENTION_CALL.search(line)
        if match is None or line.startswith(("#", "assert")):
            continue
        described = []
        for arg in _top_level_args(match.group(2))[:3]:  # query, key, value
            if view := _REINTERPRET.match(arg):
                described.append(f"{view.group(1)} viewed {view.group(2)} strides {view.group(3)} "
                                 f"offset {view.group(4)}")
            else:
                described.append(f"{arg} {layouts.get(arg, '(layout not in the code)')}")
        calls.append(f"{match.group(1)}: " + "; ".join(described))
    return calls


def parse_clock_samples(text: str, since: datetime | None = None) -> ClockReading | None:
    """`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits` lines
    ("2026/12/06 22:52:01.123, 1980, 512.3"), those stamped before `since` left out."""
    samples = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        try:
            stamp = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f")
            sample = (float(fields[1]), float(fields[2]))
        except (ValueError, IndexError):
            continue  # "[N/A]" or a torn last line
        if since is None or stamp >= since:
            samples.append(sample)
    if not samples:
        return None
    mhz = [m for m, _ in samples]
    return ClockReading(sum(mhz) / len(mhz), min(mhz), sum(w for _, w in samples) / len(samples), len(samples))


class ClockSampler:
    """Samples the SM clock and board power every 50 ms while a region runs (`nvidia-smi -lms`, leaving the
    card's settings alone): the profiled call and the timed ones may not run at the same clocks, and a
    sustained load can draw the card into its power limit. `reading` is None on CPU or without nvidia-smi."""

    def __init__(self, device: torch.device):
        self.device, self.reading = device, None
        self._proc: subprocess.Popen | None = None
        self._out = None
        self._since: datetime | None = None

    def __enter__(self) -> "ClockSampler":
        if self.device.type == "cuda" and shutil.which("nvidia-smi"):
            uuid = torch.cuda.get_device_properties(self.device).uuid
            # No pause for it to start (an idle GPU lowers its clocks): its first sample comes ~0.1-0.3 s in.
            self._since = datetime.now()
            self._out = tempfile.TemporaryFile(mode="w+")  # a pipe read only at the end would fill and stall it
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--id=GPU-{uuid}", "--query-gpu=timestamp,clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", "-lms", "50"],
                stdout=self._out, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._out.seek(0)
            self.reading = parse_clock_samples(self._out.read(), self._since)
            self._out.close()


@dataclass(frozen=True)
class Breakdown:
    """One profiled call: GPU ms per kernel group, the GPU's idle ms between its first and last kernel, the
    host's CUDA calls that can stall the queue (syncs, allocations) by name, and the ten costliest kernels."""

    per_group: dict[str, float]
    idle_ms: float
    host_stalls: dict[str, int]
    top: list[tuple[str, float, int]]
    clocks: ClockReading | None = None  # over the profiled call


#: CUDA runtime/driver calls that can make the host wait on the GPU (a sync, an allocation, a copy).
STALL_CALLS = ("Synchronize", "Malloc", "Free", "Memcpy")


def kernel_breakdown(call, device: torch.device) -> Breakdown:
    """Profile `call` after a warm-up: its kernels and the GPU's idle time from a GPU-only trace (tracing the
    host's ops slows its launches, which would widen the very gaps measured), the host's CUDA calls from a
    second call traced on both sides."""
    from torch.profiler import ProfilerActivity, profile

    def traced(activities):
        torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            call()
            torch.cuda.synchronize(device)
        return prof.events()

    call()
    per_group: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans: list[tuple[float, float]] = []
    with ClockSampler(device) as clocks:
        gpu_events = traced([ProfilerActivity.CUDA])
    for event in gpu_events:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time / 1e3
        per_group[kernel_group(event.name)] += ms
        per_kernel[event.name][0] += ms
        per_kernel[event.name][1] += 1
        spans.append((event.time_range.start, event.time_range.end))
    stalls: dict[str, int] = defaultdict(int)
    for event in traced([ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        if (event.device_type != torch.autograd.DeviceType.CUDA and event.name.startswith("cu")
                and any(name in event.name for name in STALL_CALLS)):
            stalls[event.name] += 1
    top = sorted(((name[:90], ms, int(n)) for name, (ms, n) in per_kernel.items()), key=lambda t: -t[1])[:10]
    return Breakdown(dict(per_group), idle_between(spans) / 1e3, dict(stalls), top, clocks.reading)


def idle_between(spans: list[tuple[float, float]]) -> float:
    """The time between the first start and the last end that no interval covers (kernels may overlap)."""
    idle, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is not None and start > reach:
            idle += start - reach
        reach = end if reach is None else max(reach, end)
    return idle


def fp8_block(block: nn.Module, granularity: str) -> nn.Module:
    """A copy of `block` with its attention and feed-forward linears in torchao float8 (dynamic activations),
    `granularity` "row" (what `engine.quantization: fp8` serves) or "tensor" (one scale per tensor)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    from engine.fp8 import fp8_targets

    copied = nn.ModuleList([copy.deepcopy(block)])
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if granularity == "row" else PerTensor())
    targets = set(fp8_targets(copied))
    quantize_(copied, config, filter_fn=lambda module, fqn: fqn in targets)
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny width, compile backend eager")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gemm-tflops", type=float, default=GEMM_TFLOPS)
    parser.add_argument("--hbm-tbps", type=float, default=HBM_TBPS)
    parser.add_argument("--no-autotune", action="store_true", help="skip the max-autotune row (minutes to compile)")
    parser.add_argument("--back-to-back", type=int, default=8,
                        help="calls queued without a sync for the per-call row a deep stack of blocks sees")
    parser.add_argument("--attention", default=None, help="a diffusers backend name instead of auto's choice")
    parser.add_argument("--static", action="store_true",
                        help="also the block compiled with static sizes (one graph per token count; the served blocks "
                        "are dynamic): what the symbolic sequence length costs inductor's kernels")
    parser.add_argument("--fp8", default="row,tensor", help="FP8 scale granularities to time (comma list, or none)")
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    command = " ".join(["python -m bench.forward_breakdown", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    width = SMOKE if args.smoke else RELEASED
    tokens = args.tokens or (97 if args.smoke else 37774)
    backend = "eager" if device.type == "cpu" else "inductor"
    rate, hbm = args.gemm_tflops * 1e12, args.hbm_tbps * 1e12

    linear_flops, attention_flops = block_flops(width, tokens)
    floors = {
        "gemm": linear_flops / rate * 1e3,
        "attention": attention_flops / rate * 1e3,
        "fused elementwise (triton)": 2 * tokens * (ELEMENTWISE_PASSES * width.hidden + FFN_PASSES * width.ffn)
        / hbm * 1e3,
    }
    bf16_floor = (linear_flops + attention_flops) / rate * 1e3
    notes = [f"{tokens} tokens, hidden {width.hidden}, {width.heads} heads x {width.head_dim}, ffn {width.ffn}; "
             f"median of {args.repeats} after warm-up",
             f"floors: GEMM and attention FLOPs / {args.gemm_tflops:g} TFLOP/s bf16 (fp8 projections at 2x); "
             f"elementwise {ELEMENTWISE_PASSES} hidden-row and {FFN_PASSES} ffn-row passes / {args.hbm_tbps:g} TB/s"]
    rows: list[dict] = []

    def row(what: str, ms: float, floor_ms: float, error: float | None = None, peak: float | None = None,
            compile_s: float | None = None, clocks: ClockReading | None = None):
        rows.append({"what": what, "ms": float(f"{ms:.4g}"), "floor ms": float(f"{floor_ms:.4g}"),
                     "x floor": round(ms / floor_ms, 3) if floor_ms else None,
                     "x bf16 block floor": round(ms / bf16_floor, 3),
                     "rel. error": None if error is None else f"{error:.2e}",
                     "peak GiB": None if peak is None else round(peak, 2),
                     "first call s": None if compile_s is None else round(compile_s, 1),
                     "SM MHz mean/min": None if clocks is None else f"{clocks.mean_mhz:.0f}/{clocks.min_mhz:.0f}",
                     "W": None if clocks is None else round(clocks.mean_w)})
        print(rows[-1], flush=True)

    started = time.perf_counter()
    block = make_block(width, device)
    auto = _auto_choice(block, width, device)
    notes.append(f"engine.attention auto: {auto.summary()}")
    attention = args.attention or auto.backend
    set_backend(block, attention)
    inputs = make_inputs(width, tokens, device)
    with torch.no_grad():
        reference = inputs.call(block)

        def layout_notes(label: str, codes: list[str]) -> None:
            """What each compiled variant hands its attention kernel (inductor picks the q/k/v layouts per graph)."""
            if backend != "inductor":
                return
            calls = [call for code in codes for call in attention_inputs(code)]
            notes.extend(f"{label}: attention reads {call}" for call in calls)
            if not calls:
                notes.append(f"{label}: no attention call in the {len(codes)} wrapper(s) inductor logged")

        def compiled_row(label: str, module_list: nn.ModuleList, options: CompileOptions, error_of=reference):
            blocks = CompiledBlocks(module_list, options).apply()
            t = time.perf_counter()
            with output_code() as codes:
                out = inputs.call(module_list[0])
            first_s = time.perf_counter() - t
            layout_notes(label, codes)
            _reset_peak(device)
            with ClockSampler(device) as clocks:
                ms = timed_ms(functools.partial(inputs.call, module_list[0]), device, args.repeats)
            row(label, ms, bf16_floor, rel_error(out, error_of), _peak(device), first_s, clocks.reading)
            back_to_back_row(functools.partial(inputs.call, module_list[0]), bf16_floor)
            notes.append(f"{label}: dynamo {blocks.stats()}")
            return ms

        def breakdown_rows(found: Breakdown, label: str, gemm_speedup: int, floor_ms: float):
            row("  profiled call: kernels + GPU idle", sum(found.per_group.values()) + found.idle_ms, floor_ms,
                clocks=found.clocks)
            for group in ("gemm", "attention", "fused elementwise (triton)", "other"):
                row(f"  of which {group}", found.per_group.get(group, 0.0),
                    floors.get(group, 0.0) / (gemm_speedup if group == "gemm" else 1))
            row("  of which GPU idle between kernels", found.idle_ms, 0.0)
            notes.append(f"{label}host calls that can stall the queue, per call: {found.host_stalls or 'none'}")
            notes.extend(f"{label}kernel {ms_:.2f} ms x{n}: {name}"
                         for name, ms_, n in found.top[:10 if not label else 5])

        def back_to_back_row(call, floor_ms: float):
            """One call timed alone waits on its own launches (Python, guards, a CuTe kernel's host side); in a
            forward of 50 blocks the host runs ahead of the GPU. Per call over `--back-to-back` queued calls."""
            n = args.back_to_back
            with ClockSampler(device) as clocks:
                ms = timed_ms(lambda: [call() for _ in range(n)], device, args.repeats) / n
            row(f"  {n} back to back, per call", ms, floor_ms, clocks=clocks.reading)

        def attention_alone_rows(blocks: list[tuple[str, nn.Module]]):
            """Each eager block's attention call replayed alone (`bench.attention_replay`), then on fresh N(0, 1)
            q/k/v of the first one's layout: `--back-to-back` calls queued, as in a forward, in two rounds over
            the variants (the row is their mean, its clocks the second round's; the notes give each round's time)
            so a drift of the clocks falls on all."""
            variants = []
            for label, module in blocks:
                call, _ = caught_attention(functools.partial(inputs.call, module))
                variants.append((f"attention alone on the {label}'s q/k/v", call))
                notes.append(f"attention alone on the {label}'s q/k/v: {call.describe()}")
            variants.append(("attention alone on fresh N(0, 1) q/k/v", fresh_like(variants[0][1])))
            n = args.back_to_back
            rounds: dict[str, list[tuple[float, ClockReading | None]]] = defaultdict(list)
            for _ in range(2):
                for label, call in variants:
                    with ClockSampler(device) as clocks:
                        ms = timed_ms(lambda call=call: [call() for _ in range(n)], device, args.repeats) / n
                    rounds[label].append((ms, clocks.reading))
            for label, _ in variants:
                (first, _), (second, clocks) = rounds[label]
                row(f"{label}, {n} queued, per call", (first + second) / 2, floors["attention"], clocks=clocks)
                notes.append(f"{label}: rounds {first:.4g} / {second:.4g} ms per call")
            del variants

        with ClockSampler(device) as clocks:
            ms = timed_ms(lambda: inputs.call(block), device, args.repeats)
        row(f"block eager {attention}", ms, bf16_floor, clocks=clocks.reading)
        back_to_back_row(lambda: inputs.call(block), bf16_floor)
        default = nn.ModuleList([copy.deepcopy(block)])
        compiled_row(f"block compiled {attention} (inductor default)", default,
                     CompileOptions(backend=backend))
        if device.type == "cuda":
            breakdown_rows(kernel_breakdown(functools.partial(inputs.call, default[0]), device), "", 1, bf16_floor)
        del default
        if args.static:
            static = nn.ModuleList([copy.deepcopy(block)])
            compiled_row(f"block compiled {attention} (inductor default, static sizes)", static,
                         CompileOptions(backend=backend, dynamic=False))
            if device.type == "cuda":
                breakdown_rows(kernel_breakdown(functools.partial(inputs.call, static[0]), device), "static ", 1,
                               bf16_floor)
            del static
        if not args.no_autotune and device.type == "cuda":
            compiled_row(f"block compiled {attention} (max-autotune-no-cudagraphs)", nn.ModuleList([copy.deepcopy(block)]),
                         CompileOptions(backend=backend, inductor_mode="max-autotune-no-cudagraphs"))
        replayed: list[tuple[str, nn.Module]] = [("bf16 block", block)]  # eager blocks whose attention to replay
        try:
            check_fp8_device(device)
            fp8_floor = (linear_flops / 2 + attention_flops) / rate * 1e3
            granularities = [g for g in args.fp8.split(",") if g in ("row", "tensor")]
            if "row" in granularities:
                replayed.append(("fp8 rowwise block", fp8_block(block, "row")[0]))
            for granularity in granularities:
                quantized = fp8_block(block, granularity)
                blocks = CompiledBlocks(quantized, CompileOptions(backend=backend)).apply()
                t = time.perf_counter()
                with output_code() as codes:
                    out = inputs.call(quantized[0])
                first_s = time.perf_counter() - t
                layout_notes(f"block fp8 {granularity}wise + compiled {attention}", codes)
                _reset_peak(device)
                with ClockSampler(device) as clocks:
                    ms = timed_ms(functools.partial(inputs.call, quantized[0]), device, args.repeats)
                row(f"block fp8 {granularity}wise + compiled {attention}", ms, fp8_floor, rel_error(out, reference),
                    _peak(device), first_s, clocks.reading)
                back_to_back_row(functools.partial(inputs.call, quantized[0]), fp8_floor)
                breakdown_rows(kernel_breakdown(functools.partial(inputs.call, quantized[0]), device),
                               f"fp8 {granularity}wise ", 2, fp8_floor)
                del quantized, blocks
        except (QuantizationError, ImportError) as exc:  # no float8 on this device, or no torchao installed
            notes.append(f"fp8 rows skipped: {exc}")
        attention_alone_rows(replayed)
    write_run_results("forward-breakdown", rows, str(device), args.smoke, command, notes, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
