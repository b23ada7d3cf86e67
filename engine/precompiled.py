"""Compiled blocks kept on local disk across starts (`engine.compile.precompile`).

With a warm inductor cache a start still traces the block with dynamo and loads its graph through AOTAutograd and
inductor's caches (12.4 s of a 19.0 s start on an H200, bench/results/compile-nvidia-h200.md). torch's AOT
precompile (`torch.compile(fn).aot_compile`, experimental in torch 2.11-2.13) captures the whole block graph once,
its guards and bytecode with inductor's compiled code, and saves it; a later start loads that file instead of
tracing.

A saved graph is used only where it is what a fresh compile would make:
- its file sits under a key of what the guards do not see: torch and diffusers versions, the device, the compile
  options and the engine's context (attention backend, quantization): `PrecompiledGraphs.key`;
- torch refuses one made by another Python, torch, Triton or GPU (`check_compatibility` at load);
- every source dynamo inlined (diffusers' block, our AdaLN rows, the attention processor) still hashes as it did
  when traced (`_sources_unchanged`): an edited module makes it stale;
- each call checks the graph's guards (tensor shapes, dtypes, devices, module structure: an adapter's LoRA layers
  or FP8 weights are other guards) and falls through to the ordinary `torch.compile` when none matches.

The warm-up saves what it compiles (`CompiledBlocks`, while warming); a graph that cannot be captured whole or
serialized (the sequence-parallel exchange is a graph break; a tensor subclass torch cannot save) is logged once
and served by the ordinary compile. Loading a corrupt or refused file costs a log line, never the start.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: Folder (under the compile cache) holding one sub-folder per key.
PRECOMPILED_DIR = "ditserve-precompiled"


@dataclass(frozen=True)
class PrecompileStats:
    """What the precompiled store did in this process (`CompileStats.precompiled`)."""

    loaded: int  # graphs loaded from disk at start
    saved: int  # graphs the warm-up captured and saved
    served_calls: int  # block calls a loaded or saved graph ran
    refused: tuple[str, ...]  # why a file or a capture was not used (one line each)


def available() -> bool:
    """Whether this torch can save and load a compiled function (`aot_compile`: not in torch 2.11, in 2.13)."""
    return hasattr(torch.compiler, "load_compiled_function") and hasattr(torch.compile(available), "aot_compile")


@dataclass
class PrecompiledGraphs:
    """The saved block graphs of one key in `folder / key`: loaded at start, matched per call by their guards."""

    folder: Path
    key: str
    graphs: list[Callable[..., object]] = field(default_factory=list)
    saved: int = 0
    served_calls: int = 0
    refused: list[str] = field(default_factory=list)
    capture_failed: bool = False

    @staticmethod
    def key_of(options: object, context: str, device: torch.device) -> str:
        """What a graph depends on that its guards do not check: versions, device, options, the engine's context."""
        import diffusers

        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        material = "\n".join([torch.__version__, diffusers.__version__, sys.version, name, repr(options), context])
        return hashlib.sha256(material.encode()).hexdigest()[:20]

    @property
    def directory(self) -> Path:
        return self.folder / self.key

    def load(self) -> PrecompiledGraphs:
        """Every usable graph of this key (oldest first); the others are logged and counted in `refused`."""
        for path in sorted(self.directory.glob("*.bin")):
            try:
                with path.open("rb") as file:
                    graph = torch.compiler.load_compiled_function(file)
                stale = _changed_source(graph)
                if stale is not None:
                    raise RuntimeError(f"{stale} changed since it was traced")
            except Exception as exc:  # noqa: BLE001 - a bad file costs its use, never the start
                self._refuse(f"{path.name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            graph.disable_guard_check()  # `find` checks them once, before the call
            self.graphs.append(graph)
        if self.graphs:
            logger.info("precompiled blocks: %d graph(s) loaded from %s", len(self.graphs), self.directory)
        return self

    def find(self, args: tuple, kwargs: dict) -> Callable[..., object] | None:
        """The first loaded or saved graph whose guards accept this call."""
        for graph in self.graphs:
            if graph.guard_check(*args, **kwargs):
                self.served_calls += 1
                return graph
        return None

    def capture(self, forward: Callable[..., object], args: tuple, kwargs: dict, backend: str, mode: str | None,
                tracing: Callable[[], AbstractContextManager]) -> Callable[..., object] | None:
        """Capture `forward` whole for this call's inputs, save it, and keep it; None (logged once) when it cannot
        be captured or saved: the caller then runs the ordinary compile."""
        if self.capture_failed:
            return None
        options = {"backend": backend, "dynamic": True, "fullgraph": True} | ({"mode": mode} if mode else {})
        try:
            with tracing(), torch._dynamo.config.patch(specialize_float=True):
                graph = torch.compile(forward, **options).aot_compile((args, kwargs))
            self.directory.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(self.directory / f"{len(self.graphs) + 1:03d}-{_stamp()}.bin"))
        except Exception as exc:  # noqa: BLE001 - the ordinary compile serves what cannot be saved
            self.capture_failed = True
            self._refuse(f"capture: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
        graph.disable_guard_check()
        self.graphs.append(graph)
        self.saved += 1
        self.served_calls += 1
        return graph

    def stats(self) -> PrecompileStats:
        return PrecompileStats(loaded=len(self.graphs) - self.saved, saved=self.saved,
                               served_calls=self.served_calls, refused=tuple(self.refused))

    def _refuse(self, reason: str) -> None:
        logger.warning("precompiled blocks: not used: %s", reason)
        self.refused.append(reason)


def _stamp() -> str:
    import os
    import time

    return f"{int(time.time())}-{os.getpid()}"


def _inlined(graph: object) -> Iterator[tuple[str, int, int, str]]:
    for source in graph.source_info().inlined_sources:
        yield source.module, source.firstlineno, source.lastlineno, source.checksum


def _changed_source(graph: object) -> str | None:
    """The first module whose traced lines no longer hash as they did (torch records sha256 of the lines), or None."""
    for module_name, first, last, checksum in _inlined(graph):
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        lines = inspect.getsourcelines(module)[0][first - 1:last - 1]
        if hashlib.sha256("".join(lines).encode()).hexdigest() != checksum:
            return f"{module_name} (lines {first}-{last})"
    return None
