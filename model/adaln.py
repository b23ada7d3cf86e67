"""AdaLN modulation of diffusers' `MiniMaxH3Transformer3DModel`, computed apart from its forward.

In diffusers every block calls `adaln_proj(temb)` (`linear(silu(temb).to(bf16))`, viewed as
`[M*3 rows (timestep, modality), 6 chunks * hidden]`) and `norm_out` calls `linear(silu(temb).to(bf16))`
(`[M, 2 chunks (shift, scale) * hidden]`), with `temb = time_embedder(time_proj(timestep))` in fp32 and M the
step's distinct timesteps. This module splits that in two, bit for bit:

    x = adaln_input(transformer, timesteps)            # bf16 [M, time_embed_dim]: what every linear receives
    modulation = resident_modulation(transformer, x)   # every block's and norm_out's linear, M rows each
    external = ExternalModulation.install(transformer) # the forward reads rows instead of projecting
    external.set(modulation); transformer(...)         # once per forward

so a transformer built without its AdaLN weights (13 B of H3's 33 B parameters) can be served from rows the
plan cache (cache/plan_cache.py) keeps or rebuilds from the checkpoint. `H3Adaln` is the transformer as the
cache's `AdalnModel`.

diffusers is imported inside the functions that touch a transformer: `cache.plan_cache` imports this module,
and processes that only move plan rows (the node pool's actors) should not pay diffusers' ~2.5 s import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from diffusers import MiniMaxH3Transformer3DModel

#: Modality rows per timestep in a block's modulation (video, text, audio) and chunks per row
#: (shift, scale, gate for attention, then for the MLP): adaln_width = 3 * 6 * hidden.
NUM_MODALITIES = 3
NUM_BLOCK_CHUNKS = 6
#: Chunks of the final modulation (shift, scale): final_adaln_width = 2 * hidden.
NUM_FINAL_CHUNKS = 2


class ModulationError(ValueError):
    """AdaLN input that does not fit the transformer: timesteps not fp32 [M], or a Modulation of another
    shape or dtype than its projections'."""


@dataclass
class Modulation:
    """One step's AdaLN modulation for its M distinct timesteps (the blocks' dtype, bf16 for H3).

    blocks: [num_blocks, M, adaln_width]; row m of block i is `transformer_blocks[i].adaln_proj.linear` of
            adaln_input[m], laid out as [3 modalities, 6 chunks, hidden].
    final:  [M, final_adaln_width]; `norm_out.linear` of adaln_input[m], laid out as [shift, scale] x hidden.
    """

    blocks: Tensor
    final: Tensor

    @property
    def num_rows(self) -> int:
        return self.final.shape[0]

    def to(self, device: torch.device | str) -> Modulation:
        return Modulation(self.blocks.to(device), self.final.to(device))


class AdalnDims(Protocol):
    """Shapes of a model's AdaLN projections: `model.weights.H3TransformerConfig` and every `AdalnModel` have
    these (`cache.rebuild.resolve_adaln_units` checks a checkpoint against them)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def time_embed_dim(self) -> int: ...

    @property
    def adaln_width(self) -> int: ...

    @property
    def final_adaln_width(self) -> int: ...

    @property
    def torch_dtype(self) -> torch.dtype: ...


class AdalnModel(AdalnDims, Protocol):
    """What the AdaLN plan cache needs from a model (cache/plan_cache.py).

    `unit_names()`: (module name, block index or None for the final layer) of every projection, blocks first;
    `{name}.weight` / `{name}.bias` are checkpoint tensor names. `resident_projections()`: the resident
    (weight, bias) pairs in the same order (resident mode only)."""

    @property
    def device(self) -> torch.device: ...

    def adaln_input(self, timesteps: Tensor) -> Tensor: ...

    def resident_modulation(self, adaln_input: Tensor) -> Modulation: ...

    def resident_projections(self) -> list[tuple[Tensor, Tensor]]: ...

    def unit_names(self) -> list[tuple[str, int | None]]: ...


# ---------------------------------------------------------------------------------------------------------
# The two halves of diffusers' AdaLN path
# ---------------------------------------------------------------------------------------------------------


def _parameter_dtype(module: nn.Module) -> torch.dtype:
    from diffusers.models.modeling_utils import get_parameter_dtype

    return get_parameter_dtype(module)


def adaln_dtype(transformer: MiniMaxH3Transformer3DModel) -> torch.dtype:
    """The dtype diffusers casts `silu(temb)` to before the projections, and theirs (bf16 for H3).

    Asked of `norm_out.linear` the way diffusers asks it, where that holds weights (or, after
    `ExternalModulation.install`, the module carrying their dtype). Weights never loaded are on meta in the
    dtype the model was built in, not the checkpoint's; then the answer is the block stack's dtype, which the
    published AdaLN projections share (the plan cache checks the checkpoint's adaln tensors against it)."""
    linear = transformer.norm_out.linear
    if isinstance(linear, nn.Linear) and linear.weight.is_meta:
        return _parameter_dtype(transformer.transformer_blocks[0].attn.to_out[0])
    return _parameter_dtype(linear)


@torch.no_grad()
def adaln_input(transformer: MiniMaxH3Transformer3DModel, timesteps: Tensor) -> Tensor:
    """timesteps fp32 [M] (unscaled, in [0, 1]) -> [M, time_embed_dim] in the AdaLN dtype: exactly the tensor
    every `adaln_proj.linear` and `norm_out.linear` receives in diffusers' forward, on the time embedder's
    device."""
    if timesteps.dtype != torch.float32 or timesteps.dim() != 1:
        raise ModulationError(f"timesteps must be a 1-D float32 tensor, got {timesteps.dtype} "
                              f"{list(timesteps.shape)}")
    time_embedder = transformer.time_embedder
    temb = transformer.time_proj(timesteps.to(time_embedder.linear_1.weight.device))
    temb = time_embedder(temb.to(_parameter_dtype(time_embedder)))  # fp32 [M, time_embed_dim]
    # silu at temb's precision, then the cast (diffusers: `linear(silu(temb).to(dtype))`).
    return F.silu(temb).to(adaln_dtype(transformer))


@torch.no_grad()
def resident_modulation(transformer: MiniMaxH3Transformer3DModel, adaln_input: Tensor) -> Modulation:
    """Every block's `adaln_proj.linear` and `norm_out.linear` on adaln_input [M, time_embed_dim], each called
    with exactly these M rows, as diffusers' forward calls them (so the bits match)."""
    _check_resident(transformer)
    blocks = torch.stack([block.adaln_proj.linear(adaln_input) for block in transformer.transformer_blocks])
    final = transformer.norm_out.linear(adaln_input)
    return Modulation(blocks=blocks, final=final)  # [num_blocks, M, adaln_width], [M, final_adaln_width]


def _check_resident(transformer: MiniMaxH3Transformer3DModel) -> None:
    """RuntimeError unless the transformer holds its AdaLN weights (a meta weight would "project" silently)."""
    if isinstance(transformer.norm_out.linear, _FinalRows):
        raise RuntimeError("this transformer serves external modulation (ExternalModulation.install): it has no "
                           "AdaLN weights to project")
    linears = [block.adaln_proj.linear for block in transformer.transformer_blocks] + [transformer.norm_out.linear]
    if any(linear.weight.is_meta or linear.bias.is_meta for linear in linears):
        raise RuntimeError("this transformer was built without its AdaLN weights (they are on meta)")


# ---------------------------------------------------------------------------------------------------------
# Serving the forward from precomputed rows
# ---------------------------------------------------------------------------------------------------------


class _Rows(nn.Module):
    """Base of the modules standing in for the projections. The empty buffer carries the projection's dtype:
    diffusers casts the projection's input to `get_parameter_dtype(module)`, which needs a floating tensor."""

    def __init__(self, source: ExternalModulation, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.source = source
        self.register_buffer("dtype_marker", torch.empty(0, dtype=dtype, device=device), persistent=False)


class _BlockRows(_Rows):
    """Replaces `transformer_blocks[i].adaln_proj`: temb [M, ...] -> the six [M*3, hidden] chunks of row block i."""

    def __init__(self, source: ExternalModulation, index: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(source, dtype, device)
        self.index = index
        self.hidden_size = hidden_size
        # The block's index as a tensor too, the one thing the forward reads that differs between blocks: a
        # compiled block's graph takes it as an input like a weight (one graph serves every block), where the int
        # would be a constant of the graph (a graph per block) or, traced as an input, would make every module int
        # symbolic (the heads, so the head dim: slower kernels and a longer trace; `engine.compiled`).
        self.register_buffer("row_index", torch.tensor([index], device=device), persistent=False)

    def forward(self, temb: Tensor) -> tuple[Tensor, ...]:
        # The row count was checked against temb's by the block's pre-hook (`ExternalModulation._check_rows`):
        # outside the block's compiled graph, where the count is symbolic.
        blocks = self.source.current_rows().blocks  # [num_blocks, M, 3 * 6 * hidden]
        if torch.compiler.is_compiling():
            # Gathered as [1, M * 3 * 6 * hidden]: a chunk handed across a graph break (sequence parallelism) has it
            # as its base, whose guards then hold for every M (with [1, M, ...] they pinned the warm-up's M of 1).
            rows = blocks.flatten(1).index_select(0, self.row_index)
        else:
            rows = blocks[self.index]  # a view: eager launches no gather
        # [M*3, 6 * hidden] -> 6 x [M*3, hidden], as MiniMaxH3AdaLayerNormModulation returns them.
        return rows.reshape(-1, NUM_BLOCK_CHUNKS * self.hidden_size).chunk(NUM_BLOCK_CHUNKS, dim=-1)

    def extra_repr(self) -> str:
        return f"block={self.index}"


class _FinalRows(_Rows):
    """Replaces `norm_out.linear`: silu(temb) [M, ...] -> the step's final rows [M, 2 * hidden]. norm_out runs
    last in a forward, so it also marks the step's modulation as used."""

    def forward(self, adaln_input: Tensor) -> Tensor:
        rows = self.source.current(adaln_input.shape[0]).final
        self.source.consume()
        return rows


class ExternalModulation:
    """Feeds a transformer's AdaLN from precomputed `Modulation` rows instead of its projections.

    `ExternalModulation.install(transformer)` replaces every `transformer_blocks[i].adaln_proj` and
    `norm_out.linear` (their weights may be on meta, as `model.loading.load_transformer(...,
    skip=model.weights.is_adaln_param)` leaves them). Then, per forward: `set(modulation)` with the step's
    rows on the transformer's device. One `set` serves one forward: norm_out's module marks it used, so a
    forward without a fresh `set` raises RuntimeError instead of reusing the previous step's rows, and so
    does a forward whose timestep count differs from the rows' (each block's forward pre-hook checks it, before
    the block runs: outside a compiled block's graph, as a clear error rather than an out-of-range gather).
    """

    def __init__(self, num_blocks: int, hidden_size: int, dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._modulation: Modulation | None = None
        #: Called with each modulation `set` accepts (compiled blocks mark its row count dynamic:
        #: `engine.compiled.CompiledBlocks`).
        self.on_set: Callable[[Modulation], None] | None = None

    @classmethod
    def install(cls, transformer: MiniMaxH3Transformer3DModel) -> ExternalModulation:
        if isinstance(transformer.norm_out.linear, _FinalRows):
            raise RuntimeError("ExternalModulation is already installed on this transformer")
        dtype = adaln_dtype(transformer)
        hidden_size = transformer.config.hidden_size
        external = cls(len(transformer.transformer_blocks), hidden_size, dtype)
        for index, block in enumerate(transformer.transformer_blocks):
            # The replacement lives where the block's other weights are (its norm is never an adaln param).
            device = _real_device(block.norm1.weight)
            block.adaln_proj = _BlockRows(external, index, hidden_size, dtype, device)
            block.register_forward_pre_hook(external._check_rows, with_kwargs=True)
        transformer.norm_out.linear = _FinalRows(external, dtype, _real_device(transformer.norm_out.norm.weight))
        return external

    @property
    def adaln_width(self) -> int:
        return NUM_MODALITIES * NUM_BLOCK_CHUNKS * self.hidden_size

    @property
    def final_adaln_width(self) -> int:
        return NUM_FINAL_CHUNKS * self.hidden_size

    def stand_in(self, num_rows: int, device: torch.device) -> Modulation:
        """Zero rows for a forward of `num_rows` timesteps, shaped and typed as a plan's (`set` takes them): a
        compile warm-up's, whose output nobody reads, so it needs no plan from the checkpoint."""
        return Modulation(torch.zeros(self.num_blocks, num_rows, self.adaln_width, dtype=self.dtype, device=device),
                          torch.zeros(num_rows, self.final_adaln_width, dtype=self.dtype, device=device))

    def set(self, modulation: Modulation) -> None:
        """The rows of the next forward (blocks [num_blocks, M, adaln_width], final [M, final_adaln_width])."""
        m = modulation.num_rows
        expected_blocks = (self.num_blocks, m, self.adaln_width)
        if tuple(modulation.blocks.shape) != expected_blocks or \
                tuple(modulation.final.shape) != (m, self.final_adaln_width):
            raise ModulationError(
                f"modulation blocks {list(modulation.blocks.shape)} / final {list(modulation.final.shape)} do not "
                f"fit this transformer: expected {list(expected_blocks)} / {[m, self.final_adaln_width]}"
            )
        if modulation.blocks.dtype != self.dtype or modulation.final.dtype != self.dtype:
            raise ModulationError(
                f"modulation is {modulation.blocks.dtype}/{modulation.final.dtype}; the transformer's AdaLN "
                f"dtype is {self.dtype}"
            )
        if self.on_set is not None:
            self.on_set(modulation)
        self._modulation = modulation

    def clear(self) -> None:
        """Forget the rows (e.g. after a failed forward)."""
        self._modulation = None

    def current(self, num_timesteps: int) -> Modulation:
        """The rows set for this forward; RuntimeError if none or if they are for another timestep count."""
        modulation = self.current_rows()
        if modulation.num_rows != num_timesteps:
            raise RuntimeError(
                f"the forward has {num_timesteps} distinct timesteps but the modulation set for it has "
                f"{modulation.num_rows} rows"
            )
        return modulation

    def current_rows(self) -> Modulation:
        """The rows set for this forward, their count unchecked; RuntimeError if none."""
        if self._modulation is None:
            raise RuntimeError("the transformer runs on external AdaLN modulation: call ExternalModulation.set("
                               "modulation) before each forward")
        return self._modulation

    def _check_rows(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        """A block's forward pre-hook: its `temb` (the forward's distinct timesteps) against the rows set (diffusers
        calls a block with `(hidden_states, temb, ...)`, cache-dit too, positional or by keyword)."""
        temb = kwargs["temb"] if "temb" in kwargs else args[1]
        self.current(temb.shape[0])

    def consume(self) -> None:
        self._modulation = None


def _real_device(tensor: Tensor) -> torch.device:
    """`tensor`'s device, or cpu for a meta tensor (weights not loaded yet are moved with the module)."""
    return torch.device("cpu") if tensor.is_meta else tensor.device


# ---------------------------------------------------------------------------------------------------------
# The transformer as the plan cache's AdalnModel
# ---------------------------------------------------------------------------------------------------------


class H3Adaln:
    """`AdalnModel` view of a `MiniMaxH3Transformer3DModel` (resident, or built without AdaLN weights)."""

    def __init__(self, transformer: MiniMaxH3Transformer3DModel):
        from diffusers import MiniMaxH3Transformer3DModel

        if not isinstance(transformer, MiniMaxH3Transformer3DModel):
            raise TypeError(f"H3Adaln wraps a MiniMaxH3Transformer3DModel, got {type(transformer).__name__}")
        self.transformer = transformer
        config = transformer.config
        self.num_blocks = len(transformer.transformer_blocks)
        self.time_embed_dim = config.time_embed_dim
        self.adaln_width = NUM_MODALITIES * NUM_BLOCK_CHUNKS * config.hidden_size
        self.final_adaln_width = NUM_FINAL_CHUNKS * config.hidden_size
        self.torch_dtype = adaln_dtype(transformer)

    @property
    def device(self) -> torch.device:
        return self.transformer.time_embedder.linear_1.weight.device

    def adaln_input(self, timesteps: Tensor) -> Tensor:
        return adaln_input(self.transformer, timesteps)

    def resident_modulation(self, adaln_input: Tensor) -> Modulation:
        return resident_modulation(self.transformer, adaln_input)

    def resident_projections(self) -> list[tuple[Tensor, Tensor]]:
        _check_resident(self.transformer)
        linears = [block.adaln_proj.linear for block in self.transformer.transformer_blocks]
        linears.append(self.transformer.norm_out.linear)
        return [(linear.weight, linear.bias) for linear in linears]

    def unit_names(self) -> list[tuple[str, int | None]]:
        from model.weights import adaln_unit_names

        return adaln_unit_names(self.num_blocks)
