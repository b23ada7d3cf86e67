"""Regional compile of the transformer's repeated blocks (`engine.compile`).

Every `transformer_blocks[i]` gets one shared `torch.compile` of `MiniMaxH3TransformerBlock.forward` with the
block passed as an argument, so one compiled graph serves all 50 blocks (dynamo guards on the module's shapes,
not its identity) and the module's own `__call__` stays eager. That keeps every hook we hang on a block outside
the graph: the offloader's pre/post forward hooks (`offload/`), Cache-DiT's wrapper around the block stack and
the pre-hooks of tests. What runs inside a block is inside the graph: ExternalModulation's `_BlockRows` (it
reads the forward's rows as a graph input), the attention processor with the backend `engine.attention` chose,
and the sequence-parallel processor's compute (its exchanges are `torch.compiler.disable`d, so the graph breaks
around them: `parallel.sequence`).

The sequence dimension is dynamic (`dynamic: true`): one graph serves every token count, so a canvas or a
prompt length never seen before does not recompile; dynamo still specializes a forward of one timestep (the
first step of a schedule) apart from one of several, so a warm-up runs whole schedules. `dynamic: false` gives
one graph per token count (each prompt length recompiles): for measuring the static graph, not for serving.

Compiled and eager differ by reassociation (bf16 fusion): the bound is stated where it is tested
(tests/test_compiled_blocks.py) and measured per block at the released width (bench/forward.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

CompileBackend = Literal["inductor", "aot_eager", "eager"]


class WarmupCanvas(BaseModel):
    """One request shape the engine runs at start so no request pays the compile."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    width: int = Field(..., ge=32, description="Pixels.")
    height: int = Field(..., ge=32, description="Pixels.")
    seconds: float = Field(..., gt=0, description="Clip length (snapped as a request's is).")
    steps: int = Field(..., ge=2, description="Sampling grid points (a whole schedule: steps - 1 forwards).")


class CompileConfig(BaseModel):
    """`engine.compile`: regional `torch.compile` of the transformer blocks."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mode: Literal["off", "blocks"] = Field(
        "off", description="blocks: compile each repeated transformer block (one shared graph); off: eager.")
    backend: CompileBackend = Field(
        "inductor", description="torch.compile backend: inductor (fused kernels, what serves); aot_eager / "
        "eager trace without generating kernels (CPU tests of the capture, guards and recompiles).")
    dynamic: bool = Field(
        True, description="Symbolic sequence length: one graph for every canvas and prompt length. false: a "
        "graph per token count (each new prompt length recompiles).")
    inductor_mode: Literal["default", "max-autotune-no-cudagraphs"] = Field(
        "default", description="Inductor's mode (max-autotune-no-cudagraphs: longer compile, tuned GEMMs; "
        "CUDA graphs stay off: the offloader and the SP exchange run between blocks).")
    cache_dir: str | None = Field(
        None, description="Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR) on local disk, so a restarted or "
        "scaled-out replica loads its kernels instead of compiling them; null: inductor's default (/tmp/...).")
    warmup: tuple[WarmupCanvas, ...] = Field(
        (), description="Canvases the engine runs at start (a random prompt embedding, seed 0), so the first "
        "request of these shapes pays no compile.")


@dataclass(frozen=True)
class CompileStats:
    """Dynamo's frame counters for this process (`describe()["forward"]["compile"]`, `GenerationStats`)."""

    frames_compiled: int  # graphs dynamo compiled since the blocks were wrapped
    since_warmup: int  # of those, compiled after the warm-up ended (the serving goal: 0)
    graph_breaks: int
    warmup_s: float | None  # None: no warm-up ran


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


class CompiledBlocks:
    """The blocks of a `nn.ModuleList` run through one compiled forward. Invariant: while applied, every
    block's `forward` is the shared compiled function bound to that block; `remove()` restores the class's."""

    def __init__(self, blocks: nn.ModuleList, config: CompileConfig):
        if config.mode != "blocks":
            raise ValueError(f"CompiledBlocks needs engine.compile.mode: blocks (got {config.mode})")
        if len(blocks) == 0:
            raise ValueError("no blocks to compile")
        kinds = {type(block) for block in blocks}
        if len(kinds) != 1:
            raise ValueError(f"the repeated blocks are of several classes: {sorted(k.__name__ for k in kinds)}")
        self.blocks = blocks
        self.config = config
        self._forward = kinds.pop().forward
        self._applied = False
        self._frames_at_apply = 0
        self._breaks_at_apply = 0
        self._frames_at_warmup: int | None = None
        self.warmup_s: float | None = None

    def apply(self) -> CompiledBlocks:
        if self._applied:
            raise RuntimeError("the blocks are already compiled")
        if self.config.cache_dir is not None:
            # Read by inductor whenever it resolves its cache (process-wide: one engine per process).
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(self.config.cache_dir)
        options = {"backend": self.config.backend, "dynamic": self.config.dynamic}
        if self.config.backend == "inductor" and self.config.inductor_mode != "default":
            options["mode"] = self.config.inductor_mode
        compiled = torch.compile(self._forward, **options)
        for block in self.blocks:
            block.forward = functools.partial(compiled, block)
        self._frames_at_apply, self._breaks_at_apply = _frames_compiled(), _graph_breaks()
        self._applied = True
        return self

    def remove(self) -> None:
        for block in self.blocks:
            del block.forward  # the instance attribute; the class's forward shows again
        self._applied = False

    def warmup_ended(self, seconds: float) -> None:
        """The engine's warm-up ran: later compiles are counted as `since_warmup`."""
        self._frames_at_warmup = _frames_compiled()
        self.warmup_s = seconds

    def stats(self) -> CompileStats:
        frames = _frames_compiled()
        after = frames - (self._frames_at_warmup if self._frames_at_warmup is not None else self._frames_at_apply)
        return CompileStats(frames_compiled=frames - self._frames_at_apply, since_warmup=after,
                            graph_breaks=_graph_breaks() - self._breaks_at_apply, warmup_s=self.warmup_s)
