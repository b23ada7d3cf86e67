"""The transformer forward's kernels, set up once per engine: FP8 block linears (`engine.quantization`), the
attention backend (`engine.attention`), compiled blocks (`engine.compile`) and the start-up warm-up of the
configured canvases (the runs that make their graphs, not their whole schedules). The engine calls
`prepare_compile` before it loads the checkpoint, `quantize` right after the load, `install` after every hook
(ExternalModulation, sequence parallel, offloader, Cache-DiT) is in place, and `warm_up` once it can serve, after its
plan cache and text encoder are built (beside them with `compile.overlap_loads`).

What it set up is `describe()["forward"]` (`GET /v1/models`) and a line of the start-up log.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from diffusers import MiniMaxH3Transformer3DModel

from engine.attention import AttentionChoice, ChoiceMemo, choose_attention
from engine.compiled import CompiledBlocks, CompileStats, compiler_modules, import_in_background, writable_folder
from engine.config import CompileConfig, WarmupCanvas
from engine.fp8 import LinearPrecision, quantize_blocks_fp8
from engine.limits import Quality
from model.adaln import ExternalModulation, Modulation

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: The file in `compile.cache_dir` that keeps `engine.attention: auto`'s choice (`attention_memo`).
ATTENTION_MEMO = "attention-auto.json"
#: Prompt rows of the warm-up's stand-in embedding (the sequence dimension is dynamic: any length would do).
WARMUP_TEXT_TOKENS = 64


def warmup_forwards(dynamic: bool) -> int:
    """Forwards of one warm-up run (its steps: forwards + 1). With dynamic sizes a schedule's first forward (one
    timestep row: both sigmas are 1) and every later one (two or more rows) share one graph (the row count is
    unbacked: `engine.compiled`); static, they are two."""
    return 1 if dynamic else 2


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
        return {"attention": {**dataclasses.asdict(self.attention), "ms": self.attention.ms,
                              "tflops": self.attention.tflops},
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


def prepare_compile(compile_config: CompileConfig, device: torch.device) -> None:
    """With compiled blocks, first check `compile.cache_dir` (CompileCacheError now, not after the checkpoint's
    load); with `compile.overlap_loads` too, import the compiler on a thread while the caller loads the checkpoint
    (`engine.compiled.import_in_background`); otherwise the warm-up's first compile imports it."""
    if compile_config.mode == "blocks" and compile_config.cache_dir is not None:
        writable_folder(compile_config.cache_dir)
    if compile_config.mode == "blocks" and compile_config.overlap_loads:
        import_in_background(compiler_modules(compile_config.backend, device))


def install(transformer: MiniMaxH3Transformer3DModel, *, attention: str, compile_config: CompileConfig, quantized_linears: int,
            quantization: str, device: torch.device, precision: LinearPrecision | None = None,
            modulation: ExternalModulation | None = None,
            lora_active: Callable[[], bool] = lambda: False) -> ForwardKernels:
    """Choose the attention backend (measured on `device` for `auto`), then compile the blocks if configured
    (`modulation`: online AdaLN's rows, which the compiled blocks read; `lora_active`: whether an unfused adapter
    is on, `engine.adapters.AdapterSet.lora_active`)."""
    choice = choose_attention(transformer, attention, device, memo=attention_memo(compile_config))
    compiled = CompiledBlocks(transformer.transformer_blocks, compile_config.options, modulation,
                              lora_active).apply() if compile_config.mode == "blocks" else None
    return ForwardKernels(choice, quantization, quantized_linears, compiled, precision)


class StandInPlans:
    """A warm-up request's AdaLN rows: zeros of each step's plan width (`ExternalModulation.stand_in`), in place of
    the plan cache's `PreparedPlans` (the same `modulation`, `stats`, `release`). A warm-up makes graphs; its
    output is dropped, so its rows need not be the checkpoint's: they are shaped, typed and placed as a plan's,
    which is all the graphs depend on."""

    keys: tuple = ()  # no plan of the cache's
    stats = None  # the plan cache was not asked

    def __init__(self, modulation: ExternalModulation, plans: Sequence[torch.Tensor], device: torch.device):
        self._modulation = modulation
        self._widths = [timesteps.numel() for timesteps in plans]
        self._device = device

    def modulation(self, step_index: int) -> Modulation:
        return self._modulation.stand_in(self._widths[step_index], self._device)

    def release(self) -> None:
        pass


def attention_memo(compile_config: CompileConfig) -> ChoiceMemo | None:
    """Where `auto` keeps its choice: beside the compiled blocks' on-disk cache, whose graphs it decides (None
    without one: nothing would be reused)."""
    if compile_config.mode != "blocks" or compile_config.cache_dir is None:
        return None
    return ChoiceMemo(Path(compile_config.cache_dir) / ATTENTION_MEMO)


@dataclass(frozen=True)
class WarmupRun:
    """One warm-up request: a schedule's first `warmup_forwards` forwards of `canvas` on one weight tier, with the
    canvas's adapters on."""

    index: int  # in engine.compile.warmup (errors and the log name it)
    canvas: WarmupCanvas
    tokens: int  # packed rows of one of its forwards (with WARMUP_TEXT_TOKENS prompt rows)
    quality: Quality  # the weight tier: lossless (bf16 linears) or fp8


@dataclass(frozen=True)
class _GraphKey:
    """What gives a canvas compiled graphs of its own: LoRA layers on are other graphs, and without a symbolic
    sequence length so is every token count (None: dynamic, one graph for all). The weight tier is another too:
    every chosen canvas runs on each. (A warm-up canvas is a t2va request, on the Ref2VA partition too: condition
    rows only lengthen the sequence, so with a symbolic length fl2va / ref2va requests share its graphs.)"""

    adapters: tuple[str, ...]
    tokens: int | None


def warmup_runs(canvases: Sequence[WarmupCanvas], tokens: Sequence[int], tiers: Sequence[Quality],
                dynamic: bool) -> tuple[WarmupRun, ...]:
    """The runs that compile every graph the configured `canvases` (`tokens[i]` rows each) need: per graph key the
    canvas of fewest tokens (its forwards are the cheapest; the others would hit its graphs), on every tier, in
    the configured order."""
    chosen: dict[_GraphKey, int] = {}
    for index, canvas in enumerate(canvases):
        key = _GraphKey(canvas.adapters, None if dynamic else tokens[index])
        if key not in chosen or tokens[index] < tokens[chosen[key]]:
            chosen[key] = index
    return tuple(WarmupRun(index, canvases[index], tokens[index], quality)
                 for quality in tiers for index in sorted(chosen.values()))


def warm_up(kernels: ForwardKernels, canvases: tuple[WarmupCanvas, ...], tiers: Sequence[Quality], *,
            tokens: Callable[[WarmupCanvas], int], run: Callable[[WarmupRun], int], meanwhile: Callable[[], T],
            overlap: bool, device: torch.device) -> T:
    """Check every canvas (`tokens`: its packed rows, or ValueError when the engine refuses it: that fails the
    start naming it), then, with compiled blocks, `run` each of `warmup_runs` (it returns the forwards it ran)
    and start counting compiles as after the warm-up; returns what `meanwhile` returns. With compile off nothing
    runs: there is no graph to make.

    `meanwhile` is the rest of the engine's start (its plan cache: pinned host memory and a probe rebuild; its text
    encoder load: mostly disk and copies; the GIL released for most of both) and runs on this thread. The
    warm-up needs neither: its AdaLN rows are stand-ins (`StandInPlans`). With `overlap` the runs without
    adapters go on a thread of their own while it does, so a warm start would pay the longer of the two rather
    than their sum, were they not to contend for Python's lock (on an H100 they did: the engine's default is no
    overlap, `compile.overlap_loads`). The runs naming adapters follow it: loading an adapter makes parameters,
    and the loads' `init_empty_weights` would put those on meta. No overlap for a replica of several ranks: its
    warm-up's collectives must not interleave with the loads' (text encoder TP, the sharded plan rebuild)."""
    counts = []
    for index, canvas in enumerate(canvases):
        with _naming(index, canvas):
            counts.append(tokens(canvas))
    if kernels.compiled is None:
        return meanwhile()
    runs = warmup_runs(canvases, counts, tiers, kernels.compiled.options.dynamic)
    early = tuple(one for one in runs if overlap and not one.canvas.adapters)
    late = tuple(one for one in runs if one not in early)
    warm = _WarmupRuns(run, device)
    if early:
        thread = threading.Thread(target=warm.run_all, args=(early,), name="compile-warm-up", daemon=True)
        thread.start()
        try:
            result = meanwhile()
        finally:
            thread.join()  # a failed load is raised once the thread ended, not while it runs on a half-built engine
        warm.raise_failure()
    else:
        result = meanwhile()
    warm.run_all(late)
    warm.raise_failure()
    kernels.compiled.warmup_ended(warm.seconds, warm.forwards)
    if canvases:
        logger.info("compile warm-up: %d forwards in %.2f s (%d runs for %d canvases: %s; %d beside the loads)",
                    warm.forwards, warm.seconds, len(runs), len(canvases),
                    ", ".join(f"[{one.index}] {one.tokens} tokens {one.quality}" for one in runs), len(early))
    return result


def cuda_index(device: torch.device) -> int | None:
    """The CUDA device index `device` means on the calling thread (`cuda` alone: its current device); None for
    another device type."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


class _WarmupRuns:
    """Runs warm-up requests on whichever thread calls `run_all`, adding up their forwards and seconds and
    keeping the first failure (named after its canvas) for the starting thread to raise."""

    def __init__(self, run: Callable[[WarmupRun], int], device: torch.device):
        self._run = run
        # A new thread starts on device 0: the runs go on the starting thread's device ("cuda" names no index).
        self._cuda_index = cuda_index(device)
        self.forwards = 0
        self.seconds = 0.0
        self._failure: BaseException | None = None

    def run_all(self, runs: Sequence[WarmupRun]) -> None:
        if not runs:
            return
        begin = time.perf_counter()
        try:
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)
            for one in runs:
                with _naming(one.index, one.canvas):
                    self.forwards += self._run(one)
        except BaseException as exc:
            self._failure = exc
        finally:
            self.seconds += time.perf_counter() - begin

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


@contextmanager
def _naming(index: int, canvas: WarmupCanvas) -> Iterator[None]:
    """A ValueError inside, as one naming the configured canvas."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"engine.compile.warmup[{index}] ({canvas.width}x{canvas.height}, {canvas.seconds:g} s): "
                         f"{exc}") from exc
