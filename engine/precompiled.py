"""Compiled block graphs kept whole in `compile.cache_dir` (`compile.precompiled`), so a warm start traces nothing.

Inductor's cache keeps a graph's kernels, but a restarted replica still has dynamo trace the block to find them:
the larger part of a warm start's warm-up. torch's `aot_compile` keeps the whole result instead: the captured graph,
inductor's code and kernels, and the guards that say which calls it serves. A start loads every saved graph of the
block's forward and each call runs the first whose guards accept it; a call none accepts compiles one more that way
and saves it (the warm-up's, at the first start). A forward dynamo cannot capture whole (the sequence-parallel
exchange breaks the graph) or a graph torch cannot serialize turns this off for the process: its calls then take
the regular compiled path.

What retires a saved graph:
- its guards: the block's weight shapes and dtypes, its norms' eps, the attention backend, which LoRA layers are in
  it, the input sizes a dynamic graph specialized;
- torch's system check at load: Python, torch, CUDA and Triton versions, the GPU model;
- here: the source of every module it inlined, whole. Guards on globals are not kept in a saved graph, so a module
  constant that changed would pass them; any edit of such a module retires the graph instead.
A retired graph stays on disk (another replica version may share the folder) and is not loaded.

Files are `<generation>-<sha256 of their bytes>.pt2`, written atomically (replicas saving the same graph write the
same file). The generation hashes the Python and torch versions and the forward's own module: a start reads only its
generation's files, so the graphs of earlier deploys in a shared folder cost it nothing.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: `compile.cache_dir`'s subfolder of saved graphs.
FOLDER = "precompiled"
SUFFIX = ".pt2"
#: Float restarts of one whole-graph trace (torch.compile allows as many as the floats it found; the H3 block
#: with LoRA layers on needs one).
MAX_RESTARTS = 8


def _sources_unchanged(graph) -> str | None:
    """None when every module `graph` inlined still has the source it was traced from, else the first that differs."""
    for source in graph.source_info().inlined_sources:
        try:
            current = inspect.getsource(importlib.import_module(source.module))
        except (ImportError, OSError, TypeError):
            return source.module
        if current != source.content:
            return source.module
    return None


def generation(forward: Callable) -> str:
    """What names the files a start of `forward` reads: Python, torch and the forward's module source."""
    digest = hashlib.sha256()
    for part in (sys.version, torch.__version__, inspect.getsource(inspect.getmodule(forward))):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _checked_by_find(graph):
    """`graph` without its own guard check on each call: `find` ran it (torch 2.11's graphs lack the switch and check
    twice, some microseconds)."""
    if hasattr(graph, "disable_guard_check"):
        graph.disable_guard_check()
    return graph


@dataclass
class PrecompiledGraphs:
    """The saved graphs of one block forward in `folder`. Invariant: every graph in `graphs` was loaded from or
    written to `folder` in this process, and its guards decide alone which calls it runs (its own check is off:
    `find` ran it)."""

    folder: Path
    prefix: str  # this forward's generation: the files it reads and writes
    graphs: list = field(default_factory=list)  # torch._dynamo.aot_compile.AOTCompiledFunction
    loaded: int = 0  # graphs read from disk at open
    load_s: float = 0.0  # open's seconds: reading them, torch's and the sources' checks
    compiled: int = 0  # graphs compiled (and saved) by this process
    off_reason: str | None = None  # why this process stopped compiling more (None: it compiles)

    @classmethod
    def open(cls, folder: str | os.PathLike, forward: Callable) -> PrecompiledGraphs:
        """The graphs of `forward` saved in `folder` (made if missing) that torch and the sources still accept."""
        began = time.perf_counter()
        from torch.compiler import load_compiled_function

        # The globals the graph's code reads (peft's LoRA layers read `torch` there): the forward's module's.
        scope = ({"f_globals": forward.__globals__}
                 if "f_globals" in inspect.signature(load_compiled_function).parameters else {})
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        graphs = []
        prefix = generation(forward)
        for path in sorted(folder.glob(f"{prefix}-*{SUFFIX}")):
            try:
                with open(path, "rb") as file:
                    graph = load_compiled_function(file, **scope)
                changed = _sources_unchanged(graph)
            except Exception as exc:  # another torch, GPU or Python, or a file cut short: not this process's graph
                logger.info("precompiled graph %s not loaded: %s", path.name, str(exc).splitlines()[0] if str(exc)
                            else type(exc).__name__)
                continue
            if changed is not None:
                logger.info("precompiled graph %s not loaded: the source of %s changed since it was traced",
                            path.name, changed)
                continue
            graphs.append(_checked_by_find(graph))
        return cls(folder, prefix, graphs, loaded=len(graphs), load_s=time.perf_counter() - began)

    def find(self, args: tuple, kwargs: dict) -> Callable | None:
        """The first graph whose guards accept this call (the block and its inputs), or None."""
        for index, graph in enumerate(self.graphs):
            if graph.guard_check(*args, **kwargs):
                if index:  # calls come in runs of one graph (50 blocks, a request's steps): check it first next time
                    self.graphs.insert(0, self.graphs.pop(index))
                return graph
        return None

    @staticmethod
    def _aot_compile(compile_forward: Callable, args: tuple, kwargs: dict):
        """`compile_forward.aot_compile` with dynamo's float restarts: a float traced as an input that AOTAutograd
        cannot keep as one (a norm's eps beside a LoRA scale) is recorded to be a constant and the trace restarts.
        torch.compile restarts by itself; aot_compile raises instead, the record kept for the next attempt."""
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.symbolic_convert import TensorifyState

        try:
            for restarts in range(MAX_RESTARTS + 1):
                try:
                    return compile_forward.aot_compile((args, kwargs))
                except TensorifyScalarRestartAnalysis:
                    if restarts == MAX_RESTARTS:
                        raise
        finally:
            TensorifyState.clear()  # as torch.compile's frame does after its last attempt

    def compile(self, compile_forward: Callable, args: tuple, kwargs: dict) -> Callable | None:
        """Compile this call's graph ahead of time (`compile_forward`: `torch.compile(forward, fullgraph=True, ...)`,
        the caller's dynamo settings around this call), save it and keep it; None, and no more compiles in this
        process, when torch cannot capture or serialize it."""
        if self.off_reason is not None:
            return None
        try:
            graph = self._aot_compile(compile_forward, args, kwargs)
            data = type(graph).serialize(graph).serialized_data
        except Exception as exc:  # a graph break (fullgraph), a kernel or tensor subclass torch cannot serialize
            self.off_reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            logger.warning("compile.precompiled: this block forward cannot be kept whole (%s); its graphs compile "
                           "the regular way (traced at every start)", self.off_reason)
            return None
        path = self.folder / f"{self.prefix}-{hashlib.sha256(data).hexdigest()[:32]}{SUFFIX}"
        with tempfile.NamedTemporaryFile(dir=self.folder, prefix=".saving-", delete=False) as file:
            file.write(data)
        os.replace(file.name, path)  # whole or absent: a replica starting beside this one never reads half a graph
        self.graphs.insert(0, _checked_by_find(graph))
        self.compiled += 1
        return graph
