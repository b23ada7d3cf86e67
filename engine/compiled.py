"""Regional compile of the transformer's repeated blocks (`engine.compile`).

Every `transformer_blocks[i]` gets one shared `torch.compile` of `MiniMaxH3TransformerBlock.forward` with the
block passed as an argument, so one compiled graph serves all 50 blocks (dynamo guards on the module's shapes,
not its identity) and the module's own `__call__` stays eager. That keeps every hook we hang on a block outside
the graph: the offloader's pre/post forward hooks (`offload/`), Cache-DiT's wrapper around the block stack and
the pre-hooks of tests. What runs inside a block is inside the graph: ExternalModulation's `_BlockRows` (it
reads the forward's rows as a graph input), the attention processor with the backend `engine.attention` chose,
and the sequence-parallel processor's compute (its exchanges are `torch.compiler.disable`d, so the graph breaks
around them: `parallel.sequence`; SP2 compiled == SP1 compiled bit for bit under dynamo's eager backend, 5 frames and
3 counted graph breaks per rank on the tiny model: tests/test_parallel_compile.py).

The sequence is dynamic (`dynamic: true`): one graph serves every token count, so a canvas or a prompt length never
seen before does not recompile, and every timestep count: the row count of `temb` (and of ExternalModulation's
rows) is unbacked, so a schedule's first forward (one row: both sigmas are 1) and every later one (two or more
rows) share the graph. Backed, dynamo would specialize the size of 1 and compile a second graph: a warm start traced
and loaded both. (Tracing every size size-oblivious instead fails on torch 2.11 at the rotary embedding's
broadcast of a size-1 dimension.) Every other size of the block's inputs is marked static (`VARYING_DIMS`), and the
module ints are constants: the heads and widths, so the kernels are generated for the model's head dim and rotary
width, not for any. The one int that differs between blocks, the AdaLN row block's index, is a buffer
(`model.adaln._BlockRows.row_index`): an input of the graph like a weight.
Floats the block reads (the norms' eps, dropout's p) are constants of the graph. Dynamo's default traces every float
as an input, fails to keep the eps that reach ATen ops as one and restarts the whole trace with them constant: a
third of a warm start's compile, for the same graph. Only a LoRA layer's scale (peft's `scaling`) varies between
calls: while an unfused adapter is on (`lora_active`) the floats are traced as inputs, so a request's adapter scale
compiles nothing (the adapter's layers on are another graph anyway).
`dynamic: false` gives one graph per token count (each prompt length recompiles): for measuring the static graph,
not for serving.

Compiled and eager differ by reassociation (bf16 fusion): the bound is stated where it is tested
(tests/test_forward_kernels.py, the inductor test) and measured per block at the released width (bench/forward.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from engine.precompiled import FOLDER as PRECOMPILED_FOLDER
from engine.precompiled import PrecompiledGraphs
from model.adaln import ExternalModulation, Modulation

logger = logging.getLogger(__name__)

CompileBackend = Literal["inductor", "aot_eager", "eager"]
InductorMode = Literal["default", "max-autotune-no-cudagraphs"]


class CompileCacheError(ValueError):
    """`compile.cache_dir` names no folder this process can write (inductor would fail the warm-up's first compile
    with a bare OS error naming some path below it)."""


def writable_folder(path: str) -> str:
    """`path` made absolute, created if missing and written once (a probe file, removed), so a folder the start
    cannot use fails it naming the field; CompileCacheError otherwise."""
    folder = os.path.abspath(path)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as exc:
        raise CompileCacheError(f"engine.compile.cache_dir: {path!r} is not a folder this process can write "
                                f"({exc}); name a local folder it can, or null for inductor's default") from exc
    return folder


@dataclass(frozen=True)
class CompileOptions:
    """How the blocks compile (`engine.config.CompileConfig` holds the served values and their meaning)."""

    backend: CompileBackend = "inductor"
    dynamic: bool = True
    inductor_mode: InductorMode = "default"
    cache_dir: str | None = None
    precompiled: bool = True  # inductor with a cache_dir: keep whole graphs there (engine.precompiled)


def compiler_modules(backend: CompileBackend, device: torch.device) -> tuple[str, ...]:
    """What a block's first compile imports that `import torch` did not: dynamo's backend wrappers, and for
    inductor its lowering and AOTAutograd (~1.3 s of a warm start on a CPU) and, for a GPU, Triton."""
    modules = ["torch._dynamo.repro.after_dynamo"]
    if backend in ("inductor", "aot_eager"):
        modules.append("torch._functorch.aot_autograd")
    if backend == "inductor":
        modules.append("torch._inductor.compile_fx")
        if device.type == "cuda":
            modules += ["triton", "torch._inductor.runtime.triton_heuristics"]
    return tuple(modules)


def import_in_background(modules: tuple[str, ...]) -> threading.Thread:
    """Import `modules` on a daemon thread, for a caller about to load a checkpoint: that load mostly waits on the
    disk and the device with the GIL released, so the imports cost the start little and the first compile none.
    Nothing waits for the thread: a module it is still importing makes the compile's own import wait for it (the
    import system's per-module lock), and one it could not import is imported (and fails) there again."""

    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as exc:  # e.g. no Triton: the first compile says so where it needs it
                logger.debug("background import of %s failed: %s", name, exc)
                return

    thread = threading.Thread(target=run, name="compiler-imports", daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True)
class CompileStats:
    """Dynamo's frame counters for this process (`describe()["forward"]["compile"]`, `GenerationStats`)."""

    frames_compiled: int  # graphs dynamo compiled since the blocks were wrapped
    since_warmup: int  # of those, compiled after the warm-up ended (the serving goal: 0)
    graph_breaks: int
    warmup_s: float | None  # None: no warm-up ran
    warmup_forwards: int | None  # transformer forwards the warm-up ran (None: no warm-up ran)
    graphs_loaded: int = 0  # whole graphs read from compile.cache_dir at start (compile.precompiled): no trace
    graphs_load_s: float = 0.0  # seconds the start spent reading them (part of warmup_s)


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


#: The block forward's arguments whose sizes vary between calls, and which dimension: the packed sequence (a canvas,
#: a prompt length, a rank's share under sequence parallelism) and `temb`'s rows (the forward's distinct timesteps).
#: Every other dimension of them is marked static: the hidden, rotary and timestep-embedding widths, the batch.
VARYING_DIMS = {"hidden_states": 1, "temb": 0, "adaln_indices": 0, "rotary_emb": 0}


def _mark_static_but(tensor: torch.Tensor, varying: int) -> None:
    for dim in range(tensor.dim()):
        if dim != varying:
            torch._dynamo.mark_static(tensor, dim)


def _dynamic_sizes(forward: Callable[..., object]) -> Callable[[tuple, dict], None]:
    """A function marking a call's sizes: those of `VARYING_DIMS` vary, the others are static. `dynamic: true`
    alone makes every size symbolic unless a guard pins it, and none pins the rotary width: the norm + RoPE kernel
    was generated for any width, and the trace reasoned about it (on CPU, with the heads no longer a traced int,
    `model.adaln._BlockRows.row_index`, a warm start's trace took 1.0 s instead of 2.0). `temb`'s row count is
    unbacked: dynamo specializes a backed size of 1, so a schedule's first forward (one row: both sigmas are 1) would
    compile a second graph beside every later one's (two or more rows), and a warm start would trace and load both.
    ValueError for a block forward without one of these parameters (its sizes would silently compile more graphs
    at the first requests)."""
    names = list(inspect.signature(forward).parameters)  # (self, hidden_states, temb, ...): a call's args too
    missing = [name for name in VARYING_DIMS if name not in names]
    if missing:
        raise ValueError(f"the blocks' forward takes no {', '.join(f'`{n}`' for n in missing)} (parameters: "
                         f"{names}): its varying sizes cannot be marked")
    positions = {name: names.index(name) for name in VARYING_DIMS}

    def mark(args: tuple, kwargs: dict) -> None:
        for name, varying in VARYING_DIMS.items():
            value = kwargs[name] if name in kwargs else args[positions[name]]
            for tensor in value if isinstance(value, tuple) else (value,):
                _mark_static_but(tensor, varying)
            if name == "temb":
                torch._dynamo.decorators.mark_unbacked(value, 0)

    return mark


def _rows_unbacked(modulation: Modulation) -> None:
    """ExternalModulation's `on_set` under dynamic compiled blocks: the rows' count is the forward's timestep count,
    unbacked as `temb`'s is (the blocks read the rows instead of projecting temb); the block count and the rows'
    width are static."""
    _mark_static_but(modulation.blocks, 1)
    torch._dynamo.decorators.mark_unbacked(modulation.blocks, 1)


class CompiledBlocks:
    """The blocks of a `nn.ModuleList` run through one compiled forward. Invariant: while applied, every
    block's `forward` is the shared compiled function bound to that block; `remove()` restores the class's."""

    def __init__(self, blocks: nn.ModuleList, options: CompileOptions = CompileOptions(),
                 modulation: ExternalModulation | None = None, lora_active: Callable[[], bool] = lambda: False):
        if len(blocks) == 0:
            raise ValueError("no blocks to compile")
        kinds = {type(block) for block in blocks}
        if len(kinds) != 1:
            raise ValueError(f"the repeated blocks are of several classes: {sorted(k.__name__ for k in kinds)}")
        self.blocks = blocks
        self.options = options
        self.modulation = modulation  # online AdaLN: the rows the blocks read, marked as `temb` is
        self.lora_active = lora_active  # an unfused adapter is on: its scale, a float, is a graph input
        self._forward = kinds.pop().forward
        self.precompiled: PrecompiledGraphs | None = None
        self._applied = False
        self._frames_at_apply = 0
        self._breaks_at_apply = 0
        self._frames_at_warmup: int | None = None
        self.warmup_s: float | None = None
        self.warmup_forwards: int | None = None

    def apply(self) -> CompiledBlocks:
        if self._applied:
            raise RuntimeError("the blocks are already compiled")
        if self.options.cache_dir is not None:
            # Read by inductor whenever it resolves its cache (process-wide: one engine per process).
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = writable_folder(self.options.cache_dir)
        # dynamic=True, with the inputs' sizes that do not vary marked static (`_dynamic_sizes`). Not dynamo's default
        # (None) with the varying ones marked dynamic instead: the tensors a graph break hands on (the SP exchange)
        # carry no marks, so after one the sequence would be static and each new length would recompile.
        options = {"backend": self.options.backend, "dynamic": self.options.dynamic}
        if self.options.backend == "inductor" and self.options.inductor_mode != "default":
            options["mode"] = self.options.inductor_mode
        self._compiled = torch.compile(self._forward, **options)
        # What compile.precompiled keeps: torch 2.11 gives a compiled function its `aot_compile` only on this flag.
        aot = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
        with torch._dynamo.config.patch(**aot):
            self._whole = torch.compile(self._forward, fullgraph=True, **options)
        self._mark = _dynamic_sizes(self._forward) if self.options.dynamic else (lambda args, kwargs: None)
        self._keep_whole = (self.options.precompiled and self.options.backend == "inductor"
                            and self.options.cache_dir is not None)
        for block in self.blocks:
            block.forward = functools.partial(self._call, block)
        if self.modulation is not None and self.options.dynamic and not self._keep_whole:
            self.modulation.on_set = _rows_unbacked
        self._frames_at_apply, self._breaks_at_apply = self._compiles(), _graph_breaks()
        self._applied = True
        return self

    def _dynamo_settings(self):
        # Floats constant but a LoRA scale's (the module docstring says why). No fake-tensor dispatch cache: on a
        # block with symbolic sizes it costs more than it saves (one trace repeats few (op, shapes) pairs, and each
        # entry made or replayed rebuilds its outputs' sizes through sympy); the graph is the same without it. On CPU
        # with inductor a warm start's warm-up took 3.22 s instead of 3.78 (bench/results/compile-smoke-inductor-*).
        return torch._dynamo.config.patch(specialize_float=not self.lora_active(), fake_tensor_cache_enabled=False)

    def _call(self, *args, **kwargs):
        """A block's forward (`args[0]` the block): a whole graph kept in the cache folder, or dynamo's."""
        graph = self._whole_graph(args, kwargs) if self._keep_whole else None
        if graph is not None:
            return graph(*args, **kwargs)
        self._mark(args, kwargs)
        with self._dynamo_settings():
            return self._compiled(*args, **kwargs)

    def _whole_graph(self, args: tuple, kwargs: dict) -> Callable | None:
        """A saved graph whose guards accept this call, else one compiled whole and saved now; None once this
        process cannot keep the forward whole (the regular trace serves it)."""
        if self.precompiled is None:  # read at the first call: the warm-up's time counts the load
            self.precompiled = PrecompiledGraphs.open(os.path.join(self.options.cache_dir, PRECOMPILED_FOLDER),
                                                      self._forward)
        graph = self.precompiled.find(args, kwargs)
        if graph is not None or self.precompiled.off_reason is not None:
            return graph
        # Sizes are marked for this trace only, not at every call (nor online AdaLN's rows at every set): a saved
        # graph's guards come back without the marks its trace saw (torch keeps its tensors as bare meta copies), so
        # they accept unmarked tensors only. A graph compiled in this process accepts both.
        self._mark(args, kwargs)
        rows = self.modulation is not None and self.options.dynamic
        if rows:
            # Marked on a copy, set for this trace only: the plan cache may hand these rows' tensors to later
            # forwards, which the loaded graphs would then refuse. (A view would not do: its guards hold for views.)
            current = self.modulation.current_rows()
            traced_rows = Modulation(current.blocks.clone(), current.final.clone())
            _rows_unbacked(traced_rows)
            self.modulation.set(traced_rows)
        # The saved guards keep the block's callable attributes: not this engine's forward (its closure is the engine).
        block = args[0]
        installed = block.__dict__.pop("forward")
        try:
            with self._dynamo_settings():
                graph = self.precompiled.compile(self._whole, args, kwargs)
        finally:
            block.forward = installed
            if rows:
                self.modulation.set(current)
        if graph is None and rows:
            self.modulation.on_set = _rows_unbacked  # dynamo's trace reads the marks at any call from now on
            _rows_unbacked(current)
        return graph

    def remove(self) -> None:
        for block in self.blocks:
            del block.forward  # the instance attribute; the class's forward shows again
        if self.modulation is not None:
            self.modulation.on_set = None
        self._applied = False

    def warmup_ended(self, seconds: float, forwards: int) -> None:
        """The engine's warm-up ran (`forwards` transformer forwards in `seconds`): later compiles are counted as
        `since_warmup`."""
        self._frames_at_warmup = self._compiles()
        self.warmup_s = seconds
        self.warmup_forwards = forwards

    def _compiles(self) -> int:
        """Graphs compiled so far in this process: dynamo's frames and whole graphs compiled ahead of time."""
        return _frames_compiled() + (self.precompiled.compiled if self.precompiled is not None else 0)

    def stats(self) -> CompileStats:
        frames = self._compiles()
        after = frames - (self._frames_at_warmup if self._frames_at_warmup is not None else self._frames_at_apply)
        return CompileStats(frames_compiled=frames - self._frames_at_apply, since_warmup=after,
                            graph_breaks=_graph_breaks() - self._breaks_at_apply, warmup_s=self.warmup_s,
                            warmup_forwards=self.warmup_forwards,
                            graphs_loaded=self.precompiled.loaded if self.precompiled is not None else 0,
                            graphs_load_s=self.precompiled.load_s if self.precompiled is not None else 0.0)
